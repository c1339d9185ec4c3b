"""The base of every tagged message between a controller, its agents and their workers.

A message is a msgspec struct tagged by its `type` field, so both ends encode and decode one typed
value instead of reading keys out of bare dicts; unknown fields are ignored on decode, so a newer
peer can add fields.
"""
from __future__ import annotations

import msgspec


class Message(msgspec.Struct, kw_only=True, tag_field="type", omit_defaults=False):
    """Base of commands, events and worker messages: tagged by `type`."""


def encode(msg: msgspec.Struct) -> dict:
    """A message as plain JSON-able data (with its `type`)."""
    return msgspec.to_builtins(msg)

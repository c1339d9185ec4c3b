"""What a job's command line runs: a Python interpreter with a script or a module, or anything else.

Shared by the CLI (which checks the script exists before anything starts) and the controller
(which runs the script from the code version's snapshot)."""
from __future__ import annotations

import os
import re


def is_python(exe: str) -> bool:
    """Does `exe` name a Python interpreter (python, python3, python3.11, a venv's bin/python)?"""
    return re.fullmatch(r"python[0-9.]*", os.path.basename(exe)) is not None


def python_target(command: list[str]) -> tuple[int, str] | None:
    """For `python [options] (-m MOD | -c CODE | SCRIPT) ...`: (index of SCRIPT, "script") or
    (index of MOD, "module"); None for anything else."""
    if not command or not is_python(command[0]):
        return None
    i = 1
    while i < len(command) and command[i].startswith("-") and command[i] not in ("-m", "-c", "-"):
        i += 2 if command[i] in ("-W", "-X", "-Q") else 1
    if i >= len(command) or command[i] in ("-c", "-"):
        return None
    if command[i] == "-m":
        return (i + 1, "module") if i + 1 < len(command) else None
    return i, "script"

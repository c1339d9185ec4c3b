"""The controller's side of an agent's channel, per message: read a masked client frame, answer
with an unmasked one. stalwart's hand-written codec (`stalwart/transport/websocket.py`) against the sans-I/O
library wsproto (`wsproto.Connection`, server side) on the same frames, in one run.

    python bench/ws_codec.py [--messages 200000] [--rounds 3]

The payloads are the channel's typical sizes (a beat, an ack, an event batch, a command push:
180, 260, 900 and 4,000 bytes, in turn). Prints microseconds per message for each, the best of
`--rounds`, and the ratio. A CPU figure of one process: run it alone on the host.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from stalwart.transport import websocket as ws
SIZES = (180, 260, 900, 4000)


def ours(frames: list[bytes], n: int) -> float:
    reader = ws.FrameReader(1 << 20, masked=True)
    t0 = time.perf_counter()
    for i in range(n):
        (_, payload), = reader.feed(frames[i % len(frames)])
        ws.frame(ws.OP_BINARY, payload[:64], masked=False)
    return (time.perf_counter() - t0) / n


def wsproto_server(frames: list[bytes], n: int) -> float:
    from wsproto import ConnectionType
    from wsproto.connection import Connection
    from wsproto.events import BytesMessage
    conn = Connection(ConnectionType.SERVER)
    t0 = time.perf_counter()
    for i in range(n):
        conn.receive_data(frames[i % len(frames)])
        for ev in conn.events():
            conn.send(BytesMessage(data=bytes(ev.data)[:64]))
    return (time.perf_counter() - t0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if a.messages < 1 or a.rounds < 1:
        ap.error("--messages and --rounds must be >= 1")
    try:
        import wsproto  # noqa: F401
    except ImportError:
        print("error: wsproto is not installed (pip install wsproto)", file=sys.stderr)
        return 2
    frames = [ws.frame(ws.OP_BINARY, os.urandom(n), masked=True) for n in SIZES]
    best = {"stalwart": float("inf"), "wsproto": float("inf")}
    for _ in range(a.rounds):      # alternated, best of each
        best["stalwart"] = min(best["stalwart"], ours(frames, a.messages))
        best["wsproto"] = min(best["wsproto"], wsproto_server(frames, a.messages))
    for name, s in best.items():
        print(f"{name:10s} {s * 1e6:7.2f} us/message")
    print(f"wsproto / stalwart: {best['wsproto'] / best['stalwart']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

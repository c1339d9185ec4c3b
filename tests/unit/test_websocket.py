"""The WebSocket frames of the agents' channel (stalwart/transport/websocket.py): what a client writes a server
reads back whole (fragments joined, control frames as they come), the handshake's key, masking
required one way and refused the other, and an oversized message refused from its header with its
payload passed over, so that the stream can be read on (the peer's close comes after it)."""
import struct

from stalwart.transport import websocket as ws
def test_the_handshake_key_is_rfc_6455s_example():
    assert ws.accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_masking_is_its_own_inverse_and_frames_round_trip_at_every_length_form():
    key = b"\x01\x02\x03\x04"
    assert ws.mask(key, ws.mask(key, b"hello world")) == b"hello world" and ws.mask(key, b"") == b""
    server = ws.FrameReader(1 << 20, masked=True)
    client = ws.FrameReader(1 << 20, masked=False)
    for n in (0, 1, 125, 126, 65535, 65536, 200_000):
        payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
        assert server.feed(ws.frame(ws.OP_BINARY, payload, masked=True)) == [(ws.OP_BINARY, payload)]
        assert client.feed(ws.frame(ws.OP_BINARY, payload, masked=False)) == [(ws.OP_BINARY, payload)]
    assert server.error is None and client.error is None


def test_a_stream_cut_anywhere_gives_the_same_messages():
    stream = b"".join([ws.frame(ws.OP_BINARY, b"a" * 300, masked=True), ws.frame(ws.OP_PING, b"p", masked=True),
                       ws.frame(ws.OP_TEXT, b"t", masked=True)])
    for cut in range(1, len(stream)):
        r = ws.FrameReader(1 << 20, masked=True)
        got = r.feed(stream[:cut]) + r.feed(stream[cut:])
        assert got == [(ws.OP_BINARY, b"a" * 300), (ws.OP_PING, b"p"), (ws.OP_TEXT, b"t")], cut


def unfinished(opcode: int, payload: bytes) -> bytes:
    f = bytearray(ws.frame(opcode, payload, masked=True))
    f[0] &= 0x7F                                    # FIN off
    return bytes(f)


def test_fragments_are_joined_and_control_frames_may_come_between_them():
    r = ws.FrameReader(1 << 20, masked=True)
    got = r.feed(unfinished(ws.OP_BINARY, b"one ") + ws.frame(ws.OP_PING, b"!", masked=True)
                 + unfinished(ws.OP_CONT, b"two ") + ws.frame(ws.OP_CONT, b"three", masked=True))
    assert got == [(ws.OP_PING, b"!"), (ws.OP_BINARY, b"one two three")] and r.error is None
    # a continuation with nothing to continue is a protocol error
    r = ws.FrameReader(1 << 20, masked=True)
    assert r.feed(ws.frame(ws.OP_CONT, b"x", masked=True)) == [] and r.error.code == ws.CLOSE_PROTOCOL


def test_masking_is_required_of_clients_and_refused_of_servers():
    r = ws.FrameReader(1 << 20, masked=True)
    assert r.feed(ws.frame(ws.OP_BINARY, b"x", masked=False)) == [] and r.error.code == ws.CLOSE_PROTOCOL
    r = ws.FrameReader(1 << 20, masked=False)
    assert r.feed(ws.frame(ws.OP_BINARY, b"x", masked=True)) == [] and r.error.code == ws.CLOSE_PROTOCOL


def test_an_oversized_message_is_refused_from_its_header_and_passed_over():
    r = ws.FrameReader(1000, masked=True)
    big = ws.frame(ws.OP_BINARY, b"y" * 5000, masked=True)
    before = ws.frame(ws.OP_BINARY, b"first", masked=True)
    # the messages before it are still read; the refusal comes with the big frame's header
    assert r.feed(before + big[:300]) == [(ws.OP_BINARY, b"first")]
    assert r.error is not None and r.error.code == ws.CLOSE_TOO_BIG
    # the rest of its payload is skipped, and what follows (the peer's close) is read
    close = ws.frame(ws.OP_CLOSE, struct.pack("!H", 1000), masked=True)
    assert r.feed(big[300:4000]) == [] and r.error is None
    assert r.feed(big[4000:] + close) == [(ws.OP_CLOSE, struct.pack("!H", 1000))]
    # fragments count together
    r = ws.FrameReader(1000, masked=True)
    assert r.feed(unfinished(ws.OP_BINARY, b"z" * 600) + ws.frame(ws.OP_CONT, b"z" * 600, masked=True)) == []
    assert r.error.code == ws.CLOSE_TOO_BIG


def test_bad_control_frames_and_reserved_bits_are_protocol_errors():
    for raw in (ws.frame(ws.OP_PING, b"x" * 126, masked=True),            # control frame over 125
                unfinished(ws.OP_PING, b"x"),                              # fragmented control frame
                bytes([0x80 | 0x40 | ws.OP_BINARY]) + ws.frame(ws.OP_BINARY, b"x", masked=True)[1:],
                bytes([0x80 | 0x3]) + ws.frame(ws.OP_BINARY, b"x", masked=True)[1:]):   # unknown opcode
        r = ws.FrameReader(1 << 20, masked=True)
        assert r.feed(raw) == [] and r.error.code == ws.CLOSE_PROTOCOL, raw

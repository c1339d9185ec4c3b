"""A training thread's report goes straight to the agent's socket only when that cannot block."""
import socket
import threading

from stalwart.jsonlines import JsonLineSocket


def test_send_nowait_writes_whole_lines_and_refuses_when_the_buffer_is_full_or_held():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    out, into = JsonLineSocket(a), JsonLineSocket(b)
    try:
        assert out.send_nowait({"type": "step", "step": 0}) and into.recv() == {"type": "step", "step": 0}
        sent = 0
        while out.send_nowait({"step": sent, "pad": "x" * 300}):      # the agent reads nothing
            sent += 1
            assert sent < 100_000
        assert sent > 10 and not out.send_nowait({"step": -1, "pad": "x" * 300})   # full: refused, not blocked
        assert [into.recv()["step"] for _ in range(sent)] == list(range(sent))   # none torn or lost
        assert out.send_nowait({"step": "again"}) and into.recv() == {"step": "again"}
        held = threading.Event()
        release = threading.Event()

        def hold():
            with out._wlock:                      # another thread is sending
                held.set()
                release.wait(5)
        t = threading.Thread(target=hold)
        t.start()
        held.wait(5)
        assert not out.send_nowait({"step": "busy"})
        release.set()
        t.join(5)
    finally:
        a.close()
        b.close()

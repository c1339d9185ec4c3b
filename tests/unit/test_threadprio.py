"""Background threads of a training process run at the lowest priority; the others keep theirs."""
import os
import threading

from stalwart.worker.threadprio import BACKGROUND_NICE, background_thread


def test_only_the_calling_thread_is_lowered():
    seen: dict[str, int] = {}

    def bg() -> None:
        background_thread()
        seen["bg"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=bg)
    t.start()
    t.join()
    assert seen["bg"] == BACKGROUND_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before

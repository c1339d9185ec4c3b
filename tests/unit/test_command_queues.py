"""Agents' long polls (controller/api/commands.py): a command wakes only its machine's poll, from any
thread; a poll with nothing for it ends at its wait; close answers every poll at once."""
import asyncio
import threading
import time

from stalwart.controller.api.commands import CommandQueues


def test_a_command_wakes_only_its_machines_poll_and_others_time_out():
    q = CommandQueues()

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        a = asyncio.create_task(q.take("m0", 5.0))
        b = asyncio.create_task(q.take("m1", 0.3))
        await asyncio.sleep(0.05)
        threading.Thread(target=q.put, args=("m0", {"type": "stop"})).start()    # a job's thread
        got_a = await a
        ta = loop.time() - t0
        got_b = await b
        return got_a, ta, got_b, loop.time() - t0

    got_a, ta, got_b, tb = asyncio.run(main())
    assert got_a == [{"type": "stop"}] and ta < 2.0
    assert got_b == [] and 0.25 <= tb < 4.0
    assert q.pending("m0") == 0


def test_commands_queued_before_the_poll_come_at_once_and_close_answers_waiting_polls():
    q = CommandQueues()
    q.put("m0", {"type": "a"})
    q.put("m0", {"type": "b"})

    async def main():
        first = await q.take("m0", 5.0)
        waiting = [asyncio.create_task(q.take("m0", 20.0)), asyncio.create_task(q.take("m1", 20.0))]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        q.close()
        rest = await asyncio.gather(*waiting)
        return first, rest, time.monotonic() - t0, await q.take("m2", 20.0)

    first, rest, took, later = asyncio.run(main())
    assert [c["type"] for c in first] == ["a", "b"]
    assert rest == [[], []] and took < 5.0 and later == []


def test_a_cancelled_poll_leaves_nothing_behind():
    q = CommandQueues()

    async def main():
        t = asyncio.create_task(q.take("m0", 10.0))
        await asyncio.sleep(0.05)
        t.cancel()
        try:
            await t
        except asyncio.CancelledError:
            pass
        q.put("m0", {"type": "x"})
        return await q.take("m0", 1.0)

    assert asyncio.run(main()) == [{"type": "x"}]
    assert q._waiters == {}


def test_a_channels_pusher_is_woken_for_its_machine_only_and_commands_can_come_back():
    """An agent with a channel (controller/api/channel.py) has a pusher attached: a command for its
    machine wakes it on the loop (from a job's thread); a write that failed gives the commands
    back, first in line, for the machine's next channel or poll."""
    q = CommandQueues()

    async def main():
        loop = asyncio.get_running_loop()
        woke: list[str] = []
        done = asyncio.Event()

        def pusher(machine: str):
            def wake():
                woke.append(machine)
                done.set()
            return wake
        w0, w1 = pusher("m0"), pusher("m1")
        q.attach("m0", loop, w0)
        q.attach("m1", loop, w1)
        threading.Thread(target=q.put, args=("m0", {"type": "stop"})).start()
        await asyncio.wait_for(done.wait(), 5)
        first = q.take_now("m0")
        q.put("m0", {"type": "later"})
        q.give_back("m0", first)                 # (the socket went away before the write)
        again = q.take_now("m0")
        q.detach("m0", w1)                       # (not its pusher: kept)
        q.detach("m0", w0)
        q.put("m0", {"type": "unheard"})
        await asyncio.sleep(0.05)
        return woke, first, again

    woke, first, again = asyncio.run(main())
    assert woke[0] == "m0" and "m1" not in woke
    assert first == [{"type": "stop"}]
    assert [c["type"] for c in again] == ["stop", "later"]
    assert q.pending("m0") == 1 and q.pending("m1") == 0


def test_a_pusher_attached_after_commands_were_queued_is_woken_at_once():
    q = CommandQueues()
    q.put("m0", {"type": "start"})

    async def main():
        done = asyncio.Event()
        q.attach("m0", asyncio.get_running_loop(), done.set)
        await asyncio.wait_for(done.wait(), 5)
        return q.take_now("m0")

    assert asyncio.run(main()) == [{"type": "start"}]

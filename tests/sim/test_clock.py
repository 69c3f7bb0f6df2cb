"""The virtual-time event loop: timers jump, real I/O still works, deadlocks are reported."""

from __future__ import annotations

import asyncio

import pytest

from rlkit.sim.clock import VirtualTimeDeadlock, VirtualTimeLoop, run_virtual


def test_sleep_and_timeouts_run_in_virtual_time():
    async def main():
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualTimeLoop)
        await asyncio.sleep(3600)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), timeout=5)
        done, pending = await asyncio.wait([asyncio.ensure_future(asyncio.sleep(7))], timeout=1)
        for t in pending:
            t.cancel()
        return loop.time(), len(done)

    now, done = run_virtual(main, start=10.0)
    assert now == pytest.approx(10 + 3600 + 5 + 1)
    assert done == 0


def test_threads_still_wake_the_loop():
    async def main():
        return await asyncio.to_thread(lambda: 42)

    assert run_virtual(main) == 42


def test_a_loop_waiting_for_nothing_reports_a_deadlock():
    async def main():
        await asyncio.Event().wait()

    with pytest.raises(VirtualTimeDeadlock, match="no timer is pending"):
        run_virtual(main, idle_timeout_s=0.05)

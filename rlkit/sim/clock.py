"""A virtual-time asyncio event loop: simulated hours pass in milliseconds of real time.

`VirtualTimeLoop` is a stock `SelectorEventLoop` whose `time()` is a virtual clock. When the
loop would block waiting for its next timer, the clock jumps straight to that timer instead.
Everything built on `loop.time()` and timers (`asyncio.sleep`, `wait_for`, `asyncio.wait(...,
timeout=)`, `call_at`) therefore runs unchanged, in virtual time: the RolloutManager, the
policies and the buffer's async API need no change to be simulated.

Real I/O still works (self-pipe wake-ups from threads, `asyncio.to_thread`): the loop always
polls real file descriptors first, and only blocks on them (in real time, up to
`idle_timeout_s`) when no timer is pending at all. A loop with nothing scheduled and nothing
arriving is deadlocked; it raises `VirtualTimeDeadlock` rather than hanging.

Why not `looptime`: it is not installed here and is built around pytest fixtures; the suite and
`rlkit bench suite` need a loop outside pytest, and this is about forty lines with no
dependency.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")


class VirtualTimeDeadlock(RuntimeError):
    """Nothing is scheduled and no real I/O arrived: the simulation can never move again."""


class _VirtualSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """A real selector whose blocking waits advance the virtual clock instead of sleeping."""

    def __init__(self, loop: "VirtualTimeLoop") -> None:
        super().__init__()
        self._vloop = loop

    def select(self, timeout: float | None = None) -> list:
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only real I/O (threads) can wake us
            events = super().select(self._vloop.idle_timeout_s)
            if not events:
                raise VirtualTimeDeadlock(
                    f"virtual-time loop at t={self._vloop.time():.3f}: no timer is pending and "
                    f"no I/O arrived for {self._vloop.idle_timeout_s} s of real time "
                    "(a task waits for something nobody will ever do)"
                )
            return events
        self._vloop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock is virtual and jumps to the next timer when idle."""

    def __init__(self, start: float = 0.0, idle_timeout_s: float = 60.0) -> None:
        self._virtual_now = float(start)
        self.idle_timeout_s = idle_timeout_s
        super().__init__(selector=_VirtualSelector(self))

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"virtual time cannot go back ({seconds} s)")
        self._virtual_now += seconds


def run_virtual(
    main: Awaitable[T] | Callable[[], Awaitable[T]],
    *,
    start: float = 0.0,
    idle_timeout_s: float = 60.0,
    debug: bool = False,
) -> T:
    """Run a coroutine to completion on a fresh VirtualTimeLoop (like asyncio.run)."""
    with asyncio.Runner(
        debug=debug, loop_factory=lambda: VirtualTimeLoop(start, idle_timeout_s)
    ) as runner:
        coro: Any = main() if callable(main) else main
        return runner.run(coro)

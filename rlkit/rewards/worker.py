"""Where synchronous reward functions run, so that one that never returns cannot hold anything.

A sync reward may block forever (a hung network call, `while True: pass`). Python cannot stop a
thread, and `asyncio.to_thread` uses the loop's default executor: a few hung calls fill it
(min(32, cpus + 4) threads), starving every later reward and every other `to_thread` user, and
`asyncio.run` joins those threads at exit, so the process never ends. Two runners bound this:

- `ProcessRewardRunner` (reward.isolation: process, the default): a bounded pool of worker
  processes (`python -m rlkit.rewards.worker`). The function travels by reference (pickle names
  its module and qualified name; the worker imports it), so it must be importable at module
  level: built-ins, entry points and dotted paths are. A call that is cancelled (the reward
  timeout fired) kills its worker; the next call starts a fresh one. Nothing survives the parent.
- `ThreadRewardRunner` (reward.isolation: thread): for functions that cannot be pickled or need
  the parent's state. One daemon thread per call, at most `workers` at a time. A timed-out call
  gives its slot back at once and its thread is abandoned (counted in `stuck`; daemon threads
  never block exit); at `max_stuck` abandoned threads still running, sync rewards fail at once
  rather than pile up more spinning threads.

Wire format between parent and worker: 4-byte big-endian length, then a pickle.
Parent -> worker: (fn_bytes, sample, kwargs). Worker -> parent: ("ok", value) |
("error", "TypeName: message") | ("invalid", "description of an unpicklable return value").
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any, Callable

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")


class RewardCallError(RuntimeError):
    """A sync reward raised in its worker process (or raised SystemExit in a thread).
    `reward_error` is 'TypeName: message' of what it raised
    (rollout.reward_scheduler.describe_error)."""

    def __init__(self, reward_error: str) -> None:
        super().__init__(reward_error)
        self.reward_error = reward_error


class RewardValueNotSendable(RuntimeError):
    """A sync reward in a worker process returned a value that cannot travel back (pickle): a
    contract violation like a string would be, so the scheduler counts it as invalid."""

    reward_invalid = True


class RewardWorkerDied(RuntimeError):
    """A reward worker process ended mid-call (the reward called os._exit, crashed the
    interpreter, or was killed from outside)."""


class RewardThreadsStuck(RuntimeError):
    """Thread isolation: too many abandoned reward threads are still running."""


def picklable_reference(fn: Callable[..., Any]) -> bytes:
    """fn pickled for a worker process, or ValueError saying why it cannot go there."""
    try:
        return pickle.dumps(fn)
    except Exception as e:  # lambdas, closures, functions assigned under another name
        name = getattr(fn, "__qualname__", repr(fn))
        raise ValueError(
            f"sync reward {name} cannot be sent to a reward worker process ({type(e).__name__}: "
            f"{e}); define it at module level of an importable module, make it async, or set "
            "rollout.reward.isolation: thread"
        ) from None


# -- process isolation: the parent side ------------------------------------------------------

_live_runners: "weakref.WeakSet[ProcessRewardRunner]" = weakref.WeakSet()


@atexit.register
def _kill_all_workers() -> None:
    for runner in list(_live_runners):
        runner.close()


class _Worker:
    def __init__(self) -> None:
        env = dict(os.environ)
        # the parent's import path, so plugins found here (e.g. a --target install) import there
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlkit.rewards.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True,
        )
        self._out = self.proc.stdout.fileno()  # type: ignore[union-attr]
        os.set_blocking(self._out, False)

    async def call(self, payload: bytes) -> tuple[str, Any]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bytes] = loop.create_future()
        buf = bytearray()

        def readable() -> None:
            try:
                chunk = os.read(self._out, 1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                chunk, err = b"", e
            else:
                err = None
            if not chunk:
                loop.remove_reader(self._out)
                if not done.done():
                    done.set_exception(EOFError(err))
                return
            buf.extend(chunk)
            if len(buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf)
                if len(buf) >= _HEADER.size + n and not done.done():
                    loop.remove_reader(self._out)
                    done.set_result(bytes(buf[_HEADER.size:_HEADER.size + n]))

        loop.add_reader(self._out, readable)
        try:
            # the worker is idle and reading, so this blocking write drains as fast as it reads
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError as e:
            loop.remove_reader(self._out)
            raise RewardWorkerDied(f"reward worker process {self.proc.pid} is gone ({e})") from None
        try:
            reply = await done
        except EOFError as e:  # it closed its stdout: it is exiting, so this wait is short
            try:
                code: int | None = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
            raise RewardWorkerDied(
                f"reward worker process {self.proc.pid} ended mid-call (exit code {code}"
                f"{'' if e.args[0] is None else f', {e.args[0]}'})") from None
        finally:
            loop.remove_reader(self._out)
        return pickle.loads(reply)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)  # SIGKILL: immediate; reaps the zombie
        except subprocess.TimeoutExpired:
            pass


class _Slots:
    """At most `limit` holders; waiters are futures of whichever loop is running (a runner may
    outlive one asyncio.run, as in `rlkit check-reward`), so no loop-bound asyncio primitive."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        while self.held >= self.limit:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if fut in self._waiters:
                    self._waiters.remove(fut)
        self.held += 1

    def release(self) -> None:
        self.held -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                try:
                    fut.set_result(None)
                    return
                except RuntimeError:  # its loop is closed: nobody waits there any more
                    continue


class ProcessRewardRunner:
    """Runs sync rewards in at most `workers` worker processes; a cancelled call kills its
    worker. `killed` counts workers killed mid-call (timeouts), `started` workers started."""

    def __init__(self, workers: int = 4) -> None:
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.workers = workers
        self._slots = _Slots(workers)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self.started = 0
        self.killed = 0
        _live_runners.add(self)

    async def run(self, fn_bytes: bytes, sample: Any, kwargs: dict[str, Any]) -> Any:
        payload = pickle.dumps((fn_bytes, sample, kwargs))  # before taking a worker: may raise
        await self._slots.acquire()
        worker: _Worker | None = None
        finished = False
        try:
            worker = self._idle.pop() if self._idle else self._start()
            kind, value = await worker.call(payload)
            finished = True
        finally:
            if worker is not None and finished:
                self._idle.append(worker)
            elif worker is not None:  # cancelled (timeout), or died: never reuse it
                if worker.proc.poll() is None:
                    self.killed += 1
                    log.warning("killing reward worker %d: its call was cancelled (timeout)",
                                worker.proc.pid)
                worker.kill()
                self._all.discard(worker)
            self._slots.release()
        if kind == "ok":
            return value
        if kind == "invalid":
            raise RewardValueNotSendable(value)
        raise RewardCallError(value)

    def _start(self) -> _Worker:
        w = _Worker()
        self._all.add(w)
        self.started += 1
        return w

    def close(self) -> None:
        """Kill every worker (idle ones would exit on their own once our pipes close)."""
        for w in list(self._all):
            w.kill()
        self._all.clear()
        self._idle.clear()


# -- thread isolation ------------------------------------------------------------------------

class ThreadRewardRunner:
    """Runs sync rewards on daemon threads, at most `workers` at a time; a cancelled call frees
    its slot and leaves its thread behind (counted in `stuck` while it runs)."""

    def __init__(self, workers: int = 4, max_stuck: int = 8) -> None:
        if workers < 1:
            raise ValueError(f"reward workers must be >= 1, got {workers}")
        self.workers = workers
        self.max_stuck = max_stuck
        self._slots = _Slots(workers)
        self._lock = threading.Lock()
        self.stuck = 0  # abandoned threads still running a reward

    async def run(self, fn: Callable[..., Any], sample: Any, kwargs: dict[str, Any]) -> Any:
        if self.stuck >= self.max_stuck:
            raise RewardThreadsStuck(
                f"{self.stuck} reward threads are still running calls that timed out "
                f"(reward.max_stuck={self.max_stuck}); a sync reward that never returns cannot be "
                "stopped in a thread: fix it, or use rollout.reward.isolation: process")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()
        state = {"abandoned": False}

        def settle(ok: bool, value: Any) -> None:
            if not done.done():
                (done.set_result if ok else done.set_exception)(value)

        def body() -> None:
            try:
                result: tuple[bool, Any] = (True, fn(sample, **kwargs))
            except Exception as e:  # noqa: BLE001 - handed to the awaiting coroutine
                result = (False, e)
            except BaseException as e:  # SystemExit in a reward must not stop the event loop
                result = (False, RewardCallError(f"{type(e).__name__}: {e}"))
            with self._lock:
                state["returned"] = True
                if state["abandoned"]:
                    self.stuck -= 1
                    return
            try:
                loop.call_soon_threadsafe(settle, *result)
            except RuntimeError:  # the loop closed meanwhile
                pass

        await self._slots.acquire()
        ended = False
        try:
            threading.Thread(target=body, name="rlkit-reward", daemon=True).start()
            try:
                return await done
            except asyncio.CancelledError:
                raise
            except BaseException:
                ended = True
                raise
            else:
                ended = True
        finally:
            if not ended:  # cancelled (the timeout): the thread runs on, on its own
                with self._lock:
                    if not state.get("returned"):
                        state["abandoned"] = True
                        self.stuck += 1
            self._slots.release()

    def close(self) -> None:
        """Nothing to stop: abandoned threads are daemons."""


# -- process isolation: the worker side ------------------------------------------------------

def _read_exact(f: Any, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _watch_parent(ppid: int) -> None:
    """Exit when the parent is gone, even while the reward spins in the main thread."""
    import time

    while os.getppid() == ppid:
        time.sleep(1.0)
    os._exit(1)


def _worker_main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    # Replies go on a private copy of stdout; the reward's own prints go to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    inp = sys.stdin.buffer
    fns: dict[bytes, Callable[..., Any]] = {}
    while True:
        header = _read_exact(inp, _HEADER.size)
        if header is None:
            return  # the parent closed our stdin: done
        body = _read_exact(inp, _HEADER.unpack(header)[0])
        if body is None:
            return
        try:
            fn_bytes, sample, kwargs = pickle.loads(body)
            fn = fns.get(fn_bytes) or fns.setdefault(fn_bytes, pickle.loads(fn_bytes))
            value = fn(sample, **kwargs)
            if hasattr(value, "__await__"):  # a sync function that returned an awaitable
                async def _wait(v: Any = value) -> Any:
                    return await v

                value = asyncio.run(_wait())
            reply: tuple[str, Any] = ("ok", value)
        except BaseException as e:  # noqa: BLE001 - SystemExit too: the reward's error, not ours
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            data = pickle.dumps(reply)
        except Exception as e:  # noqa: BLE001 - e.g. a generator or an open file returned
            data = pickle.dumps(("invalid", f"reward returned {reply[1]!r} "
                                 f"({type(reply[1]).__name__}), which cannot be sent back from "
                                 f"the worker ({type(e).__name__}); expected a float"))
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


if __name__ == "__main__":
    _worker_main()

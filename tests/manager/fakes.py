"""In-process engines for manager tests: deterministic lengths, real asyncio concurrency,
aborts that keep partial tokens, cancellation, injectable failures."""

from __future__ import annotations

import asyncio
import itertools
from typing import Callable

from rlkit.buffers import Sample
from rlkit.rollout.engine_api import EngineError


class FakeEngines:
    def __init__(
        self,
        length: Callable[[Sample], int],
        *,
        workers: int = 2,
        tick: float = 0.001,
        chunk: int = 4,
        fail: Callable[[Sample], bool] = lambda s: False,
    ) -> None:
        self.length, self.tick, self.chunk, self.fail = length, tick, chunk, fail
        self._workers = [f"fake{i}" for i in range(workers)]
        self._next = 0
        self._running: dict[int, str] = {}  # id(request) -> worker
        self._aborted: set[int] = set()
        self.requests = 0
        self.aborts = 0
        self._rids = itertools.count()
        # Set by a weight sync: spans are then stamped with it, as a real engine reports the
        # version of the weights that produced them (None: the version the request was sent at).
        self.weight_version: int | None = None

    def workers(self) -> list[str]:
        return list(self._workers)

    async def loads(self) -> dict[str, int]:
        load = {w: 0 for w in self._workers}
        for w in self._running.values():
            load[w] += 1
        return load

    async def probe(self, worker: str, timeout_s: float, *, generate: bool = True) -> str | None:
        return None  # in-process: always answers (the health monitor's periodic probe)

    async def progress(self, worker: str, timeout_s: float) -> int | None:
        return None

    async def abort_all(self) -> None:
        self.aborts += 1
        self._aborted.update(self._running)
        while self._running:  # until idle, like the real client
            await asyncio.sleep(self.tick)

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        assert max_new_tokens >= 1
        worker = worker or self._workers[self._next % len(self._workers)]
        self._next += 1
        self.requests += 1
        sample.start_request()
        rid = next(self._rids)
        self._running[rid] = worker
        try:
            if self.fail(sample):
                raise EngineError(f"{worker}: worker crashed")
            total = self.length(sample)
            todo = min(max_new_tokens, total - len(sample.response_ids))
            done = 0
            while done < todo:
                await asyncio.sleep(self.tick)
                if rid in self._aborted:
                    sample.interrupt()
                    return worker
                k = min(self.chunk, todo - done)
                sample.append([sample.slot + 1] * k, [-0.5] * k,
                              version if self.weight_version is None else self.weight_version)
                done += k
            reached = len(sample.response_ids) >= total
            sample.append([], [], version if self.weight_version is None else self.weight_version,
                          finish_reason="stop" if reached else "length")
            return worker
        except asyncio.CancelledError:
            sample.interrupt()
            raise
        finally:
            self._running.pop(rid, None)
            self._aborted.discard(rid)


async def constant_reward(sample, group) -> float:
    return float(len(sample.response_ids) % 3)

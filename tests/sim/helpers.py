"""Shared set-ups for the simulator tests."""

from __future__ import annotations

import asyncio
from typing import Sequence

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.sim.engine import SimConfig, SimEngines, SimWorker
from rlkit.rollout.engines.profile import EngineProfile, constant_profile

SAMPLING = SamplingConfig(max_new_tokens=1 << 20, ignore_eos=True)


def small_profile(**kw) -> EngineProfile:
    """PTL grows with the batch and with the KV held; prefill costs something."""
    args = dict(batch_sizes=(1, 4, 16), prefill_s_per_token=1e-4, kv_s_per_token=1e-6)
    args.update(kw)
    return constant_profile([0.010, 0.012, 0.020], **args)


class InvariantChecker:
    """Observer that checks every worker's invariants at every event and counts events."""

    def __init__(self) -> None:
        self.events = 0
        self.max_kv: dict[str, int] = {}

    def __call__(self, worker: SimWorker, phase: str) -> None:
        self.events += 1
        worker.check_invariants(phase)
        self.max_kv[worker.id] = max(self.max_kv.get(worker.id, 0), worker.kv_used)


async def generate_all(
    engines: SimEngines, prompts: Sequence[int], budgets: Sequence[int],
    arrivals: Sequence[float] | None = None, version: int = 0,
) -> list[Sample]:
    """Submit one request per (prompt length, budget), each at its arrival time."""
    samples = [Sample(i, i, [7] * p) for i, p in enumerate(prompts)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def one(i: int) -> None:
        if arrivals is not None:
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - loop.time()))
        await engines.generate(samples[i], SAMPLING, max_new_tokens=budgets[i], version=version)

    await asyncio.gather(*(one(i) for i in range(len(samples))))
    return samples


def cluster(engines: int = 1, **kw) -> SimConfig:
    profile = kw.pop("profile", None) or small_profile()
    return SimConfig(engines, profile, **kw)

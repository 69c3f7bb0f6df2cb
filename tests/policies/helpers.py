"""Hand-made traces and a simulated cluster for policy tests (virtual time, deterministic)."""

from __future__ import annotations

from typing import Callable, Sequence

from rlkit.buffers import ListPromptSource, RolloutBuffer
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.rollout.engines.profile import constant_profile
from rlkit.sim.trace import Trace, TraceRecord

PROFILE = constant_profile([0.004, 0.005, 0.008], [1, 16, 64], prefill_s_per_token=1e-5,
                           kv_s_per_token=1e-8, max_running_requests=256)


def make_trace(lengths: Callable[[int, int, int], int], *, rows: int, epochs: int, slots: int,
               group_size: int, cap: int = 4096) -> Trace:
    """A trace whose response `slot` to prompt `row` in `epoch` is lengths(row, epoch, slot)."""
    records = {
        (r, e): TraceRecord(r, e, prompt_len=8, difficulty=0.5, step=0,
                            lengths=tuple(min(cap, max(1, lengths(r, e, k))) for k in range(slots)))
        for r in range(rows) for e in range(epochs)
    }
    return Trace("hand-made", cap, group_size, rows, epochs, order_seed=0, batch_size=4,
                 vocab_size=64, records=records)


def in_order_buffer(trace: Trace, **kw) -> RolloutBuffer:
    """A buffer drawing the trace's rows in order 0, 1, 2, ... (no shuffle), epoch after epoch."""
    source = ListPromptSource(trace.prompt_records(), shuffle=False, name="hand-made")
    return RolloutBuffer(source, n_samples_per_prompt=trace.group_size,
                         max_staleness=kw.pop("max_staleness", 1000), **kw)


def simulate(trace: Trace, policy, *, steps: int, batch_size: int, buffer: RolloutBuffer,
             engines: int = 2, on_batch=None, first_step: int = 0, group_filter=None, ranker=None,
             final_step: bool = True):
    return run_simulation(SimConfig(engines, PROFILE), trace, policy, steps=steps,
                          batch_size=batch_size, buffer=buffer, on_batch=on_batch,
                          first_step=first_step, group_filter=group_filter, ranker=ranker,
                          final_step=final_step)


def rows_of(groups: Sequence) -> list[tuple[int, int]]:
    return sorted((g.prompt.source_index, g.prompt.epoch) for g in groups)

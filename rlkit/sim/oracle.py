"""The oracle length ranker: it knows every response's length from a trace, the upper bound a
ranker can reach. A measuring tool, so it lives with the simulator and reaches the runtime the
way a user's ranker does: by the `rlkit.rankers` entry point `oracle` (pyproject.toml)."""

from __future__ import annotations

from typing import Any, Sequence

from rlkit.buffers import Group
from rlkit.rollout.rankers.basic import Stateless
from rlkit.sim.trace import Trace


class OracleRanker(Stateless):
    """Knows every response's length from a trace (benchmarks only: the upper bound a ranker
    can reach). `trace`: a `rlkit.sim.trace.Trace` or the path of a trace file."""

    name = "oracle"

    def __init__(self, trace: Any) -> None:
        if isinstance(trace, str):
            trace = Trace.load(trace)
        self.trace = trace

    def predict(self, groups: Sequence[Group]) -> list[float]:
        out = []
        for g in groups:
            src, epoch = g.prompt.source_index, g.prompt.epoch
            lengths = [self.trace.length(src, epoch, s.slot) for s in g.samples]
            out.append(sum(lengths) / len(lengths))
        return out

    def predict_turns(self, groups: Sequence[Group]) -> list[float]:
        """The episodes' model turns (a multi-turn trace; 1 each in a single-turn one)."""
        if not self.trace.multi_turn:
            return [1.0] * len(groups)
        out = []
        for g in groups:
            src, epoch = g.prompt.source_index, g.prompt.epoch
            turns = [len(self.trace.episode(src, epoch, s.slot)) for s in g.samples]
            out.append(sum(turns) / len(turns))
        return out

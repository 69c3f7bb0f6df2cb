"""Workload traces: the natural response length of every (prompt, epoch, k-th response).

A trace fixes, for each prompt row `source_index`, each epoch and each response slot
(`Sample.slot`, the stable k-th response of a prompt), how many tokens the response runs
before it stops. Replayed through `TraceReplayEngines` the same trace drives simulated and
real engines, and every policy sees the same work: the key never involves the global sample
index, which depends on the policy.

File format (jsonl): a header line, then one line per (prompt, epoch):

    {"format": "rlkit.trace", "version": 1, "name": str, "cap": int, "group_size": int,
     "slots": int, "rows": int, "epochs": int, "order_seed": int, "batch_size": int,
     "vocab_size": int, "spec": {generator parameters} | null}
    {"source_index": int, "epoch": int, "prompt_len": int, "difficulty": float,
     "step": int, "lengths": [int, ... one per slot],
     "turns": [[[model tokens, tool s, observation tokens], ... per turn], ... per slot]}

`turns` (multi-turn traces, rlkit.sim.episodes; absent in single-turn ones) gives each episode's
turns; its length is then its response length: model and observation tokens, capped.

`lengths` are natural lengths already capped at `cap` (a length equal to the cap is a
truncated response). `difficulty` in [0, 1] is the prompt's rank by expected length (what a
length ranker tries to predict); rewards in the simulator pass with probability
1 - difficulty. `step` is the training step at which a synchronous run draws that prompt (the
prompt order is `EpochOrder(rows, order_seed)`, as `ListPromptSource` walks it).

The generator (`generate_trace`) draws per-prompt difficulty from a two-component mixture
(most prompts easy and short, a minority hard with lengths up to the cap), then each
response's length around its prompt's mean, so that lengths vary far more across prompts
than within a group. Its defaults are fitted at a 16k cap to the distributions reported in
docs/facts.md (P75 755-1.1k tokens, maxima at the cap, standard deviation 4,000-4,500 across a
batch, under 1,500 within a group) and scale with the cap. Optional growth multiplies every
prompt's mean length by (1 + growth_per_step) per training step (lengths grow as RL training
goes on).

A bimodal trace (`bimodal_spec`, `rlkit bench suite --long-share`) is the agentic shape: exactly
round(long_share x rows) prompts, a random choice, are long (mean near the cap, about 40% of
their responses at it: a long tool-using episode), the rest are the easy component (an answer
in one turn).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from rlkit.buffers.group import PromptRecord
from rlkit.buffers.source import EpochOrder

TRACE_FORMAT = "rlkit.trace"
TRACE_VERSION = 1


class TraceError(ValueError):
    """A trace file that does not follow the format, or a lookup the trace cannot answer."""


@dataclass(frozen=True)
class TraceSpec:
    """Parameters of the length generator (lengths relative to the cap are fractions of it)."""

    rows: int = 512
    epochs: int = 2
    group_size: int = 8
    slots: int | None = None  # responses per prompt in the trace; None: 2 x group_size
    cap: int = 16384
    seed: int = 0
    order_seed: int | None = None  # prompt order seed; None: seed
    batch_size: int = 32  # groups per training step (for growth and `step`)
    p_hard: float = 0.15  # share of hard prompts
    easy_median_frac: float = 0.0244  # easy prompts' median mean length (400 tokens at 16k)
    easy_sigma: float = 0.7  # log-normal spread of easy prompts' mean lengths
    hard_median_frac: float = 0.8  # hard prompts' median mean length, as a fraction of the cap
    hard_sigma: float = 0.6
    within_sigma: float = 0.35  # log-normal spread of responses around their prompt's mean
    min_length: int = 1
    growth_per_step: float = 0.0
    prompt_median: int = 150
    prompt_sigma: float = 0.4
    prompt_min: int = 16
    prompt_max: int = 1024
    vocab_size: int = 32000  # prompt token ids are drawn below this
    # How much a prompt's tokens say about its difficulty, in [0, 1]: that share of its tokens
    # are "topic words" of its difficulty band (8 recurring ids in each of 16 bands), and its
    # length is scaled by 1 + signal x (difficulty - 0.5). Real prompts carry such signal (StreamRL's ranker
    # premise); 0, the default, keeps token ids pure noise, so only per-prompt history ranks.
    prompt_signal: float = 0.0
    # Bimodal traces (`bimodal_spec`): exactly round(long_share x rows) prompts are hard, chosen
    # at random, instead of each one with probability p_hard. None: the long-tail mixture.
    long_share: float | None = None

    def __post_init__(self) -> None:
        if self.rows < 1 or self.epochs < 1 or self.group_size < 1 or self.cap < 1:
            raise ValueError("rows, epochs, group_size and cap must be >= 1")
        if self.slots is not None and self.slots < self.group_size:
            raise ValueError("slots must be >= group_size")
        if not 0 <= self.p_hard <= 1:
            raise ValueError("p_hard must be in [0, 1]")
        if self.growth_per_step < 0:
            raise ValueError("growth_per_step must be >= 0")
        if not 0 <= self.prompt_signal <= 1:
            raise ValueError("prompt_signal must be in [0, 1]")
        if self.long_share is not None and not 0 <= self.long_share <= 1:
            raise ValueError("long_share must be in [0, 1]")


def bimodal_spec(long_share: float, **kw: Any) -> TraceSpec:
    """A bimodal workload: `long_share` of the prompts long (mean length 0.9 x cap, little
    spread, so about 40% of their responses reach the cap), the rest short (the default easy
    component, median 2.4% of the cap). `kw`: any other TraceSpec field."""
    kw.setdefault("hard_median_frac", 0.9)
    kw.setdefault("hard_sigma", 0.05)
    return TraceSpec(long_share=long_share, **kw)


Turn = tuple[int, float, int]  # (model tokens, tool seconds, observation tokens)


@dataclass(frozen=True)
class TraceRecord:
    source_index: int
    epoch: int
    prompt_len: int
    difficulty: float
    step: int
    lengths: tuple[int, ...]
    # Multi-turn traces (rlkit.sim.episodes): per slot, the episode's turns, each (model tokens,
    # tool seconds, observation tokens); the last turn is the answer (0 s, 0 tokens). `lengths`
    # are then the episodes' response lengths (model + observation tokens, capped).
    turns: tuple[tuple[Turn, ...], ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"source_index": self.source_index, "epoch": self.epoch,
               "prompt_len": self.prompt_len, "difficulty": self.difficulty,
               "step": self.step, "lengths": list(self.lengths)}
        if self.turns is not None:
            out["turns"] = [[list(t) for t in episode] for episode in self.turns]
        return out


@dataclass
class Trace:
    name: str
    cap: int
    group_size: int
    rows: int
    epochs: int
    order_seed: int
    batch_size: int
    vocab_size: int
    records: dict[tuple[int, int], TraceRecord]
    spec: dict[str, Any] | None = None
    slots: int = field(init=False)
    multi_turn: bool = field(init=False)  # records carry episodes' turns

    def __post_init__(self) -> None:
        if not self.records:
            raise TraceError(f"trace {self.name!r} has no records")
        self.slots = min(len(r.lengths) for r in self.records.values())
        if self.slots < self.group_size:
            raise TraceError(f"trace {self.name!r}: records have fewer lengths than group_size")
        for r in self.records.values():
            if any(not 1 <= x <= self.cap for x in r.lengths):
                raise TraceError(
                    f"trace {self.name!r}: prompt {r.source_index} epoch {r.epoch} has a "
                    f"length outside [1, cap={self.cap}]"
                )
        kinds = {r.turns is not None for r in self.records.values()}
        if len(kinds) > 1:
            raise TraceError(f"trace {self.name!r}: some records have turns and some not")
        self.multi_turn = kinds == {True}
        for r in self.records.values() if self.multi_turn else ():
            if len(r.turns) != len(r.lengths) or any(  # type: ignore[arg-type]
                    not ep or min(m for m, _, _ in ep) < 1 or min(min(s, o) for _, s, o in ep) < 0
                    or min(self.cap, sum(m + o for m, _, o in ep)) != n
                    for ep, n in zip(r.turns, r.lengths)):  # type: ignore[arg-type]
                raise TraceError(
                    f"trace {self.name!r}: prompt {r.source_index} epoch {r.epoch}: every slot "
                    "needs turns of >= 1 model token, >= 0 s and observation tokens, summing "
                    "(capped) to its length")

    # -- lookups --------------------------------------------------------------------------
    def length(self, source_index: int, epoch: int, slot: int) -> int:
        """Natural length of the slot-th response to prompt `source_index` in `epoch`."""
        rec = self.records.get((source_index, epoch))
        if rec is None:
            raise TraceError(
                f"trace {self.name!r} has no record for prompt {source_index}, epoch {epoch} "
                f"({self.rows} prompts x {self.epochs} epochs): generate it with more epochs"
            )
        if not 0 <= slot < len(rec.lengths):
            raise TraceError(
                f"trace {self.name!r}: prompt {source_index} epoch {epoch} has "
                f"{len(rec.lengths)} response slots, slot {slot} asked (speculative responses "
                "need a trace with more slots)"
            )
        return rec.lengths[slot]

    def episode(self, source_index: int, epoch: int, slot: int) -> tuple[Turn, ...]:
        """The turns of the slot-th episode of prompt `source_index` in `epoch` (multi-turn)."""
        self.length(source_index, epoch, slot)  # the same checks, the same errors
        turns = self.records[(source_index, epoch)].turns
        if turns is None:
            raise TraceError(f"trace {self.name!r} is single-turn: it has no episodes")
        return turns[slot]

    def difficulty(self, source_index: int) -> float:
        return self.records[(source_index, 0)].difficulty

    def prompt_records(self) -> list[PromptRecord]:
        """One PromptRecord per row, with deterministic token ids of the trace's prompt
        lengths (the prompts the simulator and a replay on real engines both use)."""
        signal = float((self.spec or {}).get("prompt_signal", 0.0))
        bands, width = 16, 8  # a difficulty band's "topic words": a few recurring token ids
        out = []
        for i in range(self.rows):
            rec = self.records[(i, 0)]
            rng = np.random.default_rng([self.order_seed, i, 7])
            ids = rng.integers(10, max(11, self.vocab_size), rec.prompt_len)
            if signal > 0:  # a share of the tokens from the difficulty's band (TraceSpec)
                band = min(bands - 1, int(rec.difficulty * bands))
                banded = 10 + band * width + rng.integers(0, width, rec.prompt_len)
                ids = np.where(rng.random(rec.prompt_len) < signal, banded, ids)
            out.append(PromptRecord(tuple(int(x) for x in ids), text="", label=None,
                                    source_index=i, metadata={"difficulty": rec.difficulty}))
        return out

    def in_draw_order(self) -> Iterator[TraceRecord]:
        """Records in the order a run draws fresh prompts (ListPromptSource's order)."""
        order = EpochOrder(self.rows, self.order_seed, shuffle=True)
        for _ in range(self.rows * self.epochs):
            yield self.records[order.next()]

    # -- persistence ----------------------------------------------------------------------
    def header(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "name": self.name,
                "cap": self.cap, "group_size": self.group_size, "slots": self.slots,
                "rows": self.rows, "epochs": self.epochs, "order_seed": self.order_seed,
                "batch_size": self.batch_size, "vocab_size": self.vocab_size, "spec": self.spec}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps(self.header()) + "\n")
            for key in sorted(self.records):
                f.write(json.dumps(self.records[key].to_json()) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        path = Path(path)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise TraceError(f"cannot read trace {path}: {e}") from None
        return cls.from_lines(lines, str(path))

    @classmethod
    def from_lines(cls, lines: Iterable[str], where: str = "trace") -> "Trace":
        it = iter(enumerate(lines, 1))
        try:
            _, first = next(it)
            head = json.loads(first)
        except StopIteration:
            raise TraceError(f"{where}: empty file") from None
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}:1: not JSON ({e})") from None
        if not isinstance(head, dict) or head.get("format") != TRACE_FORMAT:
            raise TraceError(f"{where}:1: not an rlkit trace (no format={TRACE_FORMAT!r})")
        if head.get("version") != TRACE_VERSION:
            raise TraceError(f"{where}:1: trace version {head.get('version')!r}; this rlkit "
                             f"reads version {TRACE_VERSION}")
        records: dict[tuple[int, int], TraceRecord] = {}
        for n, line in it:
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                turns = d.get("turns")
                rec = TraceRecord(int(d["source_index"]), int(d["epoch"]), int(d["prompt_len"]),
                                  float(d["difficulty"]), int(d.get("step", 0)),
                                  tuple(int(x) for x in d["lengths"]),
                                  None if turns is None else tuple(
                                      tuple((int(m), float(t), int(o)) for m, t, o in ep)
                                      for ep in turns))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise TraceError(f"{where}:{n}: bad record ({type(e).__name__}: {e})") from None
            if (rec.source_index, rec.epoch) in records:
                raise TraceError(f"{where}:{n}: duplicate record for prompt "
                                 f"{rec.source_index}, epoch {rec.epoch}")
            records[(rec.source_index, rec.epoch)] = rec
        try:
            trace = cls(
                name=str(head["name"]), cap=int(head["cap"]), group_size=int(head["group_size"]),
                rows=int(head["rows"]), epochs=int(head["epochs"]),
                order_seed=int(head["order_seed"]), batch_size=int(head["batch_size"]),
                vocab_size=int(head.get("vocab_size", 32000)), records=records,
                spec=head.get("spec"),
            )
        except KeyError as e:
            raise TraceError(f"{where}:1: header lacks {e}") from None
        missing = [(i, e) for i in range(trace.rows) for e in range(trace.epochs)
                   if (i, e) not in records]
        if missing:
            raise TraceError(f"{where}: {len(missing)} (prompt, epoch) records missing, "
                             f"first {missing[0]}")
        return trace


# -- the generator ------------------------------------------------------------------------------
def generate_trace(spec: TraceSpec, name: str | None = None) -> Trace:
    """A long-tail trace (see the module docstring). Deterministic for a spec."""
    slots = spec.slots or 2 * spec.group_size
    order_seed = spec.seed if spec.order_seed is None else spec.order_seed
    rng = np.random.default_rng([spec.seed, 0])
    u = rng.random(spec.rows)
    if spec.long_share is None:
        hard = u < spec.p_hard
    else:  # exactly the share: the rows with the lowest draws (the same draws, so seeds agree)
        hard = np.zeros(spec.rows, dtype=bool)
        hard[np.argsort(u, kind="stable")[:round(spec.long_share * spec.rows)]] = True
    easy_mu = math.log(max(spec.easy_median_frac * spec.cap, 1.0))
    hard_mu = math.log(max(spec.hard_median_frac * spec.cap, 1.0))
    log_mean = np.where(
        hard,
        hard_mu + spec.hard_sigma * rng.standard_normal(spec.rows),
        easy_mu + spec.easy_sigma * rng.standard_normal(spec.rows),
    )
    ranks = np.argsort(np.argsort(log_mean, kind="stable"), kind="stable")
    difficulty = (ranks + 0.5) / spec.rows
    prompt_len = prompt_lengths(rng, spec, difficulty)

    records: dict[tuple[int, int], TraceRecord] = {}
    for (row, epoch), step in draw_steps(spec.rows, spec.epochs, order_seed, spec.batch_size).items():
        noise = np.random.default_rng([spec.seed, row, epoch, 1]).standard_normal(slots)
        growth = (1.0 + spec.growth_per_step) ** step
        lengths = np.exp(log_mean[row] + spec.within_sigma * noise) * growth
        lengths = np.clip(np.round(lengths), spec.min_length, spec.cap).astype(int)
        records[(row, epoch)] = TraceRecord(
            row, epoch, int(prompt_len[row]), float(difficulty[row]), step,
            tuple(int(x) for x in lengths),
        )
    return Trace(
        name=name or (f"longtail-cap{spec.cap}-seed{spec.seed}" if spec.long_share is None else
                      f"bimodal{spec.long_share:g}-cap{spec.cap}-seed{spec.seed}"), cap=spec.cap,
        group_size=spec.group_size, rows=spec.rows, epochs=spec.epochs, order_seed=order_seed,
        batch_size=spec.batch_size, vocab_size=spec.vocab_size, records=records,
        spec=asdict(spec),
    )


def prompt_lengths(rng: np.random.Generator, spec: Any, difficulty: np.ndarray) -> np.ndarray:
    """Each row's prompt length: log-normal (spec.prompt_median, prompt_sigma), longer for
    harder prompts by spec.prompt_signal, clipped to [prompt_min, prompt_max]."""
    return np.clip(
        np.round(spec.prompt_median * np.exp(spec.prompt_sigma * rng.standard_normal(spec.rows))
                 * (1.0 + spec.prompt_signal * (difficulty - 0.5))),
        spec.prompt_min, spec.prompt_max,
    ).astype(int)


def draw_steps(rows: int, epochs: int, order_seed: int, batch_size: int) -> dict[tuple[int, int], int]:
    """(row, epoch) -> the training step at which a synchronous run draws it."""
    order = EpochOrder(rows, order_seed, shuffle=True)
    return {order.next(): draw // batch_size for draw in range(rows * epochs)}


# -- statistics -----------------------------------------------------------------------------
def length_stats(trace: Trace, *, batch_groups: int | None = None) -> dict[str, float]:
    """Length figures to compare with docs/facts.md: over the first group_size responses of every
    prompt (what a synchronous run trains on); `batch_std` is the mean, over batches of
    `batch_groups` consecutive draws, of the standard deviation inside the batch."""
    g = trace.group_size
    recs = list(trace.in_draw_order())
    L = np.array([r.lengths[:g] for r in recs], dtype=float)
    flat = L.ravel()
    within = L.std(axis=1)
    b = batch_groups or trace.batch_size
    batch_std = [L[i:i + b].std() for i in range(0, len(L) - b + 1, b)] or [flat.std()]
    p50, p75, p90, p99 = np.percentile(flat, [50, 75, 90, 99])
    return {
        "responses": float(flat.size),
        "mean": float(flat.mean()),
        "p50": float(p50),
        "p75": float(p75),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(flat.max()),
        "std": float(flat.std()),
        "batch_std": float(np.mean(batch_std)),
        "within_group_std_rms": float(np.sqrt(np.mean(within ** 2))),
        "within_group_std_mean": float(within.mean()),
        "cap_fraction": float(np.mean(flat >= trace.cap)),
    }

"""Resource split between generation and training: StreamRL's Algorithm 1 (arXiv 2504.15930).

Pure scheduling logic (no torch, HTTP, Ray or simulator imports): the stage-time models are
passed in. `rlkit plan` (rlkit/commands/plan.py) measures them: P_gen by simulating the real
policy code on `x / gpus_per_engine` simulated engines (rlkit/sim/simulate.py), P_train from a
`TrainTimeModel` on y GPUs.

    P_gen(x)   rollout seconds per step with x generation GPUs (x a multiple of the engine's
               GPUs), measured on a few steps of a workload W: one figure, or the seconds of
               each measured step (their mean is P_gen)
    P_train(y) a `TrainCost`: training seconds of W's batch on y trainer GPUs (y a multiple of
               the trainer's model-parallel size), the weight sync, and the part of training
               that stream mode can run while the step is still generating

Step time per driver mode (`step_time`):

    sync    gen + train + sync                           (stages in turn)
    stream  max(gen, overlap) + (train - overlap) + sync (training consumes groups as they
                                                          complete; what cannot overlap is the
                                                          last group's compute and the step's
                                                          fixed overhead)
    async   max(gen, train + sync)                       (one-step async: the stages pipeline)

With per-step generation times G_k the step time is the mean over k of the above with gen = G_k
(`expected_step`): an async loop waits, each step, for the slower of that step's generation and
the previous batch's training, so a generation time that varies around the training time costs
mean(max(G_k, T)) > max(mean G_k, T). (Linear in gen for sync, so there the mean is the same.)

Single budget n (`plan_single`): over every (x, y) with x + y <= n, the split with the least
step time of the mode (in async, max(P_gen, P_train): the paper's objective). Brute force over
the x it is given (the measured ones) and every y.

Two budgets, m for generation and n for training (`plan_cross`, the paper's cross-datacenter
rule): if P_gen(m) < P_train(n), (k, n) with k minimising |P_gen(k) - P_train(n)|; else (m, k)
with k minimising |P_train(k) - P_gen(m)|.

Dynamic adjustment (`adjustment`): delta = P_gen(x) - P_train(y) grows as responses lengthen;
delta' = P_gen(x) - P_gen(x + one engine), the predicted drop from one more engine; add the
engine when delta >= delta' (only generation is resized: resizing the trainer restarts it),
and generation is the slower stage (delta > 0) and the engine shortens it (delta' > 0): the
paper's rule alone would add an engine that shortens nothing when generation is bound by its
longest response.

Placement (`PlacementChoice`): colocated, engines and trainer share all n GPUs and take turns
(sync mode only): step = P_gen(n) + sleep + train(n) + wake, against the best disaggregated
split's step; the faster wins. The turn costs are passed in (rlkit.sim.train_time's
ColocationModel in `rlkit plan`). `flips` finds where the winner changes along a sweep.

Measuring P_gen costs a simulation per x, so `search_gen` measures a coarse grid (powers of two
or a step) and then bisects around the best, within a budget of measurements.

Frozen engine groups (rollout.frozen_engines: a teacher or a judge, never trained, never asleep)
hold GPUs of their own beside the policy's engines and the trainer, in every placement: the
split is searched on the budget they leave (`after_frozen`: n - frozen GPUs; the generation
budget in the cross-datacenter case). A teacher scores each completed sample in one prefill of
its prompt + response tokens, on the frozen GPUs, while the step still generates
(`teacher_score_s`, `Teacher`):

    T_k = tokens_k x 2 x teacher_params / (frozen_gpus x peak_flops x mfu)
          tokens_k: prompt + response tokens of step k's samples (2 FLOPs per parameter and
          token: a forward pass; prefill is compute-bound, so the MFU is a prefill's)
    rollout stage of step k = max(G_k, T_k) + T_k / samples_k

Assumptions: samples complete throughout the step (the long tail), so the scoring of the early
ones overlaps the generation of the later ones and only a teacher slower than generation
(T_k > G_k) bounds the step; the last sample's scoring (T_k / samples_k, one sample's share)
cannot overlap anything and always adds. Scoring is spread evenly over the step's samples
(the mean sample's tokens), every frozen GPU serves the teacher (a judge's GPUs among them
make T_k optimistic; a judge's own verdicts are not priced), and the policy's engines do not
slow down for it (the GPUs are separate). The rollout stage then enters `step_time` as G does.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

MODES = ("sync", "stream", "async")


class PlanError(ValueError):
    """Inputs no split can satisfy (a budget too small, a bad unit or mode)."""


@dataclass(frozen=True)
class TrainCost:
    """The trainer's side of one step on some number of GPUs."""

    train_s: float  # forward, backward, optimizer step of the step's batch
    sync_s: float  # weight push to the engines
    overlap_s: float = 0.0  # of train_s, what stream mode can run while generation goes on

    @property
    def stage_s(self) -> float:
        """P_train: what the trainer stage costs per step (training, then the weight sync)."""
        return self.train_s + self.sync_s


def expected_step(mode: str, gen: float | Sequence[float], cost: TrainCost) -> float:
    """Mean step time over the measured generation times (one figure: its step time)."""
    steps = _samples(gen)
    return sum(step_time(mode, g, cost) for g in steps) / len(steps)


def _samples(gen: float | Sequence[float]) -> tuple[float, ...]:
    if isinstance(gen, (int, float)):
        return (float(gen),)
    out = tuple(float(g) for g in gen)
    if not out:
        raise PlanError("a generation time needs at least one measured step")
    return out


def step_time(mode: str, gen_s: float, cost: TrainCost) -> float:
    """Seconds of one step in a driver mode (see the module docstring)."""
    if mode == "sync":
        return gen_s + cost.stage_s
    if mode == "stream":
        overlap = min(cost.overlap_s, cost.train_s)
        return max(gen_s, overlap) + (cost.train_s - overlap) + cost.sync_s
    if mode == "async":
        return max(gen_s, cost.stage_s)
    raise PlanError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")


@dataclass(frozen=True)
class Units:
    """Granularity of each side: generation GPUs come in engines, trainer GPUs in model-parallel
    groups (tensor x pipeline parallel; data parallelism multiplies them)."""

    gen: int = 1  # GPUs per engine
    train: int = 1  # trainer GPUs per data-parallel replica

    def __post_init__(self) -> None:
        if self.gen < 1 or self.train < 1:
            raise PlanError(f"GPUs per engine ({self.gen}) and per trainer replica "
                            f"({self.train}) must be >= 1")

    def gen_sizes(self, limit: int) -> list[int]:
        """Generation GPU counts from one engine up to `limit`."""
        return list(range(self.gen, limit + 1, self.gen))

    def train_sizes(self, limit: int) -> list[int]:
        return list(range(self.train, limit + 1, self.train))


def check_budget(n: int, units: Units, what: str = "budget") -> None:
    if n < units.gen + units.train:
        raise PlanError(
            f"{what} of {n} GPUs is too small for one engine ({units.gen} GPU"
            f"{'s' * (units.gen != 1)}) plus the smallest trainer ({units.train} GPU"
            f"{'s' * (units.train != 1)}): at least {units.gen + units.train} GPUs")


@dataclass(frozen=True)
class Candidate:
    """One split and its stage times."""

    x: int  # generation GPUs
    y: int  # trainer GPUs
    gen: tuple[float, ...]  # generation seconds of each measured step
    cost: TrainCost
    engines: int = 0

    @property
    def gen_s(self) -> float:
        """P_gen: mean generation seconds per step."""
        return sum(self.gen) / len(self.gen)

    @property
    def train_s(self) -> float:
        return self.cost.stage_s

    @property
    def imbalance_s(self) -> float:
        """P_gen - P_train (StreamRL's delta)."""
        return self.gen_s - self.cost.stage_s

    def step(self, mode: str) -> float:
        return expected_step(mode, self.gen, self.cost)

    def to_json(self) -> dict[str, Any]:
        return {"gen_gpus": self.x, "engines": self.engines, "train_gpus": self.y,
                "gen_s": self.gen_s, "gen_steps_s": list(self.gen), "train_s": self.cost.train_s, "sync_s": self.cost.sync_s,
                "overlap_s": self.cost.overlap_s, "p_train_s": self.train_s,
                "imbalance_s": self.imbalance_s,
                **{f"{m}_step_s": self.step(m) for m in MODES}}


@dataclass(frozen=True)
class Adjustment:
    """StreamRL's dynamic adjustment at a split: add one engine when delta >= delta'."""

    x: int  # generation GPUs now
    x_more: int  # with one more engine
    delta_s: float  # P_gen(x) - P_train(y)
    delta_prime_s: float  # P_gen(x) - P_gen(x_more)
    add: bool

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def adjustment(x: int, gen_s: float, train_stage_s: float, x_more: int,
               gen_more_s: float) -> Adjustment:
    delta = gen_s - train_stage_s
    delta_prime = gen_s - gen_more_s
    return Adjustment(x, x_more, delta, delta_prime,
                      add=delta > 0 and delta_prime > 0 and delta >= delta_prime)


@dataclass
class Plan:
    kind: str  # single | cross
    mode: str
    chosen: Candidate
    candidates: list[Candidate]  # one row per measured x (its best y), by x; the even split
    # gets a row of its own when its y is not its x's best
    reason: str
    budgets: dict[str, int]
    even: Candidate | None = None  # the even split (single budget)
    rule: Candidate | None = None  # the reference rule's split (cross)
    adjust: Adjustment | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def speedup_vs_even(self) -> float | None:
        if self.even is None:
            return None
        return self.even.step(self.mode) / self.chosen.step(self.mode)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "mode": self.mode, "budgets": self.budgets,
            "chosen": self.chosen.to_json(), "reason": self.reason,
            "even": self.even.to_json() if self.even else None,
            "speedup_vs_even": self.speedup_vs_even,
            "rule": self.rule.to_json() if self.rule else None,
            "adjustment": self.adjust.to_json() if self.adjust else None,
            "candidates": [c.to_json() for c in self.candidates], **self.extra,
        }


GenTime = Callable[[int], Any] | Mapping[int, Any]  # x -> seconds, or seconds per step


def _gen_fn(p_gen: GenTime) -> Callable[[int], float]:
    return p_gen.__getitem__ if isinstance(p_gen, Mapping) else p_gen


def _key(mode: str, c: Candidate) -> tuple[float, int, int]:
    # least step time, then fewest GPUs, then fewest generation GPUs (deterministic)
    return (c.step(mode), c.x + c.y, c.x)


def even_split(n: int, units: Units) -> tuple[int, int]:
    """Half the budget to each side, each rounded down to its unit (at least one unit)."""
    check_budget(n, units)
    x = max(units.gen, (n // 2) // units.gen * units.gen)
    y = (n - x) // units.train * units.train
    if y < units.train:  # half was not enough for a trainer replica: give generation less
        y = units.train
        x = (n - y) // units.gen * units.gen
    return x, y


def gen_limit(n: int, units: Units) -> int:
    """The most generation GPUs a single budget allows (one trainer replica left)."""
    return (n - units.train) // units.gen * units.gen


def plan_single(n: int, p_gen: GenTime, p_train: Callable[[int], TrainCost], units: Units,
                mode: str, xs: Iterable[int] | None = None) -> Plan:
    """Brute force over (x, y), x in `xs` (default: every feasible x, or the keys when P_gen is
    a mapping of measurements), y every multiple of units.train with x + y <= n: the least step
    time of `mode`. Each table row is an x with its best y."""
    if mode not in MODES:
        raise PlanError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    check_budget(n, units)
    gen = _gen_fn(p_gen)
    limit = gen_limit(n, units)
    if xs is None and isinstance(p_gen, Mapping):  # a measurement: its points in range
        xs = [x for x in p_gen if x % units.gen == 0 and units.gen <= x <= limit]
    xs = sorted(set(units.gen_sizes(limit) if xs is None else xs))
    bad = [x for x in xs if x % units.gen or not units.gen <= x <= limit]
    if bad:
        raise PlanError(f"generation GPU counts {bad} are not multiples of {units.gen} in "
                        f"[{units.gen}, {limit}]")
    costs: dict[int, TrainCost] = {}

    def cost(y: int) -> TrainCost:
        if y not in costs:
            costs[y] = p_train(y)
        return costs[y]

    rows = []
    for x in xs:
        g = _samples(gen(x))
        options = [Candidate(x, y, g, cost(y), x // units.gen)
                   for y in units.train_sizes(n - x)]
        rows.append(min(options, key=lambda c: _key(mode, c)))
    chosen = min(rows, key=lambda c: _key(mode, c))
    ex, ey = even_split(n, units)
    even = next((c for c in rows if c.x == ex), None)
    if even is not None and even.y != ey:  # its own row, after the row of its x
        row = even
        even = Candidate(ex, ey, row.gen, cost(ey), ex // units.gen)
        rows.insert(rows.index(row) + 1, even)
    plan = Plan("single", mode, chosen, rows, "", {"gpus": n}, even=even)
    plan.reason = _reason_single(plan, units)
    return plan


def _reason_single(plan: Plan, units: Units) -> str:
    c, mode = plan.chosen, plan.mode
    formula = {"sync": "P_gen + P_train", "stream": "stream step (training overlaps generation)",
               "async": "max(generation, P_train), step by step"}[mode]
    side = ("generation is the slower stage" if c.imbalance_s > 0
            else "training is the slower stage")
    parts = [f"least {mode} step time ({formula}) of {len(plan.candidates)} measured splits: "
             f"{c.x} GPUs generate ({c.engines} engines), {c.y} train, "
             f"{c.step(mode):.1f} s/step; P_gen {c.gen_s:.1f} s vs P_train {c.train_s:.1f} s "
             f"({side}, by {abs(c.imbalance_s):.1f} s)"]
    idle = plan.budgets["gpus"] - c.x - c.y
    if idle:
        parts.append(f"{idle} GPU{'s' * (idle != 1)} left unused (more trainer GPUs would not "
                     "shorten the step)")
    if plan.even is not None and plan.even is not c:
        e = plan.even
        parts.append(f"{plan.speedup_vs_even:.2f}x the even split ({e.x} + {e.y}: "
                     f"{e.step(mode):.1f} s/step, P_gen {e.gen_s:.1f} s vs P_train "
                     f"{e.train_s:.1f} s)")
    elif plan.even is c:
        parts.append("the even split is the best")
    return "; ".join(parts)


def plan_cross(m: int, n: int, p_gen: GenTime, p_train: Callable[[int], TrainCost],
               units: Units, mode: str, xs: Iterable[int] | None = None) -> Plan:
    """Fixed budgets: at most m GPUs generate (one datacenter), at most n train (another).

    The reference rule balances the stages, freeing the faster side's surplus: in async mode
    that is the plan; in sync and stream modes, where every second of either stage adds to the
    step, the plan is the least step time over both budgets (the rule's split is reported too).
    """
    if mode not in MODES:
        raise PlanError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    if m < units.gen:
        raise PlanError(f"generation budget of {m} GPUs is too small for one engine "
                        f"({units.gen} GPUs)")
    if n < units.train:
        raise PlanError(f"training budget of {n} GPUs is too small for the smallest trainer "
                        f"({units.train} GPUs)")
    gen = _gen_fn(p_gen)
    mx = m // units.gen * units.gen
    ny = n // units.train * units.train
    if xs is None and isinstance(p_gen, Mapping):
        xs = [x for x in p_gen if x % units.gen == 0 and units.gen <= x <= mx]
    xs = sorted(set(units.gen_sizes(mx) if xs is None else xs) | {mx})
    bad = [x for x in xs if x % units.gen or not units.gen <= x <= mx]
    if bad:
        raise PlanError(f"generation GPU counts {bad} are not multiples of {units.gen} in "
                        f"[{units.gen}, {mx}]")
    costs = {y: p_train(y) for y in units.train_sizes(ny)}
    steps = {x: _samples(gen(x)) for x in xs}
    gens = {x: sum(v) / len(v) for x, v in steps.items()}  # P_gen: the mean
    full = costs[ny].stage_s
    if gens[mx] < full:  # generation has GPUs to spare: shrink it to match the trainer
        k = min(xs, key=lambda x: (abs(gens[x] - full), x))
        rule = Candidate(k, ny, steps[k], costs[ny], k // units.gen)
        why = (f"P_gen(m={mx}) = {gens[mx]:.1f} s < P_train(n={ny}) = {full:.1f} s: all {ny} "
               f"trainer GPUs, and {k} generation GPUs bring P_gen closest to P_train "
               f"({gens[k]:.1f} s)")
    else:  # training has GPUs to spare
        k = min(costs, key=lambda y: (abs(costs[y].stage_s - gens[mx]), y))
        rule = Candidate(mx, k, steps[mx], costs[k], mx // units.gen)
        why = (f"P_gen(m={mx}) = {gens[mx]:.1f} s >= P_train(n={ny}) = {full:.1f} s: all {mx} "
               f"generation GPUs, and {k} trainer GPUs bring P_train closest to P_gen "
               f"({costs[k].stage_s:.1f} s)")
    rows = []
    for x in xs:
        options = [Candidate(x, y, steps[x], costs[y], x // units.gen) for y in costs]
        rows.append(min(options, key=lambda c: _key(mode, c)))
    if mode == "async":
        chosen = rule
        reason = "reference rule: " + why + f"; async step {rule.step(mode):.1f} s"
    else:
        chosen = min(rows, key=lambda c: _key(mode, c))
        reason = (f"least {mode} step time over both budgets: {chosen.x} + {chosen.y} GPUs, "
                  f"{chosen.step(mode):.1f} s/step (the reference rule, which balances the "
                  f"stages for a pipelined (async) step, gives {rule.x} + {rule.y}: "
                  f"{rule.step(mode):.1f} s/step in {mode} mode; {why})")
    return Plan("cross", mode, chosen, rows, reason, {"gen_gpus": m, "train_gpus": n},
                rule=rule)


def search_gen(
    start: Iterable[int], measure: Callable[[int], Any], score: Callable[[int, Any], float],
    unit: int, max_measures: int, measured: dict[int, Any] | None = None,
) -> dict[int, Any]:
    """Measure P_gen on a coarse grid, then bisect around the best point.

    `start`: the grid (multiples of `unit`); `score(x, gen)`: what a split with x generation
    GPUs costs (the step time of its best y). Measures every grid point, then, while measures
    are left, the midpoint (rounded to the unit) of the wider of the two gaps between the best
    x and its measured neighbours (a bisection of the bracket around the best). `measured`
    (a cache) is filled in and returned; points already in it are free.
    """
    got = {} if measured is None else measured
    grid = sorted(set(start))
    todo = [x for x in grid if x not in got]
    if len(todo) > max_measures:
        raise PlanError(f"{len(todo)} generation sizes to measure on the first grid "
                        f"({', '.join(map(str, todo))}), more than the {max_measures} allowed: "
                        "raise the limit or coarsen the grid")
    spent = 0
    for x in todo:
        got[x] = measure(x)
        spent += 1
    lo, hi = grid[0], grid[-1]
    while spent < max_measures:
        pts = sorted(x for x in got if lo <= x <= hi)
        i = min(range(len(pts)), key=lambda j: (score(pts[j], got[pts[j]]), pts[j]))
        gaps = [(pts[j], pts[i]) if j < i else (pts[i], pts[j])
                for j in (i - 1, i + 1) if 0 <= j < len(pts)]
        mids = [m for a, b in sorted(gaps, key=lambda g: g[0] - g[1])  # the wider gap first
                if a < (m := (a + b) // 2 // unit * unit) < b]
        if not mids:
            break
        got[mids[0]] = measure(mids[0])
        spent += 1
    return got


def grid(limit: int, unit: int, step: int | None = None, extra: Iterable[int] = ()) -> list[int]:
    """Generation sizes to measure first: unit x powers of two (or every `step` GPUs) up to
    `limit`, plus `limit` and the `extra` points (e.g. the even split)."""
    if step is not None:
        if step < 1 or step % unit:
            raise PlanError(f"step {step} is not a positive multiple of {unit} GPUs per engine")
        pts = set(range(step, limit + 1, step))
    else:
        pts = {unit * 2 ** i for i in range(int(math.log2(max(1, limit // unit))) + 1)}
    pts |= {limit, *extra}
    return sorted(p for p in pts if unit <= p <= limit)


def gpus_per_engine(profile: Any) -> int:
    """GPUs one engine of a profile occupies: its derivation's tensor parallelism (GPU-like
    profiles), else an 'N x device' prefix of its device string, else 1."""
    tp = (getattr(profile, "extra", None) or {}).get("derivation", {}).get("tp")
    if tp:
        return int(tp)
    m = re.match(r"\s*(\d+)\s*x\s", str(getattr(profile, "device", "")))
    return int(m.group(1)) if m else 1


def trained_tokens_per_step(trace: Any, batch_size: int, first_step: int, steps: int) -> float:
    """Mean prompt + response tokens a step trains, over steps [first_step, first_step + steps)
    of a synchronous run over `trace` (draw order, `batch_size` groups of trace.group_size):
    the workload W of the trainer's time model."""
    return sum(map(sum, trained_lengths_per_step(trace, batch_size, first_step, steps))) / steps


def trained_lengths_per_step(trace: Any, batch_size: int, first_step: int,
                             steps: int) -> list[list[int]]:
    """Each of those steps' samples' prompt + response lengths (what `TrainTimeModel.batch_s`
    prices: the long tail's attention and the data-parallel balance)."""
    g = trace.group_size
    per_group = [[r.prompt_len + n for n in r.lengths[:g]] for r in trace.in_draw_order()]
    lo, hi = first_step * batch_size, (first_step + steps) * batch_size
    if hi > len(per_group):
        raise PlanError(f"trace {trace.name!r} has {len(per_group)} groups, {hi} needed for "
                        f"{first_step + steps} steps of {batch_size}")
    return [[n for group in per_group[lo + k * batch_size:lo + (k + 1) * batch_size] for n in group]
            for k in range(steps)]


# -- placement: colocated (engines and trainer take turns on every GPU) vs disaggregated -----

PLACEMENTS = ("disaggregated", "colocated")


def colocated_blocker(n: int, units: Units) -> str | None:
    """Why `n` GPUs cannot be one colocated cluster (every GPU an engine's and a trainer
    rank's), or None when they can."""
    if n % units.gen or n % units.train:
        return (f"{n} GPUs are not whole engines of {units.gen} GPU{'s' * (units.gen != 1)} "
                f"and whole trainer replicas of {units.train}: colocated, every GPU is both")
    return None


def mode_blocker(mode: str) -> str | None:
    """Why colocated placement cannot run `mode`, or None (sync)."""
    if mode == "sync":
        return None
    return (f"colocated cannot run {mode} mode: {mode} generates while the trainer trains, but "
            "colocated engines sleep while it trains (sync mode only)")


@dataclass(frozen=True)
class ColocatedCost:
    """Colocated on the whole budget, sync mode: generation on every GPU (n / GPUs per engine
    engines), the turn to training (engines sleep, trainer onloads), training on every GPU,
    the turn back (trainer offloads, engines wake, weights updated in memory)."""

    gpus: int
    engines: int
    gen: tuple[float, ...]  # generation seconds of each measured step
    train_s: float  # on all `gpus`
    sleep_s: float
    wake_s: float  # includes the in-memory weight update
    parts: dict[str, float] = field(default_factory=dict)  # the turns by part (seconds)

    @property
    def gen_s(self) -> float:
        return sum(self.gen) / len(self.gen)

    @property
    def turn_s(self) -> float:
        return self.sleep_s + self.wake_s

    @property
    def step_s(self) -> float:
        """Its sync step: rollout + sleep + train + wake (a TrainCost whose sync is the turns)."""
        return expected_step("sync", self.gen, TrainCost(self.train_s, self.turn_s))

    def to_json(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "engines": self.engines, "gen_s": self.gen_s,
                "gen_steps_s": list(self.gen), "train_s": self.train_s, "sleep_s": self.sleep_s,
                "wake_s": self.wake_s, "turn_s": self.turn_s, "turn_parts_s": self.parts,
                "sync_step_s": self.step_s}


@dataclass(frozen=True)
class PlacementChoice:
    """Colocated against the best disaggregated split of the same budget. Colocated runs sync
    mode only: in stream and async the comparison is its sync step against the split's step in
    that mode (what choosing colocated would give), and `mode_blocker` says why."""

    mode: str  # the disaggregated split's mode
    disaggregated: Candidate | None  # the best split (None: not searched, or `split_blocker`)
    colocated: ColocatedCost | None  # None: not computed, or impossible (`blocker` says why)
    blocker: str | None = None  # why this budget cannot be colocated
    split_blocker: str | None = None  # why it cannot be split (too small for engine + trainer)

    @property
    def disaggregated_s(self) -> float | None:
        return self.disaggregated.step(self.mode) if self.disaggregated is not None else None

    @property
    def winner(self) -> str | None:
        """The faster placement (a tie: disaggregated, which runs every mode), or the only
        possible one; None when a side was not computed."""
        d, c = self.disaggregated_s, self.colocated
        if d is not None and c is not None:
            return "colocated" if c.step_s < d else "disaggregated"
        if d is not None and self.blocker:
            return "disaggregated"
        if c is not None and self.split_blocker:
            return "colocated"
        return None

    @property
    def ratio(self) -> float | None:
        """The loser's step time over the winner's (>= 1)."""
        d, c = self.disaggregated_s, self.colocated
        if d is None or c is None:
            return None
        return max(d, c.step_s) / min(d, c.step_s)

    @property
    def reason(self) -> str:
        d, c = self.disaggregated, self.colocated
        parts = []
        if c is None:
            parts.append(f"colocated is not possible: {self.blocker}")
        else:
            why = mode_blocker(self.mode)
            if why:
                parts.append(f"{why}; its sync step is {'compared' if d else 'shown'}")
            parts.append(f"colocated {c.step_s:.1f} s/step = generation {c.gen_s:.1f} s on "
                         f"{c.gpus} GPUs ({c.engines} engines) + training {c.train_s:.1f} s on "
                         f"{c.gpus} GPUs + turns {c.turn_s:.1f} s (sleep {c.sleep_s:.1f}, wake "
                         f"{c.wake_s:.1f})")
        if self.split_blocker:
            parts.append(f"disaggregated is not possible: {self.split_blocker}")
        if d is not None:
            parts.append(f"disaggregated {d.step(self.mode):.1f} s/step ({self.mode}) = "
                         f"{d.x} GPUs generate, {d.y} train (P_gen {d.gen_s:.1f} s, P_train "
                         f"{d.train_s:.1f} s)")
        if self.ratio is not None:
            parts.append(f"{self.winner} is faster by {self.ratio:.2f}x")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "winner": self.winner, "ratio": self.ratio,
                "disaggregated_step_s": self.disaggregated_s,
                "disaggregated": self.disaggregated.to_json() if self.disaggregated else None,
                "colocated": self.colocated.to_json() if self.colocated else None,
                "colocated_blocker": self.blocker, "disaggregated_blocker": self.split_blocker,
                "colocated_mode_blocker": mode_blocker(self.mode),
                "reason": self.reason}


def flips(points: Sequence[tuple[Any, PlacementChoice]]) -> list[tuple[Any, Any, str, str]]:
    """Where the winner changes along a sweep: (value before, value after, winner before,
    winner after) for each neighbouring pair of points whose winners differ."""
    out = []
    for (a, pa), (b, pb) in zip(points, points[1:]):
        if pa.winner and pb.winner and pa.winner != pb.winner:
            out.append((a, b, pa.winner, pb.winner))
    return out


# -- frozen engine groups: GPUs of their own; a teacher scoring every sample ------------------


def after_frozen(n: int, frozen: int, what: str = "budget") -> int:
    """The GPUs a budget of n leaves to the policy's engines and the trainer once the frozen
    engine groups hold `frozen` of their own."""
    if frozen < 0:
        raise PlanError(f"frozen engine groups cannot hold {frozen} GPUs (>= 0)")
    if frozen >= n:
        raise PlanError(f"{what} of {n} GPUs leaves none to the policy's engines and the "
                        f"trainer beside the frozen engine groups' {frozen} (they hold GPUs of "
                        f"their own: the budget must exceed {frozen})")
    return n - frozen


def teacher_score_s(tokens: float, params: float, gpus: int, peak_flops: float,
                    mfu: float) -> float:
    """Seconds a teacher of `params` parameters takes to prefill `tokens` (prompt + response)
    tokens on `gpus` GPUs: tokens x 2 x params / (gpus x peak_flops x mfu)."""
    if tokens < 0 or params < 0:
        raise PlanError(f"teacher tokens ({tokens}) and params ({params}) must be >= 0")
    if gpus < 1 or peak_flops <= 0 or not 0 < mfu <= 1:
        raise PlanError(f"a teacher needs >= 1 GPU ({gpus}), peak flops > 0 ({peak_flops:g}) "
                        f"and an MFU in (0, 1] ({mfu:g})")
    return tokens * 2.0 * params / (gpus * peak_flops * mfu)


def rollout_with_teacher(gen_s: float, teacher_s: float, samples: int) -> float:
    """The rollout stage of a step whose generation takes gen_s while a teacher scores its
    samples (teacher_s in all): max(gen_s, teacher_s) + teacher_s / samples (the module
    docstring's model: scoring overlaps generation, the last sample's does not)."""
    if samples < 1:
        raise PlanError(f"a step has at least one sample ({samples})")
    return max(gen_s, teacher_s) + teacher_s / samples


@dataclass(frozen=True)
class Teacher:
    """A teacher's scoring of each measured step: seconds and samples per step, in the order
    of P_gen's measured steps."""

    steps_s: tuple[float, ...]
    samples: tuple[int, ...]
    tokens: tuple[int, ...] = ()  # prompt + response tokens scored per step

    @classmethod
    def of(cls, lengths_per_step: Sequence[Sequence[int]], params: float, gpus: int,
           peak_flops: float, mfu: float) -> "Teacher":
        """From each step's samples' prompt + response lengths."""
        tokens = tuple(int(sum(lengths)) for lengths in lengths_per_step)
        return cls(tuple(teacher_score_s(t, params, gpus, peak_flops, mfu) for t in tokens),
                   tuple(len(lengths) for lengths in lengths_per_step), tokens)

    @property
    def mean_s(self) -> float:
        return sum(self.steps_s) / len(self.steps_s)

    def rollout(self, gen: float | Sequence[float]) -> tuple[float, ...]:
        """The rollout stage of each measured step (one figure: against each step's scoring)."""
        steps = _samples(gen)
        if len(steps) == 1 and len(self.steps_s) > 1:
            steps = steps * len(self.steps_s)
        if len(steps) != len(self.steps_s):
            raise PlanError(f"{len(steps)} measured generation steps against the teacher's "
                            f"{len(self.steps_s)}")
        return tuple(rollout_with_teacher(g, t, s)
                     for g, t, s in zip(steps, self.steps_s, self.samples))

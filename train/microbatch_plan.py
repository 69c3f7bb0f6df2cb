"""Micro-batches and data-parallel shares of a training batch, planned from sample lengths alone.

Pure Python (no torch, Ray or HTTP): the plan is a function of (lengths, budget or count,
dp_size, cost weight, layout) and nothing else, so every rank that computes it gets the same
one, and its properties are tested exhaustively (tests/train/test_microbatch_plan.py).

Cost of a sample of n tokens (compute, for balancing replicas): `n + w n^2`. The matmuls cost
2 P n FLOPs (P: the parameters every token multiplies by), causal attention
2 layers heads head_dim n^2 (QK^T and PV over half the n x n scores), the same model as the
simulator's prefill (rlkit/sim/roofline.py); divided by 2 P that is n + w n^2 with
w = layers heads head_dim / P (`attention_weight`). For Qwen2.5-7B attention equals the
matmuls at ~70k tokens, for the tiny test model at ~830.

The rules (each a classic with a stated guarantee):

1. Replicas: longest-processing-time first (LPT). Samples by decreasing cost (ties: index),
   each to the least-loaded replica (ties: lowest rank). Guarantee, for every replica r: its
   load exceeds the lightest replica's by at most the cost of the last sample it received,
   which is its cheapest (when that sample went to r, r was the lightest, and loads only grow).
   Hence the slowest replica is within one sample of the best possible split: before its last
   sample it held at most the mean, and no split has a heaviest replica below the mean.
   Stream mode places samples in arrival order (it cannot sort what has not arrived) by the
   same least-loaded rule (`least_loaded`); the bound there is the last sample placed, at most
   the batch's most expensive one.
2. Micro-batches of one replica. By count (`micro_batch_size`): consecutive chunks of its
   samples in batch order (rlkit's behaviour before token budgets). By tokens
   (`max_tokens`): first-fit decreasing by length into micro-batches whose dense layout holds
   at most `max_tokens` slots, padding included (`_fits`: packed, rows x width of its rows;
   padded, samples x longest sample). Counting real tokens instead let a 7,944-token
   sample's short companions fill a second row as wide as it: twice one row's memory under
   an 8k budget (10.7 GB per rank where one 8k row takes 5.9, measured). A sample longer
   than the budget gets a micro-batch of its own (`over_budget`: the caller warns with its
   length). Stream mode fills micro-batches in arrival order
   (next-fit: a micro-batch closes when the next sample does not fit), which never changes a
   closed micro-batch when later samples arrive (`stream_micro_batches`).
3. Equal counts: every replica runs as many micro-batches as the busiest one; the others are
   padded with empty ones (`()`: the trainer runs a forward and backward of zero weight there,
   so every rank makes the same collective calls, as megatron's schedules need).
4. By token budget, what the dense layout pays (`layout_cost`): rows x width + 2 w rows x
   width^2 per micro-batch, padding included: it computes every score of each row's square
   (n + w n^2 counts the causal half) and the block-diagonal mask then discards the scores
   between samples. Packed, samples cost more than n + w n^2 by an amount rules 1-2 cannot
   see (measured on a narrow log-normal mix at DP=2: replicas 1.001 apart by sample cost were
   1.15 apart in seconds). So the planner also forms the budget's micro-batches over the whole
   batch (first-fit decreasing) and gives whole micro-batches to replicas by LPT on their
   layout cost (within one micro-batch of the best split of those micro-batches), and keeps
   that plan where its slowest replica's layout cost is lower than rules 1-2's: never worse by
   the layout, and rules 1-2 where micro-batches are too few to split evenly. The budget, and
   so the memory bound below, holds in both.

Memory bound of the dense attention path (train/packing.py): a micro-batch under budget B
holds at most B slots (rows x width, rule 2), so width <= B and its block-diagonal mask
(rows x width^2) at most B x width <= B^2 entries: never more than one row of B tokens,
whatever the length mix (by count it is micro_batch_size x the longest sample^2). Only an
over-long sample of n > B tokens exceeds it, by itself (n slots, n^2 mask entries): that needs
the varlen (THD) attention path.

The loss does not depend on any of this: the trainer normalises by the global denominator at
`step` (train/megatron/trainer.py), so any partition gives the same gradient.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

MicroBatch = tuple[int, ...]  # sample indices; () is empty work (padding)


def attention_weight(*, layers: int, heads: int, head_dim: int, hidden: int, kv_heads: int,
                     intermediate: int, vocab: int) -> float:
    """w of `sample_cost` for a Llama/Qwen2-shaped model (gated MLP, GQA, LM head)."""
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    matmul_params = layers * per_layer + hidden * vocab
    return layers * heads * head_dim / matmul_params


def attention_weight_of(arch) -> float:
    """`attention_weight` of a train.hf_arch.ModelArch (read by attribute: no import here)."""
    return attention_weight(layers=arch.num_layers, heads=arch.num_heads, head_dim=arch.head_dim,
                            hidden=arch.hidden_size, kv_heads=arch.num_kv_heads,
                            intermediate=arch.intermediate_size, vocab=arch.vocab_size)


def sample_cost(length: int, weight: float = 0.0) -> float:
    """Compute of one sample in token-equivalents: n + w n^2 (see the module docstring)."""
    return length + weight * length * length


def least_loaded(loads: Sequence[float]) -> int:
    """The replica a sample goes to: the least loaded, the lowest rank among equals."""
    return min(range(len(loads)), key=lambda r: (loads[r], r))


class ReplicaAssigner:
    """Samples of one rollout batch to data-parallel replicas as they arrive: each to the least
    loaded replica (by `sample_cost`) of its global batch (`part_size` samples each; 0: one).
    Pure and deterministic, so the rollout side's hand-off (rlkit/driver/handoff.py) and every
    trainer rank (train/stream.py) place the same samples alike from their lengths alone."""

    def __init__(self, dp_size: int, attention_weight: float = 0.0, part_size: int = 0) -> None:
        self.dp_size, self.attention_weight, self.part_size = dp_size, attention_weight, part_size
        self.seen = 0  # samples placed so far (every replica), in arrival order
        self.loads: list[list[float]] = []  # per global batch: every replica's cost
        self.lengths: list[list[list[int]]] = []  # per global batch: each replica's lengths

    def assign(self, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """(global batch, replica) of each of these samples, placed in this order."""
        out = []
        for n in lengths:
            part = self.seen // self.part_size if self.part_size else 0
            self.seen += 1
            while len(self.loads) <= part:
                self.loads.append([0.0] * self.dp_size)
                self.lengths.append([[] for _ in range(self.dp_size)])
            replica = least_loaded(self.loads[part])
            self.loads[part][replica] += sample_cost(n, self.attention_weight)
            self.lengths[part][replica].append(n)
            out.append((part, replica))
        return out


def balance_replicas(costs: Sequence[float], dp_size: int) -> list[list[int]]:
    """Sample indices per replica (each in increasing order), by LPT (rule 1)."""
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    loads = [0.0] * dp_size
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = least_loaded(loads)
        parts[r].append(i)
        loads[r] += costs[i]
    return [sorted(p) for p in parts]


def _fits(sizes: list[int], max_tokens: int, padded: bool, row_tokens: int) -> bool:
    """Whether samples of these lengths fit the budget as the dense layout holds them: its
    slots, rows x width (train/packing.py), padding included: samples x longest padded; packed,
    the first-fit-decreasing rows of `assign_rows`, so that the short companions of a long
    sample, in a row of their own as wide as it, are counted at that width."""
    if sum(sizes) > max_tokens:  # slots >= tokens
        return False
    if padded:
        return len(sizes) * max(sizes) <= max_tokens
    rows, width = row_slots(sizes, row_tokens)
    return rows * width <= max_tokens


def _check_mode(max_tokens: int, micro_batch_size: int) -> None:
    if max_tokens < 0 or micro_batch_size < 0:
        raise ValueError("max_tokens and micro_batch_size must be >= 0")
    if not max_tokens and not micro_batch_size:
        raise ValueError("give a token budget (max_tokens) or a sample count (micro_batch_size)")


def micro_batches(lengths: Sequence[int], *, max_tokens: int = 0, micro_batch_size: int = 0,
                  padded: bool = False, row_tokens: int = 0) -> list[MicroBatch]:
    """Micro-batches of one replica's samples (positions in `lengths`), rule 2: by token budget
    when `max_tokens` > 0 (first-fit decreasing, the budget counting the dense layout's slots:
    `_fits`), else consecutive chunks of `micro_batch_size`."""
    _check_mode(max_tokens, micro_batch_size)
    n = len(lengths)
    if not max_tokens:
        return [tuple(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
    bins: list[list[int]] = []
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        for b in bins:
            if _fits([lengths[j] for j in b] + [lengths[i]], max_tokens, padded, row_tokens):
                b.append(i)
                break
        else:
            bins.append([i])
    return [tuple(b) for b in bins]


def stream_micro_batches(lengths: Sequence[int], *, max_tokens: int = 0, micro_batch_size: int = 0,
                         padded: bool = False, row_tokens: int = 0) -> tuple[list[MicroBatch], bool]:
    """Micro-batches of samples in arrival order (rule 2, stream mode) and whether the last one
    is closed (no later sample can join it). Prefix-stable: more samples never change the
    micro-batches before the last."""
    _check_mode(max_tokens, micro_batch_size)
    out: list[list[int]] = []
    for i, length in enumerate(lengths):
        if out:
            if max_tokens:
                fits = _fits([lengths[j] for j in out[-1]] + [length], max_tokens, padded, row_tokens)
            else:
                fits = len(out[-1]) < micro_batch_size
            if fits:
                out[-1].append(i)
                continue
        out.append([i])
    # by count a full micro-batch is closed; by tokens one is only closed by the next sample
    closed = bool(out) and not max_tokens and len(out[-1]) == micro_batch_size
    return [tuple(b) for b in out], closed


def pad_to_equal(per_replica: Sequence[Sequence[MicroBatch]]) -> list[list[MicroBatch]]:
    """Rule 3: every replica's list padded with empty micro-batches to the longest one."""
    most = max((len(p) for p in per_replica), default=0)
    return [[*p, *([()] * (most - len(p)))] for p in per_replica]


@dataclass(frozen=True)
class MicroBatchPlan:
    """Per DP replica, its micro-batches as indices into the planned batch (() = empty work);
    every replica has the same number."""

    replicas: tuple[tuple[MicroBatch, ...], ...]
    loads: tuple[float, ...]  # cost per replica
    over_budget: tuple[int, ...]  # samples longer than the token budget (alone in theirs)

    def samples_of(self, replica: int) -> list[int]:
        """The replica's sample indices, in increasing order."""
        return sorted(i for mb in self.replicas[replica] for i in mb)

    def local(self, replica: int) -> list[MicroBatch]:
        """The replica's micro-batches as positions in its own sub-batch (`samples_of`)."""
        pos = {i: k for k, i in enumerate(self.samples_of(replica))}
        return [tuple(pos[i] for i in mb) for mb in self.replicas[replica]]


def layout_cost(lengths: Sequence[int], weight: float = 0.0, row_tokens: int = 0,
                pack: bool = True) -> float:
    """Compute of one micro-batch as the dense layout runs it (train/packing.py), padding
    included: rows x width slots through the matmuls and, per row, every score of the width x
    width square (the mask is applied after they are computed): 2 w rows x width^2, twice
    `sample_cost`'s causal half. Packed rows pay, besides, the attention between samples that
    the block-diagonal mask discards."""
    rows, width = row_slots(lengths, row_tokens, pack)
    return rows * width + 2 * weight * rows * width * width


def plan_micro_batches(lengths: Sequence[int], *, dp_size: int = 1, max_tokens: int = 0,
                       micro_batch_size: int = 0, attention_weight: float = 0.0,
                       padded: bool = False, row_tokens: int = 0) -> MicroBatchPlan:
    """The whole plan of one batch: replicas by cost (rule 1), micro-batches by budget or count
    (rule 2), equal counts (rule 3); by token budget, the better of that and whole micro-batches
    to replicas (rule 4). A pure function of its arguments."""
    _check_mode(max_tokens, micro_batch_size)
    lengths = [int(n) for n in lengths]
    if any(n < 1 for n in lengths):
        raise ValueError("sample lengths must be >= 1")
    costs = [sample_cost(n, attention_weight) for n in lengths]
    parts = balance_replicas(costs, dp_size)
    per_replica = []
    for part in parts:
        local = micro_batches([lengths[i] for i in part], max_tokens=max_tokens,
                              micro_batch_size=micro_batch_size, padded=padded, row_tokens=row_tokens)
        per_replica.append([tuple(part[k] for k in mb) for mb in local])
    over = tuple(i for i, n in enumerate(lengths) if max_tokens and n > max_tokens)
    plan = MicroBatchPlan(
        replicas=tuple(tuple(p) for p in pad_to_equal(per_replica)),
        loads=tuple(sum(costs[i] for i in part) for part in parts),
        over_budget=over,
    )
    if not max_tokens or dp_size == 1:
        return plan
    # rule 4: the same budget's micro-batches over the whole batch, whole ones to replicas by
    # LPT on their layout cost; kept where its slowest replica's layout cost is lower
    def load(micro: Sequence[MicroBatch]) -> float:
        return sum(layout_cost([lengths[i] for i in mb], attention_weight, row_tokens, not padded)
                   for mb in micro)

    whole = micro_batches(lengths, max_tokens=max_tokens, padded=padded, row_tokens=row_tokens)
    groups = balance_replicas([load([mb]) for mb in whole], dp_size)
    by_batches = [[whole[k] for k in part] for part in groups]
    if max(map(load, by_batches)) < max(map(load, per_replica)):
        return MicroBatchPlan(
            replicas=tuple(tuple(p) for p in pad_to_equal(by_batches)),
            loads=tuple(sum(costs[i] for mb in p for i in mb) for p in by_batches),
            over_budget=over,
        )
    return plan


def warn_over_budget(lengths: Sequence[int], max_tokens: int) -> None:
    """One warning per sample longer than the budget (it trains alone; memory follows it)."""
    for n in lengths:
        if max_tokens and n > max_tokens:
            warnings.warn(
                f"a sample of {n} tokens is longer than train.max_tokens_per_micro_batch="
                f"{max_tokens}: it gets a micro-batch of its own, whose memory follows its length",
                stacklevel=3,
            )


def assign_rows(lengths: Sequence[int], row_tokens: int = 0, pack: bool = True) -> list[list[int]]:
    """Sample indices per row of one packed micro-batch (train/packing.py): first-fit-decreasing
    rows of capacity max(row_tokens, longest); `pack=False`: one row per sample."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    capacity = max([row_tokens, *lengths])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def row_slots(lengths: Sequence[int], row_tokens: int = 0, pack: bool = True) -> tuple[int, int]:
    """(rows, width) of the dense packed layout of one micro-batch: its logits have rows x width
    positions and its attention mask rows x width^2 entries."""
    if not lengths:
        return 0, 0
    rows = assign_rows(lengths, row_tokens, pack)
    return len(rows), max(sum(lengths[i] for i in row) for row in rows)

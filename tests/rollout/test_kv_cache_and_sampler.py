"""SlotKVCache keeps every row's keys/values intact through joins, leaves, growth and
compaction; the sampler follows SGLang's semantics."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.rollout.engines.builtin.kv_cache import GROW_COLUMNS, SlotKVCache, prefill_mask
from rlkit.rollout.engines.builtin.sampler import RowSampling, sample


def _cache(slots=2, capacity=4) -> SlotKVCache:
    return SlotKVCache(num_layers=2, kv_heads=1, head_dim=1, dtype=torch.float32,
                       device="cpu", slots=slots, capacity=capacity)


def _prefilled(values: list[list[float]]) -> SlotKVCache:
    """A scratch cache holding `values[i]` (left-padded) as row i's keys and values."""
    width = max(len(v) for v in values)
    c = _cache(slots=len(values), capacity=width)
    c.lengths = [0] * len(values)
    k = torch.zeros(len(values), 1, width, 1)
    for i, v in enumerate(values):
        k[i, 0, width - len(v):, 0] = torch.tensor(v)
    for layer in range(2):
        c.update(k, k + 1000 * (layer + 1), layer)
    c.advance(width)
    return c


def _rows(c: SlotKVCache) -> list[list[float]]:
    """Each row's cached keys (layer 0), checking values/other layers agree."""
    out = []
    for r, n in enumerate(c.lengths):
        keys = c.keys[0][r, 0, c.end - n:c.end, 0].tolist()
        assert c.values[1][r, 0, c.end - n:c.end, 0].tolist() == [x + 2000 for x in keys]
        out.append(keys)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "leave", "step"]), st.integers(1, 9)),
                min_size=1, max_size=40))
def test_rows_survive_any_sequence_of_joins_leaves_and_steps(ops):
    c, model, counter, peak = _cache(), [], [0.0], 0

    def fresh(n):
        counter[0] += 1
        return [counter[0] * 100 + i for i in range(n)]

    for op, n in ops:
        if op == "join":
            rows = [fresh(n), fresh(max(1, n // 2))]
            c.add_rows(_prefilled(rows), [len(r) for r in rows])
            model += rows
        elif op == "leave" and model:
            idx = sorted({n % len(model), (n * 7) % len(model)})
            for old, new in c.remove_rows(idx):
                model[new] = model[old]
            del model[len(model) - len(idx):]
            if not model:
                c.clear()
        elif op == "step" and model:
            c.reserve(len(model), 1)
            new = torch.tensor([[fresh(1)[0]] for _ in model], dtype=torch.float32)[:, None, :, None]
            for layer in range(2):
                k, v = c.update(new, new + 1000 * (layer + 1), layer)
                assert k.shape[2] == c.end - c.start + 1  # the view the model attends over
            c.advance(1)
            for row, t in zip(model, new[:, 0, 0, 0].tolist()):
                row.append(t)
        assert _rows(c) == model
        # the capacity follows the longest row (+ a column, + a quarter): no doubling past it
        peak = max(peak, max(map(len, model), default=0) + 1)
        assert c.capacity <= max(4, -(-(peak + max(peak // 4, 2 * GROW_COLUMNS)) // GROW_COLUMNS) * GROW_COLUMNS)
        assert c.padded_tokens == (c.end - c.start) * len(model) - sum(map(len, model))


def test_decode_mask_marks_each_rows_own_tokens():
    c = _cache()
    c.add_rows(_prefilled([[1, 2, 3], [4]]), [3, 1])
    mask = c.decode_mask()[:, 0, 0, :].tolist()  # width = longest context + the new token
    assert mask == [[True, True, True, True], [False, False, True, True]]


def test_prefill_mask_is_causal_over_real_tokens():
    m = prefill_mask([2, 3], 3, "cpu")[:, 0]
    assert m[0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert m[1].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


# -- sampler -------------------------------------------------------------------------------------
def test_greedy_reports_unscaled_logprob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lps = sample(logits, [RowSampling(temperature=0.0)])
    assert tokens == [1]
    assert lps[0] == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())


def test_logprob_is_of_the_temperature_scaled_distribution_before_filtering():
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]])
    row = RowSampling(temperature=0.5, top_k=2, top_p=0.9, rng=random.Random(3))
    tokens, lps = sample(logits, [row])
    expected = torch.log_softmax(logits / 0.5, -1)[0, tokens[0]].item()
    assert lps[0] == pytest.approx(expected)  # SGLang: log_softmax(logits/T), not renormalised


def test_filters_restrict_the_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {k: set() for k in ("top_k", "top_p", "min_p")}
    rng = random.Random(0)
    for _ in range(300):
        seen["top_k"].add(sample(logits, [RowSampling(top_k=2, rng=rng)])[0][0])
        seen["top_p"].add(sample(logits, [RowSampling(top_p=0.7, rng=rng)])[0][0])
        seen["min_p"].add(sample(logits, [RowSampling(min_p=0.5, rng=rng)])[0][0])
    assert seen == {"top_k": {0, 1}, "top_p": {0, 1}, "min_p": {0, 1}}


def test_sampling_follows_the_scaled_distribution():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    rng = random.Random(1)
    counts = [0, 0, 0]
    n = 4000
    for _ in range(n):
        counts[sample(logits, [RowSampling(temperature=1.0, rng=rng)])[0][0]] += 1
    for c, p in zip(counts, [0.6, 0.3, 0.1]):
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_banned_tokens_are_never_drawn_and_rows_are_independent():
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    rows = [RowSampling(banned=(0,), rng=random.Random(1)), RowSampling(temperature=0.0)]
    for _ in range(50):
        tokens, lps = sample(logits, rows)
        assert tokens[0] != 0 and tokens[1] == 0
        assert lps[0] == pytest.approx(math.log(0.5))  # the ban is part of the distribution


def test_a_seeded_row_draws_the_same_whatever_its_neighbours():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    alone = [sample(logits[:1], [RowSampling(rng=random.Random(7))])[0][0] for _ in range(1)]
    batched = sample(logits, [RowSampling(rng=random.Random(7))]
                     + [RowSampling(top_k=3, rng=random.Random(i)) for i in range(3)])[0][0]
    assert alone[0] == batched

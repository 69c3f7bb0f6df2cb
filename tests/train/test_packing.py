"""Packing samples into rows with block-diagonal causal attention."""

import pytest
import torch

from rlkit.train.packing import assign_rows, pack_samples


def test_first_fit_decreasing_rows():
    assert assign_rows([5, 3, 4, 2], row_tokens=8) == [[0, 1], [2, 3]]
    assert assign_rows([10, 3], row_tokens=8) == [[0], [1]]  # a long sample gets its own row
    assert assign_rows([3, 3], pack=False) == [[0], [1]]  # padding scheme: one row per sample
    # default capacity: the longest sample, so never more rows than samples
    assert assign_rows([5, 3, 2, 4, 1]) == [[0], [3, 4], [1, 2]]


def test_pack_indices_targets_and_mask():
    a = torch.tensor([1, 2, 3, 4])  # prompt 2, response 3 4
    b = torch.tensor([5, 6, 7])  # prompt 1, response 6 7
    p = pack_samples([a, b], [2, 1], row_tokens=16)
    assert p.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    # logits at position q predict token q + 1
    assert p.logit_index.tolist() == [1, 2, 4, 5]
    assert p.target_ids.tolist() == [3, 4, 6, 7]
    assert p.sample_ids.tolist() == [0, 0, 1, 1]
    assert p.response_lengths == [2, 2]
    allowed = ~p.attention_mask[0, 0]
    assert allowed[3].tolist() == [True, True, True, True, False, False, False]
    assert allowed[5].tolist() == [False, False, False, False, True, True, False]
    assert (p.tokens, p.slots, p.padding_fraction) == (7, 7, 0.0)


def test_padding_scheme_costs_slots():
    p = pack_samples([torch.arange(6), torch.arange(2)], [1, 1], pack=False)
    assert p.input_ids.shape == (2, 6)
    assert p.padding_fraction == pytest.approx(4 / 12)
    assert p.logit_index.tolist() == [0, 1, 2, 3, 4, 6]


def test_prompt_must_be_at_least_one_token():
    with pytest.raises(ValueError, match="prompt length 0"):
        pack_samples([torch.arange(3)], [0], row_tokens=8)


def test_thd_layout_is_one_unpadded_row_with_cu_seqlens():
    """The varlen seam (TransformerEngine's THD format, not runnable here: no TE, no GPU): the
    same targets and logit positions as one dense row, no mask, sample offsets instead."""
    a, b = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6, 7])
    thd = pack_samples([a, b], [2, 1], layout="thd")
    dense = pack_samples([a, b], [2, 1], row_tokens=16)
    assert thd.attention_mask is None and dense.cu_seqlens is None
    assert thd.cu_seqlens.tolist() == [0, 4, 7] and thd.cu_seqlens.dtype == torch.int32
    assert thd.max_seqlen == 4 and (thd.tokens, thd.slots) == (7, 7)
    for field in ("input_ids", "position_ids", "logit_index", "target_ids", "sample_ids"):
        assert torch.equal(getattr(thd, field), getattr(dense, field)), field
    with pytest.raises(ValueError, match="layout"):
        pack_samples([a], [2], layout="bshd")


def test_shared_prompt_is_held_once_and_siblings_never_see_each_other():
    prompt = torch.tensor([7, 8, 9])
    a, b, c = torch.cat([prompt, torch.tensor([1, 2])]), torch.cat([prompt, torch.tensor([3])]), torch.tensor([5, 6, 4])
    p = pack_samples([a, b, c], [3, 3, 2], share_prompts=True)
    assert p.shared == 3 and p.tokens == 12 and p.input_ids.shape == (2, 6)  # [7 8 9 1 2 3], [5 6 4]
    assert p.input_ids[0].tolist() == [7, 8, 9, 1, 2, 3]
    assert p.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3]  # b's response continues the prompt
    seen = ~p.attention_mask[0, 0]
    assert seen[5].tolist() == [True, True, True, False, False, True]  # b: the prompt and itself
    assert seen[4].tolist() == [True, True, True, True, True, False]
    # a's tokens 1, 2 from positions 2 and 3; b's token 3 from the prompt's last position, 2
    assert p.logit_index.tolist() == [2, 3, 2, 6 + 1] and p.target_ids.tolist() == [1, 2, 3, 4]
    assert p.sample_ids.tolist() == [0, 0, 1, 2]
    unshared = pack_samples([a, b, c], [3, 3, 2])
    assert unshared.shared == 0 and unshared.tokens == 12

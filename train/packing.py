"""Pack variable-length samples into rows without padding between them.

Megatron's local (non-TransformerEngine) attention has no THD/cu_seqlens path, so samples are
packed the other way: several samples share one row, and a block-diagonal causal mask stops them
attending to each other. RoPE needs no position reset: attention scores depend only on the
relative position of query and key, which packing does not change (only float rounding differs).

Rows are filled first-fit-decreasing up to a capacity and padded to the longest row. The
default capacity is the longest sample of the micro-batch: that never needs more rows, slots or
attention work than one padded row per sample, and removes most of the padding. A larger
`row_tokens` packs more per row (fewer, longer rows: attention work grows with the square of the
row length, which dominates for small models). `pack=False` puts each sample in its own row: the
classic padded batch, kept so both schemes can be measured (`rlkit bench train`).
Cost model: linear layers see `slots` = rows x longest row tokens, of which `tokens` are real;
attention costs the sum over rows of (row length)^2. The mask costs rows x S^2 entries: a token
budget per micro-batch bounds it (train/microbatch_plan.py: at most budget^2 entries).

Shared prompts (`share_prompts`, on by default in the trainer): the samples of one GRPO group
start with the same prompt, so a row holds that prompt once, then each response after it. A
response attends to the prompt and to its own earlier tokens, never to a sibling's, and its
positions continue the prompt's (RoPE is applied from `position_ids`, train/megatron/trainer.py),
so every logprob and gradient is the unshared one up to float summation order; the response's
first token is predicted from the shared prompt's last position. With n samples of a p-token
prompt the forward and backward see p + sum(responses) tokens instead of n p + sum(responses):
on the default recipe (45-token prompts, 4 samples, about 30-token responses) about 40% fewer.

`layout="thd"` is the seam for a varlen attention path (TransformerEngine's THD format on GPUs):
all samples in one unpadded row, no mask, `cu_seqlens` marking where each sample starts, and the
trainer hands megatron a `PackedSeqParams` instead of the mask; memory then grows with the
tokens, not with their square. It is not used today and could not run here: megatron-core's
local layer spec (the one rlkit builds, train/megatron/model.py) has no THD attention, and
TransformerEngine (needed for it) is neither installed nor buildable on the CPU machines; wiring
it needs the TE layer spec in model.py, its fused layer-norm names in train/convert.py, and a
parity test on a GPU with TE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rlkit.train.microbatch_plan import assign_rows

__all__ = ["PackedRows", "assign_rows", "pack_samples"]

LAYOUTS = ("dense", "thd")


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, S] long
    position_ids: torch.Tensor  # [R, S] long, each token's position in its sample (RoPE's)
    attention_mask: torch.Tensor | None  # [R, 1, S, S] bool, True = masked (Megatron's); None in THD
    logit_index: torch.Tensor  # [T] flat index into R*S of the logits that predict each response token
    target_ids: torch.Tensor  # [T] response token ids
    sample_ids: torch.Tensor  # [T] position of the token's sample in the input sequence
    response_lengths: list[int]
    tokens: int  # the samples' tokens (prompt + response each)
    slots: int  # R * S
    cu_seqlens: torch.Tensor | None = None  # THD only: [samples + 1] int32 offsets into the one row
    max_seqlen: int = 0  # THD only: the longest sample
    shared: int = 0  # prompt tokens held once for several samples (not in any slot again)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - (self.tokens - self.shared) / self.slots if self.slots else 0.0


def pack_samples(
    tokens: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    row_tokens: int = 0,
    *,
    pack: bool = True,
    pad_id: int = 0,
    layout: str = "dense",
    share_prompts: bool = False,
) -> PackedRows:
    """Pack sequences (prompt + response token ids) whose first `prompt_lengths[i]` are prompt.
    `layout`: 'dense' (rows with a block-diagonal mask) or 'thd' (one row, `cu_seqlens`, no mask;
    `row_tokens` and `pack` do not apply). `share_prompts` (dense, packed): samples with the same
    prompt tokens share one copy of it (see the module's docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    lengths = [int(t.numel()) for t in tokens]
    for i, (n, p) in enumerate(zip(lengths, prompt_lengths)):
        if p < 1 or p > n:
            raise ValueError(
                f"sample {i}: prompt length {p} must be in [1, {n}] (the first response token "
                "is predicted from the last prompt token)"
            )
    thd = layout == "thd"
    units = _prompt_units(tokens, prompt_lengths) if share_prompts and pack and not thd else \
        [[i] for i in range(len(tokens))]
    unit_lengths = [prompt_lengths[u[0]] + sum(lengths[i] - prompt_lengths[i] for i in u) for u in units]
    rows = [list(range(len(units)))] if thd else assign_rows(unit_lengths, row_tokens, pack)
    width = max(sum(unit_lengths[u] for u in row) for row in rows)
    n_rows = len(rows)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    segment = torch.full((n_rows, width), -1, dtype=torch.long)  # the unit of each slot
    branch = torch.zeros((n_rows, width), dtype=torch.long)  # 0: its prompt, k: its k-th response
    logit_index: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(tokens)
    for r, row in enumerate(rows):
        offset = 0
        for u in row:
            p = prompt_lengths[units[u][0]]
            input_ids[r, offset : offset + p] = tokens[units[u][0]][:p]
            position_ids[r, offset : offset + p] = torch.arange(p)
            segment[r, offset : offset + unit_lengths[u]] = u
            last_prompt = r * width + offset + p - 1
            start = offset + p
            for k, i in enumerate(units[u], start=1):
                n = lengths[i] - p
                input_ids[r, start : start + n] = tokens[i][p:]
                position_ids[r, start : start + n] = torch.arange(p, p + n)
                branch[r, start : start + n] = k
                # logits at position q predict the token at q + 1: the first response token is
                # predicted from the prompt's last position, the others from their own
                logit_index[i] = torch.cat([torch.tensor([last_prompt]),
                                            r * width + start + torch.arange(n - 1)])[:n]
                start += n
            offset += unit_lengths[u]
    if thd:
        mask, cu_seqlens = None, torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    else:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = segment.unsqueeze(2) == segment.unsqueeze(1)
        # a query sees its unit's prompt and its own branch, never a sibling response
        visible = (branch.unsqueeze(1) == 0) | (branch.unsqueeze(1) == branch.unsqueeze(2))
        mask, cu_seqlens = (~(same & causal & visible)).unsqueeze(1), None
    response_lengths = [n - p for n, p in zip(lengths, prompt_lengths)]
    return PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=mask,
        logit_index=torch.cat(logit_index),
        target_ids=torch.cat([t[p:] for t, p in zip(tokens, prompt_lengths)]).long(),
        sample_ids=torch.repeat_interleave(
            torch.arange(len(tokens)), torch.tensor(response_lengths, dtype=torch.long)
        ),
        response_lengths=response_lengths,
        tokens=sum(lengths),
        shared=sum(lengths) - sum(unit_lengths),
        slots=n_rows * width,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths) if thd else 0,
    )


def _prompt_units(tokens: Sequence[torch.Tensor], prompt_lengths: Sequence[int]) -> list[list[int]]:
    """Samples grouped by identical prompt tokens, in order of first appearance."""
    units: dict[bytes, list[int]] = {}
    for i, (t, p) in enumerate(zip(tokens, prompt_lengths)):
        units.setdefault(t[:p].to(torch.long).numpy().tobytes(), []).append(i)
    return list(units.values())

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
    position_ids: torch.Tensor  # [R, S] long, restarting at 0 for each sample
    attention_mask: torch.Tensor | None  # [R, 1, S, S] bool, True = masked (Megatron's); None in THD
    logit_index: torch.Tensor  # [T] flat index into R*S of the logits that predict each response token
    target_ids: torch.Tensor  # [T] response token ids
    sample_ids: torch.Tensor  # [T] position of the token's sample in the input sequence
    response_lengths: list[int]
    tokens: int  # real tokens
    slots: int  # R * S
    cu_seqlens: torch.Tensor | None = None  # THD only: [samples + 1] int32 offsets into the one row
    max_seqlen: int = 0  # THD only: the longest sample

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def pack_samples(
    tokens: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    row_tokens: int = 0,
    *,
    pack: bool = True,
    pad_id: int = 0,
    layout: str = "dense",
) -> PackedRows:
    """Pack sequences (prompt + response token ids) whose first `prompt_lengths[i]` are prompt.
    `layout`: 'dense' (rows with a block-diagonal mask) or 'thd' (one row, `cu_seqlens`, no mask;
    `row_tokens` and `pack` do not apply)."""
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
    rows = [list(range(len(lengths)))] if thd else assign_rows(lengths, row_tokens, pack)
    width = max(sum(lengths[i] for i in row) for row in rows)
    n_rows = len(rows)
    input_ids = torch.full((n_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, width), dtype=torch.long)
    segment = torch.full((n_rows, width), -1, dtype=torch.long)
    logit_index: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)] * len(tokens)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            n, p = lengths[i], prompt_lengths[i]
            input_ids[r, offset : offset + n] = tokens[i]
            position_ids[r, offset : offset + n] = torch.arange(n)
            segment[r, offset : offset + n] = i
            # logits at position q predict the token at q + 1
            logit_index[i] = r * width + offset + torch.arange(p - 1, n - 1)
            offset += n
    if thd:
        mask, cu_seqlens = None, torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    else:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = segment.unsqueeze(2) == segment.unsqueeze(1)
        mask, cu_seqlens = (~(same & causal)).unsqueeze(1), None
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
        slots=n_rows * width,
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths) if thd else 0,
    )

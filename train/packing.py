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
attention costs the sum over rows of (row length)^2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, S] long
    position_ids: torch.Tensor  # [R, S] long, restarting at 0 for each sample
    attention_mask: torch.Tensor  # [R, 1, S, S] bool, True = masked (Megatron's convention)
    logit_index: torch.Tensor  # [T] flat index into R*S of the logits that predict each response token
    target_ids: torch.Tensor  # [T] response token ids
    sample_ids: torch.Tensor  # [T] position of the token's sample in the input sequence
    response_lengths: list[int]
    tokens: int  # real tokens
    slots: int  # R * S

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def assign_rows(lengths: Sequence[int], row_tokens: int = 0, pack: bool = True) -> list[list[int]]:
    """Sample indices per row: first-fit-decreasing bins of capacity max(row_tokens, longest)."""
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


def pack_samples(
    tokens: Sequence[torch.Tensor],
    prompt_lengths: Sequence[int],
    row_tokens: int = 0,
    *,
    pack: bool = True,
    pad_id: int = 0,
) -> PackedRows:
    """Pack sequences (prompt + response token ids) whose first `prompt_lengths[i]` are prompt."""
    lengths = [int(t.numel()) for t in tokens]
    for i, (n, p) in enumerate(zip(lengths, prompt_lengths)):
        if p < 1 or p > n:
            raise ValueError(
                f"sample {i}: prompt length {p} must be in [1, {n}] (the first response token "
                "is predicted from the last prompt token)"
            )
    rows = assign_rows(lengths, row_tokens, pack)
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
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    allowed = same & causal
    response_lengths = [n - p for n, p in zip(lengths, prompt_lengths)]
    return PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=(~allowed).unsqueeze(1),
        logit_index=torch.cat(logit_index),
        target_ids=torch.cat([t[p:] for t, p in zip(tokens, prompt_lengths)]).long(),
        sample_ids=torch.repeat_interleave(
            torch.arange(len(tokens)), torch.tensor(response_lengths, dtype=torch.long)
        ),
        response_lengths=response_lengths,
        tokens=sum(lengths),
        slots=n_rows * width,
    )

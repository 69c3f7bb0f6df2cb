"""Batched token sampling with SGLang's semantics, one row per running request.

What SGLang does, and so what this does (checked against SGLang's sampler and its
`SamplingParams`):
- temperature < 1e-6 means greedy: the argmax, reported with the *unscaled* log-softmax;
- otherwise the reported logprob of the sampled token is `log_softmax(logits / temperature)`,
  taken BEFORE top-k / top-p / min-p filtering (SGLang's default; its env switch
  SGLANG_RETURN_ORIGINAL_LOGPROB would report unscaled logprobs instead, we do not);
- the token is drawn from the temperature-scaled distribution restricted by top-k, then top-p,
  then min-p, renormalised;
- until `min_new_tokens` are generated, EOS and the request's stop tokens are masked to -inf
  before anything else (so the reported logprobs include that mask, as SGLang's penalizer does).

Determinism: each row draws its uniform from its own `random.Random` (seeded by the request's
`sampling_seed`, or by the server's seed sequence), and the token is found by inverse CDF. A
seeded request therefore gets the same tokens whatever else is in the batch, up to floating
point differences of batched matmuls.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

GREEDY_EPS = 1e-6


@dataclass
class RowSampling:
    """The sampling parameters of one row, already validated."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0
    rng: random.Random = field(default_factory=random.Random)
    banned: tuple[int, ...] = ()  # token ids masked this step (min_new_tokens not reached yet)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


def sample(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[float]]:
    """Sample one token per row of `logits` [B, V]; return (token ids, their logprobs)."""
    logits = logits.float()
    b, vocab = logits.shape
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned]
    if banned:
        logits = logits.clone()
        ri, ti = zip(*banned)
        logits[list(ri), list(ti)] = float("-inf")

    greedy = [r.greedy for r in rows]
    temps = torch.tensor(
        [1.0 if g else r.temperature for g, r in zip(greedy, rows)], dtype=logits.dtype,
        device=logits.device,
    )
    scaled = logits / temps[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)

    tokens = torch.empty(b, dtype=torch.long, device=logits.device)
    if any(greedy):
        tokens[:] = torch.argmax(logits, dim=-1)
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=logits.device)
        uniforms = torch.tensor(
            [rows[i].rng.random() for i in sampled_rows], dtype=torch.float64,
            device=logits.device,
        )
        sub_rows = [rows[i] for i in sampled_rows]
        tokens[idx] = _draw(logprobs[idx], sub_rows, uniforms)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _draw(logprobs: torch.Tensor, rows: list[RowSampling], uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from each row's filtered distribution. Unfiltered rows walk the CDF in
    vocabulary order and filtered rows in probability order; a row's draw depends only on its
    own logits and uniform, never on which other rows share the batch."""
    out = torch.empty(len(rows), dtype=torch.long, device=logprobs.device)
    is_filtered = [r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0 for r in rows]
    filtered = [i for i, f in enumerate(is_filtered) if f]
    plain = [i for i, f in enumerate(is_filtered) if not f]
    if plain:
        idx = torch.tensor(plain, device=logprobs.device)
        cdf = torch.cumsum(torch.exp(logprobs[idx]).double(), dim=-1)
        out[idx] = _search(cdf, uniforms[idx])
    if filtered:
        idx = torch.tensor(filtered, device=logprobs.device)
        out[idx] = _draw_filtered(logprobs[idx], [rows[i] for i in filtered], uniforms[idx])
    return out


def _draw_filtered(logprobs: torch.Tensor, rows: list[RowSampling], uniforms: torch.Tensor) -> torch.Tensor:
    """top-k, then top-p, then min-p over the sorted distribution, renormalised."""
    probs, order = torch.sort(torch.exp(logprobs), dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    top_k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=probs.device)
    top_p = torch.tensor([r.top_p for r in rows], dtype=probs.dtype, device=probs.device)
    min_p = torch.tensor([r.min_p for r in rows], dtype=probs.dtype, device=probs.device)
    keep = ranks < top_k[:, None]
    # top-p: keep a token if the mass strictly before it is below top_p (the first always stays)
    before = torch.cumsum(probs, dim=-1) - probs
    keep &= before < top_p[:, None]
    keep &= probs >= (min_p * probs[:, 0])[:, None]
    keep[:, 0] = True
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(kept.double(), dim=-1)
    position = _search(cdf, uniforms)
    return order.gather(1, position[:, None])[:, 0]


def _search(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first cdf entry above u * total, per row (clamped into the vocabulary)."""
    target = (uniforms * cdf[:, -1])[:, None]
    position = torch.searchsorted(cdf, target, right=True)[:, 0]
    return position.clamp_(max=cdf.shape[-1] - 1)

"""Mismatch telemetry: how far the engine's distribution is from pi_old on the trained tokens,
by how many versions behind each token is.

A token's lag is the trainer's policy version minus the version that generated it. Lag 0 is the
pure train-inference mismatch (same weights, other kernels); lag k adds k optimizer steps of
drift. Per bucket (lag 0, 1, 2, 3+, and apart: tokens of resumed partial samples and of fresh
ones), with l = log rho = pi_old - pi_rollout clamped to +-20 and rho = exp(l):

  tokens            n
  abs_log_ratio     mean |l|; p99 from a log-spaced histogram, its bin's upper edge (bins are
                    22% wide from 1e-4 to 20; below 1e-4 reads 1e-4)
  kl_k1             mean(-l)           estimates KL(rollout || old) from the rollout's samples
  kl_k3             mean(rho - 1 - l)  the same, non-negative per token (Schulman's k3)
  ess               (sum rho)^2 / (n sum rho^2), the IS weights' effective sample size / n
  chi2              mean(rho^2) - 1, the chi-squared divergence the weights estimate
  truncated, masked, rejected   shares of the bucket's tokens the correction changed

Every figure is a sum over tokens, so micro-batches and data-parallel ranks add their vectors
(one fixed layout, all-reduced with the trainer's other counters) and `metrics` divides once.
"""

from __future__ import annotations

import math

import torch

BUCKETS = ("lag0", "lag1", "lag2", "lag3plus", "fresh", "resumed")
MAX_LAG_BUCKET = 3  # lags of 3 and more share the last lag bucket
LAG_BUCKETS = BUCKETS[:MAX_LAG_BUCKET + 1]
# what `metrics` reports per bucket, as mismatch/<bucket>/<figure>
FIGURES = ("tokens", "abs_log_ratio_mean", "abs_log_ratio_p99", "kl_k1", "kl_k3", "ess", "chi2",
           "truncated", "masked", "rejected")
_SUMS = ("tokens", "abs_log_ratio", "k1", "k3", "rho", "rho_sq", "truncated", "masked", "rejected")
_HIST_LOW, _HIST_HIGH, _HIST_BINS = 1e-4, 20.0, 64
# bin b (1..BINS-1) holds |l| in [edge[b-1], edge[b]); bin 0 everything below 1e-4
_EDGES = [_HIST_LOW * (_HIST_HIGH / _HIST_LOW) ** (i / (_HIST_BINS - 2)) for i in range(_HIST_BINS - 1)]
_PER_BUCKET = len(_SUMS) + _HIST_BINS
SIZE = len(BUCKETS) * _PER_BUCKET


def bucket_masks(lag: torch.Tensor, resumed: torch.Tensor, keep: torch.Tensor) -> list[torch.Tensor]:
    """One bool mask per bucket, in BUCKETS order, over the trained tokens."""
    lags = [keep & (lag == k) for k in range(MAX_LAG_BUCKET)]
    lags.append(keep & (lag >= MAX_LAG_BUCKET))
    return [*lags, keep & ~resumed, keep & resumed]


def telemetry_sums(log_ratio: torch.Tensor, lag: torch.Tensor, resumed: torch.Tensor,
                   keep: torch.Tensor, truncated: torch.Tensor, masked: torch.Tensor,
                   rejected: torch.Tensor) -> torch.Tensor:
    """The [SIZE] float64 vector of one micro-batch (see the module docstring). `log_ratio` is
    the token's clamped l (0 at mask-0 tokens); the bool tensors are per token."""
    with torch.no_grad():
        lr = log_ratio.detach().to(torch.float64)
        rho = torch.exp(lr)
        absl = lr.abs()
        per_token = (torch.ones_like(lr), absl, -lr, rho - 1 - lr, rho, rho * rho,
                     truncated.to(torch.float64), masked.to(torch.float64), rejected.to(torch.float64))
        edges = torch.tensor(_EDGES, dtype=torch.float64, device=lr.device)
        bins = torch.bucketize(absl, edges, right=True)
        out = []
        for m in bucket_masks(lag, resumed, keep):
            out.extend(torch.where(m, v, 0.0).sum() for v in per_token)
            hist = torch.zeros(_HIST_BINS, dtype=torch.float64, device=lr.device)
            out.append(hist.index_add(0, bins[m], torch.ones_like(absl[m])))
        return torch.cat([x.reshape(-1) for x in out]).cpu()


def empty() -> torch.Tensor:
    return torch.zeros(SIZE, dtype=torch.float64)


def _p99(hist: list[float], n: float) -> float:
    seen = 0.0
    for b, count in enumerate(hist):
        seen += count
        if seen >= 0.99 * n:
            return _EDGES[b] if b < len(_EDGES) else _HIST_HIGH
    return _HIST_HIGH


def metrics(vector: torch.Tensor | list[float], prefix: str = "mismatch") -> dict[str, float]:
    """`{prefix}/{bucket}/{figure}` for every bucket with a token (an empty bucket is absent, not
    0: no token is not no mismatch)."""
    v = [float(x) for x in vector]
    if len(v) != SIZE:
        raise ValueError(f"mismatch telemetry: a vector of {len(v)} values, expected {SIZE}")
    out: dict[str, float] = {}
    for i, bucket in enumerate(BUCKETS):
        part = v[i * _PER_BUCKET:(i + 1) * _PER_BUCKET]
        s = dict(zip(_SUMS, part))
        n = s["tokens"]
        if n <= 0:
            continue
        figures = {
            "tokens": n,
            "abs_log_ratio_mean": s["abs_log_ratio"] / n,
            "abs_log_ratio_p99": _p99(part[len(_SUMS):], n),
            "kl_k1": s["k1"] / n,
            "kl_k3": s["k3"] / n,
            "ess": s["rho"] ** 2 / (n * s["rho_sq"]) if s["rho_sq"] > 0 else math.nan,
            "chi2": s["rho_sq"] / n - 1.0,
            **{share: s[share] / n for share in ("truncated", "masked", "rejected")},
        }
        out.update({f"{prefix}/{bucket}/{k}": figures[k] for k in FIGURES})
    return out

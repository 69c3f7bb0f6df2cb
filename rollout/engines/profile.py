"""Engine performance profiles: per-token latency as a function of the running batch.

The JSON format is shared with `rlkit bench engine`, which measures it on real engines:

    {"name": str, "source": str (how it was measured, or which publication and derivation),
     "device": str, "model": str,
     "batch_sizes": [int, ...] (increasing),
     "ptl_s": [float, ...] (seconds per decode step at that running-batch size),
     "prefill_s_per_token": float}

Optional keys, written by the GPU-like profiles derived from published figures (roofline.py):

    "kv_s_per_token": float   seconds a decode step takes per token held in the running
                              batch's KV cache (attention reads it all every step); 0 means
                              `ptl_s` already covers the context of the measurement
    "kv_s_per_token_by_batch": [float, ...]  the same per batch size (aligned with
                              batch_sizes, interpolated; replaces kv_s_per_token): on CPU the
                              cost per KV token read grows with the batch
    "kv_capacity_tokens": int KV-cache capacity of one engine, prompt + generated tokens
    "max_running_requests": int  the engine's batch limit (default: the largest batch size)

Optional prefill keys (measured on rlkit's hf CPU engine by `python -m rlkit.sim.measure_hf`):

    "prefill_s_per_forward": float   fixed seconds of one prefill forward
    "prefill_s_per_token_sq": float  seconds per squared context token (attention over the
                                     context: quadratic in it, dominant for small models)
    "max_prefill_tokens": int        tokens one prefill forward may take (the hf engine: rows x
                                     longest context, its --max-prefill-tokens); more waiting
                                     requests are prefilled in later forwards, one decode step
                                     between two forwards

One decode step with B running requests holding K tokens of KV takes

    ptl(B, K) = interp(batch_sizes, ptl_s)(B) + kv_s(B) * K

(kv_s(B) = kv_s_per_token, or interp(batch_sizes, kv_s_per_token_by_batch)(B))

with linear interpolation between measured batch sizes. Beyond the largest measured batch the
engine never runs (max_running_requests defaults to it); below the smallest, the smallest
batch's latency is used (a decode step never gets cheaper than one request's).

One prefill forward over contexts n_1..n_R takes

    prefill_s_per_forward + prefill_s_per_token * T1 + prefill_s_per_token_sq * T2

with T1 = sum n_i, T2 = sum n_i^2 (paged KV: each request its own context) or T1 = R x max n,
T2 = R x (max n)^2 (padded KV: every row padded to the longest).

A profile may also carry a "serving" object: measured properties of the serving stack and the
machine around the engines (CPU per streamed chunk, control round trip, cores), read by
`SimConfig.from_profile` (rlkit/sim/engine.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np

PROFILE_PACKAGE = "rlkit.rollout.engines.profiles"


class ProfileError(ValueError):
    """A profile file that does not follow the format."""


@dataclass(frozen=True)
class EngineProfile:
    name: str
    source: str
    device: str
    model: str
    batch_sizes: tuple[int, ...]
    ptl_s: tuple[float, ...]
    prefill_s_per_token: float
    kv_s_per_token: float = 0.0
    kv_capacity_tokens: int | None = None
    max_running_requests: int | None = None
    prefill_s_per_forward: float = 0.0
    prefill_s_per_token_sq: float = 0.0
    max_prefill_tokens: int | None = None
    kv_s_per_token_by_batch: tuple[float, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        bs, ptl = self.batch_sizes, self.ptl_s
        where = f"profile {self.name!r}"
        if not bs or len(bs) != len(ptl):
            raise ProfileError(f"{where}: batch_sizes and ptl_s must be non-empty and equally long")
        if any(b < 1 for b in bs) or any(b2 <= b1 for b1, b2 in zip(bs, bs[1:])):
            raise ProfileError(f"{where}: batch_sizes must be increasing integers >= 1, got {bs}")
        if any(not (p > 0 and math.isfinite(p)) for p in ptl):
            raise ProfileError(f"{where}: ptl_s must be positive and finite")
        if min(self.prefill_s_per_token, self.kv_s_per_token, self.prefill_s_per_forward,
               self.prefill_s_per_token_sq) < 0:
            raise ProfileError(f"{where}: prefill and kv costs must be >= 0")
        kvb = self.kv_s_per_token_by_batch
        if kvb is not None and (len(kvb) != len(bs) or any(not (k >= 0 and math.isfinite(k))
                                                            for k in kvb)):
            raise ProfileError(f"{where}: kv_s_per_token_by_batch must be >= 0, one per batch size")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ProfileError(f"{where}: max_prefill_tokens must be >= 1")
        if self.kv_capacity_tokens is not None and self.kv_capacity_tokens < 1:
            raise ProfileError(f"{where}: kv_capacity_tokens must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ProfileError(f"{where}: max_running_requests must be >= 1")

    # -- the latency model ----------------------------------------------------------------
    @property
    def batch_limit(self) -> int:
        return self.max_running_requests or self.batch_sizes[-1]

    def step_base_s(self, batch: int) -> float:
        """Seconds of one decode step of `batch` requests, without the KV-context term."""
        return float(np.interp(batch, self.batch_sizes, self.ptl_s))

    def kv_s(self, batch: int) -> float:
        """Seconds per KV token a decode step of `batch` requests reads."""
        if self.kv_s_per_token_by_batch is None:
            return self.kv_s_per_token
        return float(np.interp(batch, self.batch_sizes, self.kv_s_per_token_by_batch))

    def ptl(self, batch: int, kv_tokens: int = 0) -> float:
        """Seconds of one decode step of `batch` requests holding `kv_tokens` of KV cache."""
        return self.step_base_s(batch) + self.kv_s(batch) * kv_tokens

    def prefill_forward_s(self, contexts: Sequence[int], padded: bool = False,
                          cached: Sequence[int] | None = None) -> float:
        """Seconds of one prefill forward over requests of these context lengths. `cached`:
        each request's prefix already in the KV cache (paged only): only the rest is computed,
        attending to the whole context."""
        if not contexts:
            return 0.0
        if padded:
            w = max(contexts)
            t1, t2 = len(contexts) * w, len(contexts) * w * w
        elif cached is not None:
            t1 = sum(c - h for c, h in zip(contexts, cached))
            t2 = sum((c - h) * c for c, h in zip(contexts, cached))
        else:
            t1, t2 = sum(contexts), sum(c * c for c in contexts)
        return (self.prefill_s_per_forward + self.prefill_s_per_token * t1
                + self.prefill_s_per_token_sq * t2)

    def peak_throughput(
        self, mean_context: float = 0.0, *, kv_capacity: int | None = None,
        batch_limit: int | None = None,
    ) -> tuple[float, int]:
        """Best decode throughput (tokens/s) of one engine and the batch that reaches it, when
        every running request holds `mean_context` tokens of KV (the bubble-free bound)."""
        cap = kv_capacity if kv_capacity is not None else self.kv_capacity_tokens
        limit = batch_limit or self.batch_limit
        if cap is not None and mean_context > 0:
            limit = max(1, min(limit, int(cap // max(mean_context, 1.0))))
        best, best_b = 0.0, 1
        for b in range(1, limit + 1):
            tput = b / self.ptl(b, int(b * mean_context))
            if tput > best:
                best, best_b = tput, b
        return best, best_b

    # -- (de)serialisation ------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "source": self.source,
            "device": self.device,
            "model": self.model,
            "batch_sizes": list(self.batch_sizes),
            "ptl_s": list(self.ptl_s),
            "prefill_s_per_token": self.prefill_s_per_token,
        }
        if self.kv_s_per_token:
            out["kv_s_per_token"] = self.kv_s_per_token
        if self.kv_capacity_tokens is not None:
            out["kv_capacity_tokens"] = self.kv_capacity_tokens
        if self.max_running_requests is not None:
            out["max_running_requests"] = self.max_running_requests
        if self.prefill_s_per_forward:
            out["prefill_s_per_forward"] = self.prefill_s_per_forward
        if self.prefill_s_per_token_sq:
            out["prefill_s_per_token_sq"] = self.prefill_s_per_token_sq
        if self.max_prefill_tokens is not None:
            out["max_prefill_tokens"] = self.max_prefill_tokens
        if self.kv_s_per_token_by_batch is not None:
            out["kv_s_per_token_by_batch"] = list(self.kv_s_per_token_by_batch)
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "profile") -> "EngineProfile":
        required = ("name", "source", "device", "model", "batch_sizes", "ptl_s",
                    "prefill_s_per_token")
        missing = [k for k in required if k not in data]
        if missing:
            raise ProfileError(f"{where}: missing key(s) {', '.join(missing)}")
        known = {f.name for f in fields(cls)} - {"extra"}
        try:
            return cls(
                name=str(data["name"]),
                source=str(data["source"]),
                device=str(data["device"]),
                model=str(data["model"]),
                batch_sizes=tuple(int(b) for b in data["batch_sizes"]),
                ptl_s=tuple(float(p) for p in data["ptl_s"]),
                prefill_s_per_token=float(data["prefill_s_per_token"]),
                kv_s_per_token=float(data.get("kv_s_per_token", 0.0)),
                kv_capacity_tokens=_opt_int(data.get("kv_capacity_tokens")),
                max_running_requests=_opt_int(data.get("max_running_requests")),
                prefill_s_per_forward=float(data.get("prefill_s_per_forward", 0.0)),
                prefill_s_per_token_sq=float(data.get("prefill_s_per_token_sq", 0.0)),
                max_prefill_tokens=_opt_int(data.get("max_prefill_tokens")),
                kv_s_per_token_by_batch=None if data.get("kv_s_per_token_by_batch") is None
                else tuple(float(k) for k in data["kv_s_per_token_by_batch"]),
                extra={k: v for k, v in data.items() if k not in known},
            )
        except (TypeError, ValueError) as e:
            if isinstance(e, ProfileError):
                raise
            raise ProfileError(f"{where}: {e}") from None


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """A profile by file path, or by name among the packaged ones (rollout/engines/profiles)."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ProfileError(f"profile file {path} does not exist")
        return EngineProfile.from_json(_read_json(path.read_text(), str(path)), str(path))
    pkg = resources.files(PROFILE_PACKAGE)
    candidate = pkg / f"{name_or_path}.json"
    if not candidate.is_file():
        raise ProfileError(
            f"no profile named {name_or_path!r}; packaged profiles: "
            f"{', '.join(packaged_profiles()) or '(none)'}"
        )
    return EngineProfile.from_json(
        _read_json(candidate.read_text(), str(name_or_path)), str(name_or_path)
    )


def packaged_profiles() -> list[str]:
    pkg = resources.files(PROFILE_PACKAGE)
    return sorted(p.name[:-5] for p in pkg.iterdir() if p.name.endswith(".json"))


def save_profile(profile: EngineProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=2) + "\n")


def _read_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{where}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    return data


def constant_profile(
    ptl_s: float | Sequence[float] = 0.01,
    batch_sizes: Sequence[int] = (1,),
    *,
    prefill_s_per_token: float = 0.0,
    kv_s_per_token: float = 0.0,
    kv_capacity_tokens: int | None = None,
    max_running_requests: int = 1024,
    name: str = "synthetic",
    **prefill: Any,
) -> EngineProfile:
    """A hand-made profile (tests, what-if studies); PTL is flat beyond the last batch size."""
    ptl = (ptl_s,) * len(batch_sizes) if isinstance(ptl_s, (int, float)) else tuple(ptl_s)
    return EngineProfile(
        name=name, source="synthetic", device="none", model="none",
        batch_sizes=tuple(batch_sizes), ptl_s=tuple(float(p) for p in ptl),
        prefill_s_per_token=prefill_s_per_token, kv_s_per_token=kv_s_per_token,
        kv_capacity_tokens=kv_capacity_tokens, max_running_requests=max_running_requests,
        **prefill,
    )

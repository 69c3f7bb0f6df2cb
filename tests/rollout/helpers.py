"""Helpers of the engine-layer tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"

# Logprobs reported by an engine vs a teacher-forced forward of the same weights: float32 on
# CPU, batched (padded) vs unbatched matmuls differ by rounding only.
LOGPROB_TOLERANCE = 1e-4


def fixture_json(name: str):
    return json.loads((FIXTURES / name).read_text())


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def teacher_forced_logprobs(model, prompt: Sequence[int], response: Sequence[int],
                            temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each response token given everything before it: what SGLang
    (and so the hf engine) reports for sampled tokens."""
    import torch

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 1e-6 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(list(response))[:, None])[:, 0].tolist()


class EngineControls:
    """Every engine's control API through the one control client (the weight sender's,
    rlkit.common.engine_http), fanned out and awaitable: for tests that drive
    engines by hand (pause, flush, weight updates, continue) as a weight sync does, plus the two
    reads a test checks them by (/health, the weight version)."""

    def __init__(self, urls: Sequence[str], timeout_s: float = 120.0) -> None:
        from rlkit.common.engine_http import HttpEngine

        self.urls = [u.rstrip("/") for u in urls]
        self.engines = [HttpEngine(u, timeout_s=timeout_s) for u in self.urls]

    async def _each(self, call) -> None:
        import asyncio

        await asyncio.gather(*(asyncio.to_thread(call, i, e) for i, e in enumerate(self.engines)))

    async def pause(self, mode: str) -> None:
        await self._each(lambda i, e: e.pause(mode))

    async def flush_cache(self) -> None:
        await self._each(lambda i, e: e.flush_cache())

    async def continue_generation(self) -> None:
        await self._each(lambda i, e: e.continue_generation())

    async def update_weights_from_disk(self, model_path: str, version: int) -> None:
        await self._each(lambda i, e: e.update_from_disk(model_path, version))

    async def init_weights_update_group(self, master_address: str, master_port: int, *,
                                        group_name: str, backend: str = "gloo") -> None:
        """Engine i joins as rank 1 + i of 1 + engines (the trainer is rank 0)."""
        world = 1 + len(self.engines)
        await self._each(lambda i, e: e.init_group(master_address, master_port, 1 + i, world,
                                                   group_name, backend))

    async def begin_weight_update(self) -> None:
        await self._each(lambda i, e: e.begin_update())

    async def end_weight_update(self) -> None:
        await self._each(lambda i, e: e.end_update())

    async def update_weights_from_distributed(self, names, dtypes, shapes, *, version: int,
                                              group_name: str) -> None:
        await self._each(lambda i, e: e.update_from_distributed(names, dtypes, shapes,
                                                                group_name, version))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._each(lambda i, e: e.destroy_group(group_name))

    async def health(self) -> dict[str, bool]:
        import asyncio

        ok = await asyncio.gather(*(asyncio.to_thread(_get_ok, f"{u}/health") for u in self.urls))
        return dict(zip(self.urls, ok))

    async def weight_versions(self) -> dict[str, str]:
        import asyncio

        from rlkit.rollout.http.protocol import MODEL_INFO_PATHS

        # SGLang 0.5.23 reports the version in /model_info only
        bodies = await asyncio.gather(*(asyncio.to_thread(_get_json, f"{u}{MODEL_INFO_PATHS[0]}")
                                        for u in self.urls))
        return {u: str(b.get("weight_version")) for u, b in zip(self.urls, bodies)}


def _get_json(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _get_ok(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False

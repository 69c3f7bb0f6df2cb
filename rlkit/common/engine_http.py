"""rlkit's one client of an engine server's HTTP API beyond generation (SGLang's, which the
built-in engine also serves), and the two views the sides of a run have of it:

    EngineControl  the rollout side's (rollout/weight_update.py): pause, flush, continue,
                   begin/end of a weight update, sleep and wake (release/resume memory). The
                   rollout side owns the engines: only it changes their state.
    EngineWeights  the trainer's (train/weight_sync/sender.py): what it needs to publish weights
                   into an update the rollout side opened: the TP size and GPUs (/server_info),
                   the weight-update group, and the updates themselves (disk, tensor, broadcast).

Sent to each engine worker itself: the sglang-router forwards none of them (docs/facts.md). stdlib
HTTP only; one call per method, no retries (a weight update that half-applied must not be retried
blindly). Every body states the flags whose SGLang defaults would surprise: `mode` for pause,
`abort_all_requests` and `flush_cache` for updates. (Generation and its aborts are the
EngineClient's, rollout/http/client.py.)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import Executor, Future
from typing import Any, Callable, Protocol, Sequence

from rlkit.common.control_token import auth_headers, control_token_from_env


# How an engine answers the unload of an adapter it does not hold: the built-in engine ("LoRA
# adapter 'x' is not loaded"), SGLang 0.5.23's LoRA registry ("LoRA with name x does not exist").
UNKNOWN_ADAPTER = ("is not loaded", "does not exist")


class EngineControlError(RuntimeError):
    """An engine refused or failed a control call."""


class WeightSyncError(RuntimeError):
    """A weight update did not complete; the message names the engine and the step."""


class EngineControl(Protocol):
    """One engine worker, as its owner (the rollout side) sees it: its state around updates."""

    url: str

    def pause(self, mode: str) -> None: ...
    def flush_cache(self) -> None: ...
    def continue_generation(self) -> None: ...
    def begin_update(self) -> None: ...
    def end_update(self) -> None: ...
    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]: ...
    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]: ...
    def unload_lora(self, name: str) -> bool: ...  # the rollout side's: it knows what is in use


class EngineWeights(Protocol):
    """One engine worker, as the trainer sees it: where it publishes weights into an open update."""

    url: str

    def tp_size(self) -> int: ...
    def gpu_ids(self) -> list[str]: ...
    def update_from_disk(self, model_path: str, version: int, *, flush_cache: bool = True) -> None: ...
    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> None: ...
    def update_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str, version: int,
    ) -> None: ...
    def update_from_tensor(self, body: dict[str, Any]) -> None: ...
    def load_lora_from_tensors(self, body: dict[str, Any]) -> None: ...
    def load_lora(self, name: str, path: str) -> None: ...
    def destroy_group(self, group_name: str) -> None: ...


# The calls each side may make: a test checks that the trainer never reaches the first list.
CONTROL_CALLS = tuple(n for n in vars(EngineControl) if not n.startswith("_") and n != "url")
WEIGHT_CALLS = tuple(n for n in vars(EngineWeights) if not n.startswith("_") and n != "url")


def fan_out(pool: Executor, engines: Sequence[Any], step: str, call: Callable[[Any], Any],
            timeout_s: float, done: Callable[[Any, Any], None] | None = None) -> list:
    """`call(engine)` on every engine at once; their answers, in order. Raises WeightSyncError
    naming each engine that failed at `step`; `done(engine, answer)` runs for each that
    succeeded, also when others failed (what is known of every engine stays true)."""
    return wait_all([(e, pool.submit(call, e)) for e in engines], step, timeout_s, done)


def wait_all(futures: Sequence[tuple[Any, Future]], step: str, timeout_s: float,
             done: Callable[[Any, Any], None] | None = None) -> list:
    """Wait for every engine's call (fan_out's second half, for calls submitted one by one)."""
    errors, answers = [], []
    for e, f in futures:
        try:
            answers.append(f.result(timeout=timeout_s))
        except Exception as err:  # noqa: BLE001 - reported with the engine and step
            errors.append(f"{e.url}: {err}")
        else:
            if done is not None:
                done(e, answers[-1])
    if errors:
        raise WeightSyncError(f"{step} failed on {len(errors)} engine(s): " + "; ".join(errors))
    return answers


class HttpEngine:
    """Both views (EngineControl, EngineWeights) over HTTP. `control_token`: the run's control
    token (rollout.http.auth), sent as `Authorization: Bearer` on every call; default
    $RLKIT_CONTROL_TOKEN."""

    def __init__(self, url: str, timeout_s: float = 600.0, control_token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.control_token = control_token if control_token is not None else control_token_from_env()

    def _post(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """POST `body` as JSON (None: a GET)."""
        req = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **auth_headers(self.control_token)},
            method="GET" if body is None else "POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise EngineControlError(f"{req.method} {self.url}{path}: HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise EngineControlError(f"{req.method} {self.url}{path}: {e}") from e
        try:
            answer = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            answer = {"raw": raw.decode(errors="replace")}
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineControlError(f"{req.method} {self.url}{path}: {answer.get('message', answer)}")
        return answer if isinstance(answer, dict) else {"answer": answer}

    def tp_size(self) -> int:
        """The engine's tensor-parallel size, from /server_info (SGLang lists its server
        arguments there): each TP rank joins a weight-update group as rank_offset + tp_rank.
        An answer without it is an error, not a guess: a wrong size collides the ranks."""
        info = self._post("/server_info", None)
        size = info.get("tp_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EngineControlError(f"GET {self.url}/server_info: tp_size {size!r} is not a "
                                     "positive integer (rlkit places the engine's TP ranks in the "
                                     "weight-update group by it)")
        return size

    def gpu_ids(self) -> list[str]:
        """The UUIDs of the engine's GPUs, from /server_info (the built-in engine's `gpu_uuids`);
        [] when it does not say (SGLang, or a CPU engine)."""
        return [str(u) for u in self._post("/server_info", None).get("gpu_uuids") or []]

    def pause(self, mode: str) -> None:
        self._post("/pause_generation", {"mode": mode})

    def flush_cache(self) -> None:
        self._post("/flush_cache", {})

    def continue_generation(self) -> None:
        self._post("/continue_generation", {})

    def update_from_disk(self, model_path: str, version: int, *, flush_cache: bool = True) -> None:
        self._post(
            "/update_weights_from_disk",
            {
                "model_path": model_path,
                "weight_version": str(version),
                "abort_all_requests": False,
                "flush_cache": flush_cache,
            },
        )

    def init_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str,
    ) -> None:
        self._post(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def begin_update(self) -> None:
        self._post("/begin_weight_update", {})

    def update_from_distributed(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
        group_name: str, version: int,
    ) -> None:
        self._post(
            "/update_weights_from_distributed",
            {
                "names": list(names),
                "dtypes": list(dtypes),
                "shapes": [list(s) for s in shapes],
                "group_name": group_name,
                "flush_cache": False,
                "abort_all_requests": False,
                "weight_version": str(version),
            },
        )

    def end_update(self) -> None:
        self._post("/end_weight_update", {})

    def update_from_tensor(self, body: dict[str, Any]) -> None:
        """Weights in memory: SGLang's /update_weights_from_tensor, the body made by
        train/weight_sync/in_memory.py (handles to the trainer's shared or CUDA memory)."""
        self._post("/update_weights_from_tensor", body)

    # LoRA adapters (SGLang's endpoints; the built-in engine serves the same)
    def load_lora_from_tensors(self, body: dict[str, Any]) -> None:
        """`{"lora_name", "config_dict", "serialized_named_tensors", "load_format"}`."""
        self._post("/load_lora_adapter_from_tensors", body)

    def load_lora(self, name: str, path: str) -> None:
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    def unload_lora(self, name: str) -> bool:
        """Unload adapter `name`: True, or False when the engine does not hold it (restarted
        since it was loaded). A refusal (a request still names it) raises."""
        try:
            self._post("/unload_lora_adapter", {"lora_name": name})
        except EngineControlError as e:
            if any(words in str(e) for words in UNKNOWN_ADAPTER):
                return False
            raise
        return True

    def destroy_group(self, group_name: str) -> None:
        self._post("/destroy_weights_update_group", {"group_name": group_name})

    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Sleep: SGLang's `/release_memory_occupation {"tags"}`; tags among "kv_cache",
        "weights", "cuda_graph", None = all. SGLang requires the engine idle (nothing running;
        queued requests only while paused): pause first. Released weights must be loaded again
        by a weight update after `resume_memory(["weights"])` (SGLang keeps no copy unless
        started with --enable-weights-cpu-backup). Returns the engine's answer: the built-in
        engine reports `freed_bytes` per tag; SGLang answers with no body ({})."""
        return self._memory_call("/release_memory_occupation", tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Wake: SGLang's `/resume_memory_occupation {"tags"}` (None = all). Staged, as verl
        does, to keep the peak low: resume_memory(["weights"]), the weight update, then
        resume_memory(["kv_cache"]) (and "cuda_graph" if it was released). Returns the
        engine's answer (the built-in engine's `resumed_bytes` per tag; {} from SGLang)."""
        return self._memory_call("/resume_memory_occupation", tags)

    def _memory_call(self, path: str, tags: Sequence[str] | None) -> dict[str, Any]:
        answer = self._post(path, {"tags": list(tags) if tags is not None else None})
        return {} if answer == {"answer": None} else answer  # SGLang's body is `null`

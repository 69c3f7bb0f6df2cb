"""Continuous-batching decoder over a transformers causal LM, run in its own thread.

Requests join and leave the batch between decode steps:
- each loop iteration first runs control commands (weight loads, pause, flush) and aborts, then
  admits queued requests (one left-padded prefill forward for all of them, bounded by a prefill
  token budget), then runs ONE decode step for every running request;
- a request that finishes (stop token, length) or is aborted leaves the batch at once and its
  KV rows are reused by the next admission;
- the KV cache is `SlotKVCache`: preallocated, left-padded, grown to what the rows need.

The HTTP side talks to this only through the thread-safe methods `submit`, `abort`, `pause`,
`resume`, `flush`, `call` and `loads`; the decoder reports progress once per loop iteration by
calling `on_progress` from its thread with every request that got tokens or finished.

Pause modes follow SGLang: `abort` aborts everything then holds new requests; `retract` moves
running requests back to the queue (their KV is dropped and recomputed on continue, the
generated tokens are kept); `in_place` freezes decoding with the KV intact.

Memory occupation (SGLang's release/resume_memory_occupation, tags `kv_cache`, `weights`,
`cuda_graph`): `release_memory(tags)` frees the KV cache's buffers and/or the model's parameter
storage, only while idle (nothing running; queued requests only while paused), as SGLang
requires; `resume_memory(tags)` allocates them again. Re-allocated weights hold zeros (SGLang:
undefined) unless `weights_cpu_backup` (SGLang's --enable-weights-cpu-backup) kept a host copy:
they must be loaded again by a weight update. While asleep (weights or kv_cache released, or
weights re-allocated and not yet loaded in full) requests wait in the queue and none is
admitted; they start once the engine is awake again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import random
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlkit.common.memory import release_free_memory
from rlkit.rollout.engines.builtin.kv_cache import SlotKVCache, prefill_mask
from rlkit.rollout.engines.builtin.requests import DecodeParams, DecodeRequest  # noqa: F401 - DecodeParams re-exported
from rlkit.rollout.engines.builtin.sampler import RowSampling, sample
from rlkit.rollout.http.protocol import FinishReason, PauseMode

log = logging.getLogger(__name__)


@dataclass
class DecodeStepStats:
    """Per batch size: decode steps run, their total wall time, and the most recent step times
    (their median resists the spikes other processes cause on a shared machine). This is what
    the PTL(BS) profile is made of."""

    steps: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    seconds: dict[int, float] = field(default_factory=lambda: collections.defaultdict(float))
    context_tokens: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    recent: dict[int, collections.deque] = field(
        default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=1024)))
    prefill_forwards: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0

    def record(self, batch: int, seconds: float, context: int) -> None:
        self.steps[batch] += 1
        self.seconds[batch] += seconds
        self.context_tokens[batch] += context
        self.recent[batch].append(seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "decode": [
                {"batch_size": b, "steps": self.steps[b], "seconds": self.seconds[b],
                 "median_seconds": statistics.median(self.recent[b]),
                 "mean_context_tokens": self.context_tokens[b] / self.steps[b]}
                for b in sorted(self.steps)
            ],
            "prefill": {"forwards": self.prefill_forwards, "tokens": self.prefill_tokens,
                        "seconds": self.prefill_seconds},
        }


class DecoderError(RuntimeError):
    """The decoder cannot accept a request or a command."""


# SGLang's memory tags (sglang/srt/constants.py GPU_MEMORY_TYPE_*), in its release order.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
# What decoding needs resident: with either released the engine is asleep. (The built-in engine
# captures no CUDA graph, so "cuda_graph" is accepted and tracked but holds no memory.)
_NEEDED_TAGS = frozenset({"kv_cache", "weights"})
# SGLang's assertion message when a release meets a busy scheduler (weight_updater.py).
NOT_IDLE_MESSAGE = "release_memory_occupation should be called only when server is idle."


def _scores_input(r: DecodeRequest) -> bool:
    """Whether this prefill scores the request's input (once: a retracted request's
    re-prefill keeps what its first prefill reported)."""
    return r.logprob_start_len >= 0 and r.input_logprobs is None


def memory_tags(tags: list[str] | tuple[str, ...] | None) -> list[str]:
    """SGLang's reading of a request's `tags`: None or empty means all of them. Unknown tags are
    refused (ValueError; SGLang silently records them)."""
    if not tags:
        return list(MEMORY_TAGS)
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)} "
                         "(null or [] = all)")
    return [t for t in MEMORY_TAGS if t in tags]


def _trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc keeps it otherwise: a tensor under its
    dynamic mmap threshold lives on the heap), so a CPU engine's release shows in its RSS."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: its longest ModuleList (`model.layers` of the Llama and
    Qwen families); none if it has no ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _rss_bytes() -> int | None:
    """Resident set size of this process (Linux), for the CPU side of a memory report."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class BatchedDecoder:
    """See the module docstring. `start()` launches the thread; `stop()` ends it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: set[int],
        detokenize: Callable[[list[int]], str] | None = None,
        max_running_requests: int = 64,
        max_total_tokens: int | None = None,
        max_prefill_tokens: int = 8192,
        context_length: int | None = None,
        seed: int = 0,
        weight_version: str = "0",
        on_progress: Callable[[list[DecodeRequest]], None] | None = None,
        weights_cpu_backup: bool = False,
    ) -> None:
        self.model = model
        # Called on the decoder thread once per loop iteration with every request that got
        # tokens or finished (one IPC message per step instead of one wake-up per request).
        self.on_progress = on_progress
        self._progressed: list[DecodeRequest] = []
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.max_running_requests = max_running_requests
        self.max_total_tokens = max_total_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length or int(
            getattr(self.config, "max_position_embeddings", 2048)
        )
        self.weight_version = weight_version
        self._seeds = random.Random(seed)
        self._layer_types = sorted(set(getattr(self.config, "layer_types", None) or ["full_attention"]))
        if self._layer_types != ["full_attention"]:
            raise DecoderError(
                f"model {type(model).__name__} has {self._layer_types} layers; the hf engine "
                "supports full-attention models only"
            )
        text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = text_config.num_attention_heads
        self._kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        self._head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        self._num_layers = text_config.num_hidden_layers
        self.cache = self._new_cache()

        self._lock = threading.Lock()  # guards the queues and flags below
        self._wake = threading.Event()
        self._waiting: collections.deque[DecodeRequest] = collections.deque()
        self._running: list[DecodeRequest] = []  # row i of the cache <-> _running[i]
        self._pending_tokens: list[int] = []  # per row: sampled, not yet in the KV cache
        self._admitting: list[DecodeRequest] = []  # between the queue and the batch
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._pause_mode: PauseMode | None = None
        # Memory occupation (see the module docstring): the released tags; the parameters whose
        # storage was freed, with their shapes; those re-allocated and not loaded since (by
        # id); host copies kept when weights_cpu_backup.
        self.weights_cpu_backup = weights_cpu_backup
        self.released: set[str] = set()
        self._freed_params: list[tuple[torch.nn.Parameter, torch.Size]] = []
        self._stale_params: set[int] = set()
        self._weight_backup: dict[int, torch.Tensor] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self.crashed: str | None = None
        self.stats = DecodeStepStats()
        # Progress, as SGLang 0.5.23's load snapshot reports it (`loads`): the wall time the
        # decoder last moved (a loop turn, or a decoder layer of a forward done: one prefill
        # forward of a CPU engine can take tens of seconds, SGLang's are chunked; a stopped or
        # stuck decoder leaves it) and the prompt tokens prefilled so far (never reset, unlike
        # `stats`).
        self.moved_at = time.time()
        self._trimmed = True  # free heap pages handed back since the decoder last worked
        self.prefilled_tokens = 0
        self._layer_hooks = [layer.register_forward_hook(self._layer_done)
                             for layer in _decoder_layers(model)]
        # LoRA adapters (lora_adapters.AdapterSet), set by the engine core; each forward binds
        # its rows' adapters first
        self.adapters: Any = None

    def lora_in_use(self, name: str) -> int:
        """Requests running, being admitted or queued that name LoRA adapter `name` (decoder
        thread, or under call())."""
        with self._lock:
            queued = sum(r.lora == name for r in self._waiting)
        return queued + sum(r.lora == name for r in (*self._running, *self._admitting))

    def reset_stats(self) -> dict[str, Any]:
        """The statistics so far; counting starts again (runs between two steps)."""
        old, self.stats = self.stats, DecodeStepStats()
        return old.as_dict()

    # -- thread-safe API ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hf-decoder", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for hook in self._layer_hooks:  # the model may outlive this decoder (tests share one)
            hook.remove()
        self._layer_hooks = []

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.crashed is None

    def submit(self, request: DecodeRequest) -> None:
        if not self.alive:
            raise DecoderError(f"the decoder is not running ({self.crashed or 'stopped'})")
        with self._lock:
            self._waiting.append(request)
        self._wake.set()

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort one request (by rid) or all; takes effect before the next decode step."""
        with self._lock:
            if abort_all:
                self._abort_all = True
            elif rid:
                self._abort_rids.add(rid)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the decoder thread between two steps (weight loads, state changes)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(DecoderError(f"the decoder is not running ({self.crashed or 'stopped'})"))
            return future
        with self._lock:
            self._commands.append((fn, future))
        self._wake.set()
        return future

    def pause(self, mode: PauseMode) -> concurrent.futures.Future:
        return self.call(lambda: self._pause(mode))

    def resume(self) -> concurrent.futures.Future:
        return self.call(self._resume)

    def flush(self) -> concurrent.futures.Future:
        """Free the KV memory; fails (result False) while any request holds KV, like SGLang."""
        return self.call(self._flush)

    def set_weight_version(self, version: str) -> concurrent.futures.Future:
        return self.call(lambda: setattr(self, "weight_version", version))

    def release_memory(self, tags: list[str] | None) -> concurrent.futures.Future:
        """Free the memory of `tags` (None: all) between two steps; the future's result is the
        report (`freed_bytes` per tag, memory figures before and after). Refused (ValueError)
        unless idle: nothing running, and nothing queued unless generation is paused."""
        tags = memory_tags(tags)
        return self.call(lambda: self._release_memory(tags))

    def resume_memory(self, tags: list[str] | None) -> concurrent.futures.Future:
        """Allocate the memory of `tags` (None: all) again; result: `resumed_bytes` per tag and
        the memory figures. A tag that is not released is left as it is (0 bytes)."""
        tags = memory_tags(tags)
        return self.call(lambda: self._resume_memory(tags))

    def check_weights_resident(self) -> None:
        """Raise ValueError if the weights are released (a weight update cannot land)."""
        if "weights" in self.released:
            raise ValueError("the weights are released (/release_memory_occupation): resume them "
                             'with /resume_memory_occupation {"tags": ["weights"]} before a '
                             "weight update")

    def weights_loaded(self, names: Any) -> None:
        """A weight update wrote these parameters (HF names): they are no longer stale."""
        if not self._stale_params:
            return
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for name in names:
            p = params.get(name)
            if p is not None:
                self._stale_params.discard(id(p))

    @property
    def asleep(self) -> bool:
        """No request is admitted: weights or KV cache released, or weights not loaded since
        they were re-allocated."""
        return bool(self.released & _NEEDED_TAGS) or bool(self._stale_params)

    def memory_state(self) -> dict[str, Any]:
        """What is released and what is resident now (read from any thread)."""
        params = self._unique_params()
        return {
            "released": [t for t in MEMORY_TAGS if t in self.released],
            "asleep": self.asleep,
            "weights_stale": bool(self._stale_params),
            "stale_parameters": len(self._stale_params),
            "weights_bytes": sum(p.numel() * p.element_size() for p in params),
            "kv_cache_bytes": self.cache.nbytes,
            "weights_cpu_backup": self.weights_cpu_backup,
        }

    def loads(self) -> dict[str, Any]:
        running = list(self._running)
        with self._lock:
            waiting = len(self._waiting)
        used = sum(self.cache.lengths)
        cap = self.max_total_tokens
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "max_total_num_tokens": cap,
            "token_usage": (used / cap) if cap else 0.0,
            "max_running_requests": self.max_running_requests,
            "paused": self._pause_mode,
            # SGLang 0.5.23's LoadSnapshot fields: when the scheduler last reported (here: when
            # the decoder last moved), and its cumulative prefill tokens
            # (rollout.http.protocol.progress_mark reads the first)
            "timestamp": self.moved_at,
            "total_prefill_uncached_tokens": self.prefilled_tokens,
        }

    def _layer_done(self, *_: Any) -> None:
        """Forward hook of each decoder layer (decoder thread): the decoder moved."""
        self.moved_at = time.time()

    # -- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop:
                self.moved_at = time.time()
                self._run_commands()
                with torch.inference_mode():  # dropping a middle row moves KV rows in place
                    self._apply_aborts()
                self._report_progress()
                if (self._pause_mode is not None or self.asleep
                        or (not self._running and not self._waiting)):
                    if not self._trimmed:  # once idle: the rollout's KV growth and prefill logits
                        self._shrink_idle()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._trimmed = False
                with torch.inference_mode():
                    self._admit()
                    if self._running:
                        self._decode_step()
                self._report_progress()
        except BaseException as e:  # a bug or OOM: fail every request loudly, stop serving
            self.crashed = f"{type(e).__name__}: {e}"
            log.error("hf decoder crashed:\n%s", traceback.format_exc())
            self._fail_everything(f"engine crashed: {self.crashed}")
            self._report_progress()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:
                future.set_exception(e)

    def _apply_aborts(self) -> None:
        with self._lock:
            abort_all, rids = self._abort_all, self._abort_rids
            self._abort_all, self._abort_rids = False, set()
            if not abort_all and not rids:
                return
            queued = [r for r in self._waiting if abort_all or r.rid in rids]
            for r in queued:
                self._waiting.remove(r)
        for r in queued:
            self._finish(r, FinishReason.abort("Abort before prefill" if not r.output_ids else "Aborted"))
        leaving = [i for i, r in enumerate(self._running) if abort_all or r.rid in rids]
        for i in leaving:
            self._finish(self._running[i], FinishReason.abort("Aborted"))
        self._drop_rows(leaving)

    # -- admission and prefill -----------------------------------------------------------------
    def _reserved_tokens(self, r: DecodeRequest) -> int:
        return len(r.input_ids) + r.params.max_new_tokens

    def _admit(self) -> None:
        """Move queued requests into the batch while there are free slots, the padded prefill
        (rows x longest context) stays within max_prefill_tokens (at least one request is always
        admitted) and, if set, the reserved tokens (prompt + max_new_tokens) fit max_total_tokens."""
        admitted: list[DecodeRequest] = []
        with self._lock:
            if not self._waiting:  # the common case, once per decode step
                return
            reserved = (sum(self._reserved_tokens(r) for r in self._running)
                        if self.max_total_tokens else 0)
            width = 0
            while self._waiting and len(self._running) + len(admitted) < self.max_running_requests:
                r = self._waiting[0]
                n = len(r.input_ids) + len(r.output_ids)
                if admitted and (len(admitted) + 1) * max(width, n) > self.max_prefill_tokens:
                    break
                if self.max_total_tokens and (self._running or admitted) and (
                    reserved + self._reserved_tokens(r) > self.max_total_tokens
                ):
                    break
                self._waiting.popleft()
                if r.lora is not None and (self.adapters is None or r.lora not in self.adapters.adapters):
                    # unloaded between the HTTP side's check and now: answered, never run
                    self._finish(r, FinishReason.abort(
                        f"LoRA adapter {r.lora!r} is not loaded", status_code=400))
                    continue
                admitted.append(r)
                reserved += self._reserved_tokens(r)
                width = max(width, n)
        if admitted:
            self._admitting = admitted  # so a crash in prefill still fails them
            self._prefill(admitted)
            self._admitting = []

    def _prefill(self, requests: list[DecodeRequest]) -> None:
        """One left-padded forward over the new requests' full contexts (prompt plus any tokens
        kept from a retraction); sample each one's next token; move their KV into the batch."""
        t0 = time.perf_counter()
        contexts = [r.input_ids + r.output_ids for r in requests]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        ids = torch.zeros(len(requests), width, dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, width - len(c):] = torch.tensor(c, dtype=torch.long)
        positions = (torch.arange(width)[None, :] - (width - torch.tensor(lengths))[:, None]).clamp_(min=0)
        scratch = self._new_cache(slots=len(requests), capacity=width)
        scratch.lengths = [0] * len(requests)
        mask = prefill_mask(lengths, width, self.device)
        scored = [i for i, r in enumerate(requests) if _scores_input(r)]
        # the last position samples; a request scoring its input needs the positions from its
        # logprob_start_len on (each predicts the next input token)
        keep = max([1] + [lengths[i] - requests[i].logprob_start_len for i in scored])
        if self.adapters is not None:
            self.adapters.bind([r.lora for r in requests])
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=mask,  # 4D: transformers uses it as is
            past_key_values=scratch,
            use_cache=True,
            logits_to_keep=keep,
        )
        for i in scored:
            requests[i].input_logprobs = self._input_logprobs(requests[i], out.logits[i], keep)
        scratch.advance(width)
        self.cache.add_rows(scratch, lengths)
        for r in requests:
            if r._rng is None:
                r._rng = random.Random(r.params.seed if r.params.seed is not None else self._seeds.getrandbits(63))
        self._running.extend(requests)
        self._pending_tokens.extend([0] * len(requests))
        self.stats.prefill_forwards += 1
        self.stats.prefill_tokens += sum(lengths)
        self.prefilled_tokens += sum(lengths)
        self.stats.prefill_seconds += time.perf_counter() - t0
        first = len(self._running) - len(requests)
        self._emit(out.logits[:, -1, :], rows=list(range(first, len(self._running))))

    def _input_logprobs(self, r: DecodeRequest, logits: torch.Tensor,
                        keep: int) -> list[float | None]:
        """SGLang's input_token_logprobs for logprob_start_len k: the logprob of each input
        token after position k (tokens k+1 .. n-1), with a None first when k = 0, scaled by the
        request's temperature as the sampled tokens' logprobs are (the ratio against a recorded
        rollout logprob compares like with like). `logits`: the row's last `keep` positions."""
        n, k = len(r.input_ids), r.logprob_start_len
        first = keep - n + k  # index of position k in the kept slice (the row ends the slice)
        targets = torch.tensor(r.input_ids[k + 1:], dtype=torch.long, device=logits.device)
        greedy = RowSampling(temperature=r.params.temperature, top_k=r.params.top_k).greedy
        temperature = 1.0 if greedy else r.params.temperature
        values: list[float | None] = [None] if k == 0 else []
        chunk = 512  # positions per log_softmax: bounds the float32 copy of [positions, vocab]
        for start in range(0, targets.numel(), chunk):
            rows = logits[first + start:first + start + min(chunk, targets.numel() - start)]
            lp = torch.log_softmax(rows.float() / temperature, dim=-1)
            values.extend(lp.gather(-1, targets[start:start + rows.shape[0], None])[:, 0].tolist())
        return values

    # -- decoding ------------------------------------------------------------------------------
    def _decode_step(self) -> None:
        t0 = time.perf_counter()
        b = len(self._running)
        context = sum(self.cache.lengths)
        self.cache.reserve(b, 1)
        ids = torch.tensor(self._pending_tokens, dtype=torch.long, device=self.device)[:, None]
        positions = torch.tensor(self.cache.lengths, dtype=torch.long, device=self.device)[:, None]
        mask = self.cache.decode_mask()
        if self.adapters is not None:
            self.adapters.bind([r.lora for r in self._running])
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,  # 4D: transformers uses it as is
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache.advance(1)
        self._emit(out.logits[:, -1, :], rows=list(range(b)))
        self.stats.record(b, time.perf_counter() - t0, context)

    def _emit(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Sample a token for each of `rows` (logits row i belongs to rows[i]); record it on
        its request; finish and drop the rows that are done."""
        requests = [self._running[i] for i in rows]
        tokens, logprobs = sample(logits, [self._row_sampling(r) for r in requests])
        now = time.monotonic()
        done: list[int] = []
        for row, r, tok, lp in zip(rows, requests, tokens, logprobs):
            r.output_ids.append(tok)
            r.output_logprobs.append(lp)
            r.output_versions.append(self.weight_version)
            r.weight_version = self.weight_version
            if r.first_token_at is None:
                r.first_token_at = now
            self._pending_tokens[row] = tok
            reason = self._finish_reason(r, tok)
            if reason is not None:
                self._finish(r, reason)
                done.append(row)
            else:
                self._progressed.append(r)
        self._drop_rows(done)

    def _row_sampling(self, r: DecodeRequest) -> RowSampling:
        p = r.params
        banned: tuple[int, ...] = ()
        if len(r.output_ids) < p.min_new_tokens:
            banned = tuple(self.eos_token_ids | p.stop_token_ids)
        assert r._rng is not None
        return RowSampling(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                           min_p=p.min_p, rng=r._rng, banned=banned)

    def _finish_reason(self, r: DecodeRequest, token: int) -> FinishReason | None:
        """SGLang's order: length first; then (unless ignore_eos) EOS / stop tokens; then stop
        strings. ignore_eos also ignores stop_token_ids, as in SGLang."""
        p = r.params
        n = len(r.output_ids)
        if n >= p.max_new_tokens:
            return FinishReason.of_length(p.max_new_tokens)
        if len(r.input_ids) + n >= self.context_length:
            return FinishReason.of_length(n)
        if not p.ignore_eos and n >= p.min_new_tokens and (
            token in self.eos_token_ids or token in p.stop_token_ids
        ):
            return FinishReason.stop(token)
        if p.stop_strings and self.detokenize is not None and n >= p.min_new_tokens:
            tail = self.detokenize(r.output_ids[-64:])
            for s in p.stop_strings:
                if s in tail:
                    return FinishReason.stop(s)
        return None

    # -- bookkeeping ---------------------------------------------------------------------------
    def _finish(self, r: DecodeRequest, reason: FinishReason) -> None:
        if not r.output_ids:
            r.weight_version = self.weight_version
        r.finished_at = time.monotonic()
        r.finish_reason = reason
        self._progressed.append(r)

    def _report_progress(self) -> None:
        if self._progressed:
            progressed, self._progressed = self._progressed, []
            if self.on_progress is not None:
                self.on_progress(progressed)

    def _drop_rows(self, rows: list[int]) -> None:
        if not rows:
            return
        for old, new in self.cache.remove_rows(rows):
            self._running[new] = self._running[old]
            self._pending_tokens[new] = self._pending_tokens[old]
        keep = len(self.cache.lengths)
        del self._running[keep:]
        del self._pending_tokens[keep:]
        if not self._running:
            self.cache.clear()

    def _fail_everything(self, message: str) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
            commands = list(self._commands)
            self._commands.clear()
        for r in [*self._running, *self._admitting, *waiting]:
            if not r.finished:
                self._finish(r, FinishReason.abort(message, status_code=500))
        self._running.clear()
        self._pending_tokens.clear()
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(DecoderError(message))

    def _shrink_idle(self) -> None:
        """Nothing is generating: the KV cache goes back to its first size when no row is cached
        and the heap's free pages to the system (rlkit/common/memory.py). In sync mode on one
        machine the trainer trains now, and its peak adds to what the engines hold; the next
        rollout grows the cache again, as from start-up."""
        if not self._running and not self.cache.released and not self.cache.lengths:
            self.cache = self._new_cache()
        release_free_memory()
        self._trimmed = True

    def _new_cache(self, **shape: int) -> SlotKVCache:
        """A cache of `shape` (slots, capacity); none given: SlotKVCache's first, small size,
        which it grows from (start-up, and back to it when idle or released)."""
        return SlotKVCache(num_layers=self._num_layers, kv_heads=self._kv_heads,
                           head_dim=self._head_dim, dtype=self.dtype, device=self.device, **shape)

    # -- commands (run on the decoder thread) ------------------------------------------------
    def _pause(self, mode: PauseMode) -> int:
        """Returns how many requests were affected."""
        if mode == "abort":
            with self._lock:
                n = len(self._waiting) + len(self._running)
            self._abort_all = True
            self._apply_aborts()
        elif mode == "retract":
            n = len(self._running)
            retracted = list(self._running)
            self._running.clear()
            self._pending_tokens.clear()
            self.cache.clear()
            for r in retracted:
                r.retractions += 1
            with self._lock:
                self._waiting.extendleft(reversed(retracted))
        else:
            n = len(self._running)
        self._pause_mode = mode
        return n

    def _resume(self) -> None:
        self._pause_mode = None

    def _flush(self) -> bool:
        if self._running:
            return False
        if self.cache.released:  # nothing to free, and nothing may be allocated while released
            return True
        self.cache = self._new_cache()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    # -- memory occupation (run on the decoder thread) ----------------------------------------
    def _unique_params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())  # tied weights are one Parameter: counted once

    def _memory_figures(self) -> dict[str, int]:
        figures: dict[str, int] = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            figures["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
            figures["cuda_reserved"] = torch.cuda.memory_reserved(self.device)
        rss = _rss_bytes()
        if rss is not None:
            figures["rss"] = rss
        return figures

    def _busy(self) -> str | None:
        with self._lock:
            waiting = len(self._waiting)
        if self._running or self._admitting:
            return f"{len(self._running) + len(self._admitting)} requests running" + (
                f" (paused {self._pause_mode}: their KV is held)" if self._pause_mode else "")
        if waiting and self._pause_mode is None:
            return f"{waiting} requests waiting and generation is not paused"
        return None

    def _release_memory(self, tags: list[str]) -> dict[str, Any]:
        busy = self._busy()
        if busy is not None:
            raise ValueError(f"{NOT_IDLE_MESSAGE} ({busy})")
        before = self._memory_figures()
        freed: dict[str, int] = {}
        for tag in tags:
            if tag in self.released:
                freed[tag] = 0
            elif tag == "kv_cache":
                self.cache.clear()
                freed[tag] = self.cache.release()
            elif tag == "weights":
                freed[tag] = self._release_weights()
            else:  # cuda_graph: none captured
                freed[tag] = 0
            self.released.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the freed blocks back to the driver (the trainer)
        else:
            _trim_heap()
        return {"freed_bytes": freed, "before": before, "after": self._memory_figures()}

    def _release_weights(self) -> int:
        freed, seen = 0, set()
        self._freed_params = []
        for p in self._unique_params():
            storage = p.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                freed += storage.nbytes()
            if self.weights_cpu_backup:
                self._weight_backup[id(p)] = p.detach().to("cpu", copy=True)
            self._freed_params.append((p, p.shape))
            # Drop the parameter's storage (it may be a read-only file mapping, which cannot be
            # resized): the Parameter object stays, so tied names and module references hold.
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._stale_params.clear()
        return freed

    def _resume_memory(self, tags: list[str]) -> dict[str, Any]:
        before = self._memory_figures()
        resumed: dict[str, int] = {}
        for tag in reversed(tags):  # SGLang's resume order: cuda_graph, weights, kv_cache
            if tag not in self.released:
                resumed[tag] = 0
                continue
            if tag == "kv_cache":
                resumed[tag] = self.cache.resume()
            elif tag == "weights":
                resumed[tag] = self._resume_weights()
            else:
                resumed[tag] = 0
            self.released.discard(tag)
        return {"resumed_bytes": {t: resumed[t] for t in tags}, "before": before,
                "after": self._memory_figures()}

    def _resume_weights(self) -> int:
        total = 0
        with torch.no_grad():
            for p, shape in self._freed_params:
                backup = self._weight_backup.pop(id(p), None)
                if backup is not None:
                    p.data = backup.to(self.device)  # on a CPU engine: the copy itself
                else:
                    p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
                    self._stale_params.add(id(p))
                total += p.numel() * p.element_size()
        self._freed_params = []
        return total

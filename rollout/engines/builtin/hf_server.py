"""rlkit's built-in engine server: SGLang's HTTP protocol over a transformers model.

    python -m rlkit.rollout.engines.builtin.hf_server --model PATH [--port 0 --port-file F] [--threads N] ...

It serves the SGLang endpoints rlkit uses (docs/engines.md has the table) so that it sits behind
the real sglang-router and talks to the same client as real SGLang servers. Two processes, like
SGLang: this one is only the HTTP layer (validation with `rollout.http.protocol`, tokenizing text
prompts, streaming, turning control calls into commands); the engine core process
(engine_core.py) owns the model and runs the continuous-batching decoder, so neither steals
the other's core. Every answer carries `weight_version`. A bad request gets a 4xx JSON error
in SGLang's shape; an unexpected error gets a 500; neither stops the server. With a control
token ($RLKIT_CONTROL_TOKEN, read at start) every endpoint but the probes (/health*) needs
`Authorization: Bearer <token>`, as SGLang with rlkit's keys; bound beyond loopback, the server
refuses to start without one (rollout.http.auth). No answer carries the token.

Sleep and wake are SGLang's `/release_memory_occupation` and `/resume_memory_occupation`
(body `{"tags": [...]}`, null or [] = all of kv_cache, weights, cuda_graph): see
`EngineServer.release_memory_occupation` and docs/engines.md, "Sleep and wake".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from rlkit.rollout.http.auth import (CONTROL_PATHS, CONTROL_TOKEN_ENV, ControlTokenMissing, check_authorization,
                          check_bind, control_token_from_env, needs_token)
from rlkit.rollout.engines.builtin.requests import DecodeParams
from rlkit.rollout.engines.builtin.core_client import CoreDied, CoreError, CoreRefused, EngineCoreClient, RemoteRequest
from rlkit.rollout.engines.builtin.detokenizer import IncrementalDetokenizer, load_tokenizer
from rlkit.rollout.engines.builtin.engine_core import CoreConfig
from rlkit.rollout.engines.builtin.fault import EngineFault
from rlkit.rollout.http.protocol import (
    ENGINE_URL_HEADER,
    AbortRequest,
    FinishReason,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    LoadLoraAdapterFromTensorsRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    dumps,
    error_body,
    version_spans,
)

log = logging.getLogger("rlkit.hf_server")
ENGINE_NAME = "rlkit-hf"
ENGINE_VERSION = "0.1.0"


class RequestError(Exception):
    """A client error: answered with `status` and a JSON message."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> web.Response:
    return web.json_response(error_body(message, status), status=status)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "invalid request: " + "; ".join(parts)


@web.middleware
async def _errors_middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as e:
        return _error(str(e), e.status)
    except ValidationError as e:
        return _error(_validation_message(e), 400)
    except CoreDied as e:
        return _error(str(e), 503)
    except CoreRefused as e:
        return _error(f"{request.path}: {e}", 400)
    except (web.HTTPException, asyncio.CancelledError):
        raise
    except Exception as e:  # keep serving; say what failed
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(f"internal error on {request.path}: {type(e).__name__}: {e}", 500)


def _auth_middleware(token: str | None) -> Any:
    """With a control token, every path but the probes (rollout.http.auth.needs_token) answers 401
    without `Authorization: Bearer <token>` and 403 with another token: SGLang's rule with its
    API and admin keys both set to the token, so the router and rlkit's clients meet one rule."""

    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if token is not None and needs_token(request.path):
            status = check_authorization(request.headers.get("Authorization"), token)
            if status is not None:
                what = "missing" if status == 401 else "wrong"
                kind = "a control endpoint" if request.path in CONTROL_PATHS else "guarded"
                return _error(f"{request.path} is {kind}: {what} control token "
                              f"(send Authorization: Bearer ${CONTROL_TOKEN_ENV})", status)
        return await handler(request)

    return auth


class _IgnoreHttp2Probes(logging.Filter):
    """sglang-router probes workers with HTTP/2 prior knowledge first; aiohttp logs each probe
    as an error ('Pause on PRI/Upgrade') before the router falls back to HTTP/1.1."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


class EngineServer:
    """The HTTP layer: builds the aiohttp app over an EngineCoreClient."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model_path = args.model
        self.tokenizer_path = args.tokenizer or args.model
        self.served_model_name = args.served_model_name or args.model
        self.tokenizer: Any = None  # loaded while the core loads the model (see _serve)
        self.core = EngineCoreClient(CoreConfig(
            model_path=args.model, tokenizer_path=self.tokenizer_path, device=args.device,
            dtype=args.dtype, threads=args.threads,
            max_running_requests=args.max_running_requests,
            max_total_tokens=args.max_total_tokens, max_prefill_tokens=args.max_prefill_tokens,
            context_length=args.context_length, seed=args.random_seed,
            weight_version=args.weight_version,
            weight_group_timeout_s=args.weight_group_timeout_s,
            stream_interval=args.stream_interval, log_level=args.log_level,
            weights_cpu_backup=args.enable_weights_cpu_backup,
            max_loaded_loras=args.max_loaded_loras,
        ))
        self.weight_version = args.weight_version  # mirrors the core's (set only through it)
        self.loras: dict[str, str] = {}  # loaded LoRA adapters: name -> path ('__tensor__')
        self.update_session_open = False
        self.control_token = control_token_from_env()  # read once, at start (rollout.http.auth)
        self.public_url = ""  # set once bound; sent as X-Engine-Url so clients behind the
        # router can tell which worker served them (the router passes worker headers through)
        # Test-only ($RLKIT_TEST_ENGINE_FAULT, fault.py): None unless a test set it.
        self.fault = EngineFault.from_env()

    @property
    def vocab_size(self) -> int:
        return int(self.core.info["vocab_size"])

    @property
    def context_length(self) -> int:
        return int(self.core.info["context_length"])

    def app(self) -> web.Application:
        faults = [self.fault.middleware()] if self.fault is not None and self.fault.at else []
        app = web.Application(middlewares=[*faults, _auth_middleware(self.control_token), _errors_middleware],
                              client_max_size=1 << 30)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/models", self.models)
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/abort_request", self.abort_request)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/get_load", self.loads)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_post("/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        r.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        for method in ("GET", "POST"):  # SGLang serves both
            r.add_route(method, "/release_memory_occupation", self.release_memory_occupation)
            r.add_route(method, "/resume_memory_occupation", self.resume_memory_occupation)
        r.add_get("/rlkit/decode_stats", self.decode_stats)
        return app

    # -- helpers ----------------------------------------------------------------------------------
    async def _body(self, request: web.Request, *, optional: bool = False) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            if optional:
                return {}
            raise RequestError(f"{request.path}: empty body, a JSON object is expected")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RequestError(f"{request.path}: body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError(f"{request.path}: body must be a JSON object, got {type(body).__name__}")
        return body

    def _result(self, success: bool, message: str, **extra: Any) -> web.Response:
        return web.json_response({"success": success, "message": message, **extra},
                                 status=200 if success else 400)

    async def _set_version(self, version: str | None) -> None:
        if version is not None:
            self.weight_version = version

    # -- info ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine core lives, asleep or not (a sleeping engine is not a dead one:
        the router and rlkit's health checks must not drop or restart it)."""
        if not self.core.alive:
            return _error(f"engine core not running: {self.core.crashed or 'stopped'}", 503)
        return web.Response(text="OK")

    async def health_generate(self, request: web.Request) -> web.Response:
        """As /health, but 503 while asleep: the engine cannot generate a token then (SGLang's
        one-token health request would wait behind the released memory and time out)."""
        if not self.core.alive:
            return _error(f"engine core not running: {self.core.crashed or 'stopped'}", 503)
        state = await self.core.call("memory")
        if state["asleep"]:
            return _error(f"asleep, cannot generate: {_sleep_reason(state)}", 503)
        return web.Response(text="OK")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "engine": ENGINE_NAME,
            "version": ENGINE_VERSION,
            "weight_version": self.weight_version,
            **{k: v for k, v in self.core.info.items() if k != "eos_token_ids"},
            "max_total_num_tokens": self.core.info.get("max_total_tokens"),
            "stream_interval": self.args.stream_interval,
            "incremental_streaming_output": self.args.incremental_streaming_output,
            "threads": self.args.threads,
            "random_seed": self.args.random_seed,
            "dp_size": 1,
            "tp_size": 1,
            "internal_states": [await self.core.call("loads")],
            "memory_occupation": await self.core.call("memory"),
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "served_model_name": self.served_model_name,
        })

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "owned_by": "rlkit",
            "root": self.served_model_name, "max_model_len": self.context_length,
        }]})

    async def loads(self, request: web.Request) -> web.Response:
        return web.json_response({
            "timestamp": time.time(),
            "version": ENGINE_VERSION,
            "dp_rank_count": 1,
            "loads": [{"dp_rank": 0, **await self.core.call("loads")}],
        })

    async def decode_stats(self, request: web.Request) -> web.Response:
        reset = request.query.get("reset", "0") in ("1", "true")
        return web.json_response(await self.core.call("stats", reset=reset))

    # -- generate -------------------------------------------------------------------------------------
    def _remote_request(self, req: GenerateRequest) -> RemoteRequest:
        if req.model is not None and req.model not in (self.served_model_name, self.model_path):
            raise RequestError(
                f"The model '{req.model}' does not exist (this engine serves "
                f"'{self.served_model_name}')", 404)
        sp = req.sampling_params
        unsupported = sp.unsupported_by_hf()
        if unsupported:
            raise RequestError(f"sampling parameters not supported by the {ENGINE_NAME} engine: "
                               f"{unsupported} (only their neutral values are accepted)")
        if req.top_logprobs_num:
            raise RequestError(f"top_logprobs_num is not supported by the {ENGINE_NAME} engine")
        if req.text is not None:
            try:  # JSON may carry lone surrogates ("\ud800"), which no tokenizer takes
                req.text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(f"text is not valid Unicode ({e.reason} at {e.start})") from None
            input_ids = self.tokenizer.encode(req.text)
            if not input_ids:
                raise RequestError("text tokenizes to no tokens")
        else:
            input_ids = list(req.input_ids or [])
        too_big = [t for t in input_ids if t >= self.vocab_size]
        if too_big:
            raise RequestError(f"input_ids contains token id {too_big[0]} outside the vocabulary "
                               f"(size {self.vocab_size})")
        if "" in sp.stop_strings():  # it would match before the first token
            raise RequestError("stop contains an empty string")
        bad_stop = [t for t in (sp.stop_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids contains {bad_stop[0]}, outside the vocabulary")
        n, ctx = len(input_ids), self.context_length
        if n >= ctx:
            raise RequestError(f"The input ({n} tokens) is longer than the model's context length "
                               f"({ctx} tokens).")
        max_new = sp.max_new_tokens if sp.max_new_tokens is not None else ctx - n
        if n + max_new > ctx:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {ctx} "
                f"tokens. You requested a total of {n + max_new} tokens: {n} tokens from the "
                f"input and {max_new} tokens for the completion.")
        cap = self.core.info.get("max_total_tokens")
        if cap and n + max_new > cap:
            raise RequestError(f"prompt + max_new_tokens ({n + max_new}) exceeds this engine's "
                               f"KV capacity max_total_tokens={cap}")
        # as SGLang: ignored without return_logprob, refused at or past the input's end
        start = req.logprob_start_len if req.return_logprob else -1
        if start != -1 and not 0 <= start < n:
            raise RequestError(f"logprob_start_len ({start}) must be -1 or in [0, {n}) for an "
                               f"input of {n} tokens")
        if start != -1 and sp.max_new_tokens == 0:
            raise RequestError(f"prefill-only scoring (max_new_tokens 0 with logprob_start_len) "
                               f"is not supported by the {ENGINE_NAME} engine: ask for one token")
        rid = req.rid or uuid.uuid4().hex
        if rid in self.core.requests:
            raise RequestError(f"a request with rid {rid!r} is already running")
        params = DecodeParams(
            max_new_tokens=max_new, min_new_tokens=sp.min_new_tokens,
            temperature=sp.temperature, top_p=sp.top_p, min_p=sp.min_p,
            # top_k >= vocab keeps every token, as off does; the core puts it in an int64 tensor,
            # where a huge value (the fuzzer sent 2**70) crashed it for every later request
            top_k=sp.top_k if sp.top_k < self.vocab_size else -1,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            stop_strings=tuple(sp.stop_strings()), ignore_eos=sp.ignore_eos,
            seed=sp.sampling_seed,
        )
        if req.lora_path is not None and req.lora_path not in self.loras:
            raise RequestError(f"LoRA adapter {req.lora_path!r} is not loaded (loaded: "
                               f"{sorted(self.loras) or 'none'})")
        return RemoteRequest(rid=rid, input_ids=input_ids, params=params, stream=req.stream,
                             logprob_start_len=start, lora=req.lora_path)

    def _payload(self, r: RemoteRequest, req: GenerateRequest, upto: int, since: int,
                 finished: bool, text: str) -> dict[str, Any]:
        """A /generate answer (or stream chunk) carrying output tokens [since, upto), stamped
        with the weight version of its last token (callers never mix versions in one chunk,
        except the single non-streamed answer, which reports the latest)."""
        finish = r.finish_reason if finished else None
        version = r.output_versions[upto - 1] if upto > 0 else r.weight_version
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": finish.wire() if finish is not None else None,
            "prompt_tokens": len(r.input_ids),
            "completion_tokens": upto,
            "cached_tokens": 0,
            "weight_version": version,
            "e2e_latency": time.monotonic() - r.created,
        }
        if finished:  # exact per-token versions on the final chunk, as SGLang 0.5.23 sends them
            meta["weight_versions"] = version_spans(r.output_versions[:upto], r.weight_version)
        ids = r.output_ids[since:upto]
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(r.output_logprobs[since:upto], ids)]
            # the scored input (logprob_start_len), cumulative like the rest of meta_info: in
            # every chunk unless the stream is incremental, then in the first one
            scored = r.input_logprobs if since == 0 else None
            meta["input_token_logprobs"] = [] if scored is None else [
                [lp, t, None] for lp, t in zip(scored, r.input_ids[len(r.input_ids) - len(scored):])]
        return {"text": text, "output_ids": ids, "meta_info": meta}

    def _final_text(self, r: RemoteRequest, req: GenerateRequest) -> str:
        """The whole output text, cut at a matched stop string unless no_stop_trim."""
        sp = req.sampling_params
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=sp.skip_special_tokens)
        matched = r.finish_reason.matched if r.finish_reason is not None else None
        if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
            text = text[:text.find(matched)]
        return text

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = GenerateRequest.model_validate(await self._body(request))
        r = self._remote_request(req)
        if r.params.max_new_tokens == 0:  # nothing to generate (SGLang answers at once, too)
            r.finish_reason = FinishReason.of_length(0)
            r.progressed.set()
        else:
            self.core.submit(r)
        try:
            if not req.stream:
                while r.finish_reason is None:
                    await r.progressed.wait()
                    r.progressed.clear()
                return web.json_response(
                    self._payload(r, req, len(r.output_ids), 0, True, self._final_text(r, req)),
                    headers={ENGINE_URL_HEADER: self.public_url})
            return await self._stream(request, req, r)
        finally:
            if r.finish_reason is None and self.core.alive:  # the client went away: free it
                self.core.abort(r.rid)

    async def _stream(self, request: web.Request, req: GenerateRequest, r: RemoteRequest) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           ENGINE_URL_HEADER: self.public_url})
        await resp.prepare(request)
        incremental = self.args.incremental_streaming_output
        detok = IncrementalDetokenizer(self.tokenizer,
                                       skip_special_tokens=req.sampling_params.skip_special_tokens)
        sent = 0
        while True:
            # The core reports a streamed request only when a chunk is due (stream interval
            # reached, weight version changed, or finished: EngineCore._report), so every
            # wake-up has something to send.
            await r.progressed.wait()
            r.progressed.clear()
            finished = r.finish_reason is not None
            n = len(r.output_ids)
            versions = r.output_versions
            # One chunk per weight version: a chunk's weight_version is true of all its tokens.
            cuts = [i for i in range(sent + 1, n) if versions[i] != versions[i - 1]] + [n]
            for upto in cuts:
                last = upto == n
                piece = detok.update(r.output_ids[:upto])
                if finished and last:
                    piece += detok.finish(r.output_ids)
                text = piece if incremental else detok.text
                chunk = self._payload(r, req, upto, sent if incremental else 0,
                                      finished and last, text)
                await resp.write(b"data: " + dumps(chunk) + b"\n\n")
                if self.fault is not None and upto > sent and not self.fault.streamed(
                        upto - sent, versions[upto - 1], finished and last):
                    self.fault = None  # spent: another engine fired it
                sent = upto
            if finished:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        req = AbortRequest.model_validate(await self._body(request))
        self.core.abort(None if req.abort_all else req.rid, abort_all=req.abort_all)
        return web.Response(status=200)

    # -- pause / flush ----------------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        req = PauseGenerationRequest.model_validate(await self._body(request, optional=True))
        affected = await self.core.call("pause", mode=req.mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok",
                                  "mode": req.mode, "num_paused_requests": affected})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request, optional=True)
        await self.core.call("resume")
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        if await self.core.call("flush"):
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: requests are holding KV cache "
                            "(pause with mode abort or retract first).\n")

    # -- sleep / wake (memory occupation) ---------------------------------------------------------
    async def _memory_tags(self, request: web.Request) -> list[str] | None:
        body = await self._body(request, optional=True)
        tags = body.get("tags")  # other fields (SGLang's rid, ...) are ignored, as SGLang does
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            raise RequestError(f"{request.path}: tags must be null or a list of strings, got "
                               f"{json.dumps(tags)[:100]}")
        return tags

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        """SGLang's `/release_memory_occupation {"tags"}`: free the KV cache ("kv_cache"), the
        model's parameter storage ("weights"; no copy is kept unless --enable-weights-cpu-backup)
        and "cuda_graph" (none here: 0 bytes); null or [] = all three.

        As SGLang, only when idle: nothing running, and nothing queued unless generation is
        paused (retracted requests wait in the queue, holding no KV). Otherwise 400 with SGLang's
        message (SGLang itself fails an assertion in its scheduler, which takes the server
        down). Releasing a tag already released frees nothing and succeeds.

        While weights or kv_cache are released the engine is asleep: /generate requests are
        accepted and QUEUED (not refused); they start when the engine is awake again, i.e.
        both are resumed and, if the weights were re-allocated without a backup, every
        parameter was loaded again by a weight update. /health stays 200; /health_generate
        answers 503 while asleep.

        Answer 200: {"success", "message", "tags", "freed_bytes": {tag: bytes}, "before",
        "after" (memory figures: rss, and cuda_allocated / cuda_reserved on CUDA), "memory"
        (the state /server_info shows as memory_occupation)}. SGLang answers 200 with no body."""
        tags = await self._memory_tags(request)
        try:
            report = await self.core.call("release_memory", tags=tags)
        except CoreRefused as e:
            return self._result(False, str(e), memory=await self.core.call("memory"))
        return self._result(True, f"Released {list(report['freed_bytes'])}.",
                            tags=list(report["freed_bytes"]), **report)

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        """SGLang's `/resume_memory_occupation {"tags"}` (null or [] = all): allocate the tags'
        memory again. The KV cache comes back empty at its former size; the weights come back
        as zeros (SGLang: undefined content) and must be loaded by a weight update, which may
        come while kv_cache is still released (verl's staged wake: weights, update, kv_cache,
        so the peak stays low), unless --enable-weights-cpu-backup restored them. A tag that
        is not released is left as it is (0 bytes; SGLang fails on it). Answer 200:
        {"success", "message", "tags", "resumed_bytes": {tag: bytes}, "before", "after",
        "memory"}."""
        tags = await self._memory_tags(request)
        report = await self.core.call("resume_memory", tags=tags)
        message = f"Resumed {list(report['resumed_bytes'])}."
        if report["memory"]["weights_stale"]:
            message += (" The weights were re-allocated without their values: load them with a "
                        "weight update before generating (requests wait until then).")
        return self._result(True, message, tags=list(report["resumed_bytes"]), **report)

    # -- weight updates -------------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        req = UpdateWeightsFromDiskRequest.model_validate(await self._body(request))
        if req.load_format not in (None, "auto", "safetensors"):
            return self._result(False, f"load_format {req.load_format!r} is not supported "
                                "(safetensors folders only)", num_paused_requests=0)
        if not Path(req.model_path).is_dir():
            return self._result(False, f"model_path {req.model_path!r} does not exist",
                                num_paused_requests=0)
        if self._drops(request):
            return await self._dropped_update(req.weight_version, num_paused_requests=0)
        try:
            message = await self.core.call("update_from_disk", model_path=req.model_path,
                                           version=req.weight_version,
                                           abort_all=req.abort_all_requests, flush=req.flush_cache)
        except CoreError as e:
            return self._result(False, f"update from {req.model_path!r} failed: {e}",
                                num_paused_requests=0)
        await self._set_version(req.weight_version)
        self.model_path = req.model_path
        return self._result(True, f"Succeeded to update model weights. {message}",
                            num_paused_requests=0)

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        from rlkit.rollout.engines.builtin.tensor_receiver import UpdateWeightsFromTensorRequest

        req = UpdateWeightsFromTensorRequest.model_validate(await self._body(request))
        if self._drops(request):
            return await self._dropped_update(req.weight_version)
        try:
            message = await self.core.call(
                "update_from_tensor", serialized_named_tensors=req.serialized_named_tensors,
                load_format=req.load_format, version=req.weight_version,
                abort_all=req.abort_all_requests, flush=req.flush_cache)
        except CoreError as e:
            return self._result(False, f"update from tensors failed: {e}")
        await self._set_version(req.weight_version)
        return self._result(True, f"Succeeded to update model weights from tensors. {message}")

    # -- LoRA adapters (SGLang's endpoints and LoRAUpdateOutput answers) -------------------------
    def _lora_result(self, ok: bool, error: str | None = None) -> web.Response:
        return web.json_response(
            {"success": ok, "error_message": error, "loaded_adapters": dict(self.loras)},
            status=200 if ok else 400)

    async def _lora_call(self, command: str, done: Callable[[], Any], **kwargs: Any) -> web.Response:
        """Core `command`; on success `done()` updates the adapters this server lists."""
        try:
            await self.core.call(command, **kwargs)
        except CoreError as e:
            return self._lora_result(False, str(e))
        done()
        return self._lora_result(True)

    async def _dropped_update(self, version: str | None, **extra: Any) -> web.Response:
        """The fault switch's drop: the version moves, the weights do not."""
        if version is not None:
            await self.core.call("set_weight_version", version=version)
            await self._set_version(version)
        return self._result(True, "Succeeded to update model weights.", **extra)

    def _drops(self, request: web.Request) -> bool:
        """The test-only fault switch (fault.py, action=drop) says: answer, do not apply."""
        return self.fault is not None and self.fault.drops(request.path)

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        req = LoadLoraAdapterRequest.model_validate(await self._body(request))
        return await self._lora_call(
            "load_lora", lambda: self.loras.__setitem__(req.lora_name, req.lora_path),
            lora_name=req.lora_name, lora_path=req.lora_path, dropped=self._drops(request))

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        req = LoadLoraAdapterFromTensorsRequest.model_validate(await self._body(request))
        return await self._lora_call(  # "__tensor__": SGLang's lora_path for tensor loads
            "load_lora_from_tensors", lambda: self.loras.__setitem__(req.lora_name, "__tensor__"),
            lora_name=req.lora_name, config_dict=req.config_dict,
            serialized_named_tensors=req.serialized_named_tensors, load_format=req.load_format,
            dropped=self._drops(request))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        req = UnloadLoraAdapterRequest.model_validate(await self._body(request))
        return await self._lora_call("unload_lora", lambda: self.loras.pop(req.lora_name, None),
                                     lora_name=req.lora_name)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        req = InitWeightsUpdateGroupRequest.model_validate(await self._body(request))
        try:
            message = await self.core.call(
                "init_group", master_address=req.master_address, master_port=req.master_port,
                rank=req.rank_offset, world_size=req.world_size, group_name=req.group_name,
                backend=req.backend)
        except CoreError as e:
            return self._result(False, f"failed to join weight update group {req.group_name!r} "
                                f"at {req.master_address}:{req.master_port} as rank "
                                f"{req.rank_offset}/{req.world_size}: {e}")
        return self._result(True, message)

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req = DestroyWeightsUpdateGroupRequest.model_validate(await self._body(request, optional=True))
        try:
            return self._result(True, await self.core.call("destroy_group", group_name=req.group_name))
        except CoreError as e:
            return self._result(False, str(e))

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request, optional=True)
        if self.update_session_open:
            return self._result(False, "a weight update is already in progress (call "
                                "/end_weight_update first)")
        self.update_session_open = True
        return self._result(True, "Weight update begun.")

    async def end_weight_update(self, request: web.Request) -> web.Response:
        await self._body(request, optional=True)
        if not self.update_session_open:
            return self._result(False, "no weight update in progress (/begin_weight_update first)")
        self.update_session_open = False
        return self._result(True, "Weight update ended.")

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        req = UpdateWeightsFromDistributedRequest.model_validate(await self._body(request))
        try:
            message = await self.core.call(
                "receive_bucket", group_name=req.group_name, names=req.names, dtypes=req.dtypes,
                shapes=req.shapes, version=req.weight_version, abort_all=req.abort_all_requests,
                flush=req.flush_cache)
        except CoreError as e:
            return self._result(False, str(e))
        await self._set_version(req.weight_version)
        return self._result(True, f"Succeeded to update parameter online. {message}")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = UpdateWeightVersionRequest.model_validate(await self._body(request))
        if req.abort_all_requests:
            self.core.abort(abort_all=True)
        await self.core.call("set_weight_version", version=req.new_version)
        await self._set_version(req.new_version)
        return web.json_response({"success": True, "message": f"Weight version updated to "
                                  f"{req.new_version}", "new_version": req.new_version})


def _sleep_reason(state: dict[str, Any]) -> str:
    parts = []
    if state["released"]:
        parts.append(f"memory released ({', '.join(state['released'])}): "
                     "/resume_memory_occupation first")
    if state["weights_stale"]:
        parts.append(f"{state['stale_parameters']} parameters re-allocated and not loaded "
                     "since: send a weight update")
    return "; ".join(parts)


# -- process entry point ----------------------------------------------------------------------------
def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlkit.rollout.engines.builtin.hf_server", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once ready")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the core")
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="0")
    p.add_argument("--stream-interval", type=int, default=1, help="tokens between stream chunks")
    p.add_argument("--incremental-streaming-output", action="store_true",
                   help="stream chunks carry only new tokens (SGLang's flag of the same name)")
    p.add_argument("--weight-group-timeout-s", type=float, default=600.0)
    p.add_argument("--enable-weights-cpu-backup", action="store_true",
                   help="keep a host copy of the weights on /release_memory_occupation and "
                   "restore it on resume (SGLang's flag; on a CPU engine the copy takes the "
                   "memory the release frees)")
    # SGLang's LoRA flags: adapters are always servable here (no pre-sized LoRA memory pool), so
    # --enable-lora, --max-lora-rank and --lora-target-modules are accepted and need nothing
    p.add_argument("--enable-lora", action="store_true", help="(SGLang's flag; always on here)")
    p.add_argument("--max-lora-rank", type=int, default=None, help="(SGLang's flag; not needed here)")
    p.add_argument("--lora-target-modules", nargs="*", default=None,
                   help="(SGLang's flag; each adapter names its own modules here)")
    p.add_argument("--max-loaded-loras", type=int, default=8,
                   help="LoRA adapters held at once (SGLang's flag); loading one more is refused")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process (the launcher) is gone: no orphaned engines")
    p.add_argument("--log-level", default="warning")
    return p


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Stop when re-parented: the launcher died without stopping us (getppid is pid-reuse safe)."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.warning("launcher (pid %d) is gone: stopping", parent_pid)
            stop.set()
            return
        await asyncio.sleep(1.0)


async def _serve(server: EngineServer, host: str, port: int, port_file: str | None,
                 startup_timeout_s: float, parent_pid: int | None = None) -> None:
    # Spawn the core first: it imports torch and loads the model while we load the tokenizer.
    server.core.launch()
    server.tokenizer = await asyncio.to_thread(load_tokenizer, server.tokenizer_path)
    await server.core.wait_ready(startup_timeout_s)  # the model is loaded before we listen
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.public_url = f"http://{host}:{bound}"
    if server.fault is not None:
        server.fault.arm(server.public_url, server.core.info.get("pid"))
    if port_file:
        tmp = f"{port_file}.tmp"
        Path(tmp).write_text(str(bound))
        os.replace(tmp, port_file)
    log.warning("%s serving %s on %s", ENGINE_NAME, server.model_path, server.public_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watchdog = asyncio.create_task(_watch_parent(parent_pid, stop)) if parent_pid else None
    try:
        await stop.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()
        await runner.cleanup()
        await server.core.stop()


def hide_torch() -> None:
    """This process speaks HTTP and text only, yet transformers imports torch whenever it is
    installed: about 0.3 GiB of every engine's memory for nothing. Hidden (a None entry in
    sys.modules is Python's way to block an import, and what transformers' find_spec sees), the
    tokenizer loads without it, tokenizing the same. The core process is spawned, a fresh
    interpreter, and imports torch as usual; an in-process server (tests) is left alone."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # "PyTorch was not found"


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:  # before loading anything: a refused start should be quick and plain
        check_bind(args.host, control_token_from_env(), f"the {ENGINE_NAME} engine server")
    except ControlTokenMissing as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_IgnoreHttp2Probes())
    hide_torch()
    server = EngineServer(args)
    asyncio.run(_serve(server, args.host, args.port, args.port_file, args.startup_timeout_s,
                       args.parent_pid))
    return 0


if __name__ == "__main__":
    sys.exit(main())

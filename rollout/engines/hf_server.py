"""rlkit's built-in engine server: SGLang's HTTP protocol over a transformers model.

    python -m rollout.engines.hf_server --model PATH [--port 0 --port-file F] [--threads N] ...

It serves the SGLang endpoints rlkit uses (docs/engines.md has the table) so that it sits behind
the real sglang-router and talks to the same client as real SGLang servers. Generation runs in a
`BatchedDecoder` thread (continuous batching); this module is only the HTTP layer: it validates
requests with `rollout.protocol`, turns them into decoder requests, streams progress back, and
turns control calls (abort, pause, weight updates) into decoder commands that run between two
decode steps. Every answer carries `weight_version`. A bad request gets a 4xx JSON error in
SGLang's shape; an unexpected error gets a 500; neither stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from aiohttp import web
from pydantic import ValidationError

from rollout.protocol import (
    AbortRequest,
    ENGINE_URL_HEADER,
    DestroyWeightsUpdateGroupRequest,
    GenerateRequest,
    InitWeightsUpdateGroupRequest,
    PauseGenerationRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    error_body,
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
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # keep serving; say what failed
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(f"internal error on {request.path}: {type(e).__name__}: {e}", 500)


class _IgnoreHttp2Probes(logging.Filter):
    """sglang-router probes workers with HTTP/2 prior knowledge first; aiohttp logs each probe
    as an error ('Pause on PRI/Upgrade') before the router falls back to HTTP/1.1."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


class EngineServer:
    """Holds the model, tokenizer, decoder and weight-update groups; builds the aiohttp app."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rollout.engines.batched_decoder import BatchedDecoder

        self.args = args
        self.model_path = args.model
        self.tokenizer_path = args.tokenizer or args.model
        self.served_model_name = args.served_model_name or args.model
        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype_name = args.dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if device == "cuda" else "float32"
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype_name)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, attn_implementation="sdpa"
        ).to(self.device).eval()
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        self.context_length = args.context_length or int(
            getattr(self.model.config, "max_position_embeddings", 2048)
        )
        self.decoder = BatchedDecoder(
            self.model,
            eos_token_ids=self._eos_ids(),
            detokenize=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            max_running_requests=args.max_running_requests,
            max_total_tokens=args.max_total_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            context_length=self.context_length,
            seed=args.random_seed,
            weight_version=args.weight_version,
        )
        self.groups: dict[str, Any] = {}  # group_name -> WeightGroup
        self.update_session_open = False
        self.active: dict[str, Any] = {}  # rid -> DecodeRequest in flight
        self.public_url = ""  # set once bound; sent as X-Engine-Url so clients behind the router
        # can tell which worker served them (the router passes worker headers through)
        self.started_at = time.time()

    # -- set-up ---------------------------------------------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(x) for x in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def app(self) -> web.Application:
        app = web.Application(middlewares=[_errors_middleware], client_max_size=1 << 30)
        r = app.router
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, self.weight_version)
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
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        r.add_post("/begin_weight_update", self.begin_weight_update)
        r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/rlkit/decode_stats", self.decode_stats)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.decoder.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        self.decoder.abort(abort_all=True)
        await asyncio.to_thread(self.decoder.stop)

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

    async def _on_decoder(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(self.decoder.call(fn))

    @property
    def version(self) -> str:
        return self.decoder.weight_version

    # -- info ---------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if not self.decoder.alive:
            return _error(f"decoder not running: {self.decoder.crashed or 'stopped'}", 503)
        return web.Response(text="OK")

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "engine": ENGINE_NAME,
            "version": ENGINE_VERSION,
            "weight_version": self.version,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "context_length": self.context_length,
            "max_running_requests": self.decoder.max_running_requests,
            "max_total_num_tokens": self.decoder.max_total_tokens,
            "max_prefill_tokens": self.decoder.max_prefill_tokens,
            "stream_interval": self.args.stream_interval,
            "incremental_streaming_output": self.args.incremental_streaming_output,
            "threads": self.args.threads,
            "random_seed": self.args.random_seed,
            "dp_size": 1,
            "tp_size": 1,
            "internal_states": [self.decoder.loads()],
        })

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.version,
            "served_model_name": self.served_model_name,
        })

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

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
            "loads": [{"dp_rank": 0, **self.decoder.loads()}],
        })

    async def decode_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.decoder.stats.as_dict())

    # -- generate -------------------------------------------------------------------------------------
    def _decode_request(self, req: GenerateRequest) -> Any:
        from rollout.engines.batched_decoder import DecodeParams, DecodeRequest

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
            input_ids = self.tokenizer(req.text)["input_ids"]
            if not input_ids:
                raise RequestError("text tokenizes to no tokens")
        else:
            input_ids = list(req.input_ids or [])
        too_big = [t for t in input_ids if t >= self.vocab_size]
        if too_big:
            raise RequestError(f"input_ids contains token id {too_big[0]} outside the vocabulary "
                               f"(size {self.vocab_size})")
        bad_stop = [t for t in (sp.stop_token_ids or []) if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids contains {bad_stop[0]}, outside the vocabulary")
        n = len(input_ids)
        if n >= self.context_length:
            raise RequestError(f"The input ({n} tokens) is longer than the model's context length "
                               f"({self.context_length} tokens).")
        max_new = sp.max_new_tokens if sp.max_new_tokens is not None else self.context_length - n
        if n + max_new > self.context_length:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_length} tokens. You requested a total of {n + max_new} tokens: "
                f"{n} tokens from the input and {max_new} tokens for the completion.")
        cap = self.decoder.max_total_tokens
        if cap and n + max_new > cap:
            raise RequestError(f"prompt + max_new_tokens ({n + max_new}) exceeds this engine's "
                               f"KV capacity max_total_tokens={cap}")
        rid = req.rid or uuid.uuid4().hex
        if rid in self.active:
            raise RequestError(f"a request with rid {rid!r} is already running")
        params = DecodeParams(
            max_new_tokens=max_new,
            min_new_tokens=sp.min_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            min_p=sp.min_p,
            stop_token_ids=frozenset(sp.stop_token_ids or ()),
            stop_strings=tuple(sp.stop_strings()),
            ignore_eos=sp.ignore_eos,
            seed=sp.sampling_seed,
        )
        return DecodeRequest(rid=rid, input_ids=input_ids, params=params, stream=req.stream)

    def _payload(self, dr: Any, req: GenerateRequest, upto: int, since: int, finished: bool) -> dict[str, Any]:
        """A /generate answer (or stream chunk) with output tokens [since, upto)."""
        ids = dr.output_ids[:upto]
        sp = req.sampling_params
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
        finish = dr.finish_reason if finished else None
        if finish is not None and isinstance(finish.matched, str) and not sp.no_stop_trim:
            cut = text.find(finish.matched)
            text = text[:cut] if cut >= 0 else text
        if since:
            text = text[len(self.tokenizer.decode(ids[:since], skip_special_tokens=sp.skip_special_tokens)):]
        meta: dict[str, Any] = {
            "id": dr.rid,
            "finish_reason": finish.wire() if finish is not None else None,
            "prompt_tokens": len(dr.input_ids),
            "completion_tokens": upto,
            "cached_tokens": 0,
            "weight_version": dr.weight_version,
            "e2e_latency": time.monotonic() - dr.created,
        }
        if req.return_logprob:
            lps = dr.output_logprobs[since:upto]
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(lps, ids[since:])]
            meta["input_token_logprobs"] = []
        return {"text": text, "output_ids": ids[since:], "meta_info": meta}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = GenerateRequest.model_validate(await self._body(request))
        dr = self._decode_request(req)
        loop = asyncio.get_running_loop()
        progressed = asyncio.Event()
        pending = [False]  # coalesce wake-ups from the decoder thread

        def wake() -> None:
            pending[0] = False
            progressed.set()

        def notify() -> None:  # decoder thread
            if not pending[0]:
                pending[0] = True
                loop.call_soon_threadsafe(wake)

        dr.notify = notify
        self.active[dr.rid] = dr
        try:
            self.decoder.submit(dr)
            if not req.stream:
                while dr.finish_reason is None:
                    await progressed.wait()
                    progressed.clear()
                n = min(len(dr.output_ids), len(dr.output_logprobs))
                return web.json_response(self._payload(dr, req, n, 0, True),
                                         headers={ENGINE_URL_HEADER: self.public_url})
            return await self._stream(request, req, dr, progressed)
        finally:
            self.active.pop(dr.rid, None)
            if dr.finish_reason is None:  # the client went away: free the slot
                self.decoder.abort(dr.rid)

    async def _stream(self, request: web.Request, req: GenerateRequest, dr: Any, progressed: asyncio.Event) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           ENGINE_URL_HEADER: self.public_url})
        await resp.prepare(request)
        incremental = self.args.incremental_streaming_output
        interval = max(1, self.args.stream_interval)
        sent = 0
        while True:
            await progressed.wait()
            progressed.clear()
            finished = dr.finish_reason is not None  # read before the outputs (see DecodeRequest)
            n = min(len(dr.output_ids), len(dr.output_logprobs))
            if finished or n - sent >= interval:
                chunk = self._payload(dr, req, n, sent if incremental else 0, finished)
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                sent = n
            if finished:
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def abort_request(self, request: web.Request) -> web.Response:
        req = AbortRequest.model_validate(await self._body(request))
        if req.abort_all:
            self.decoder.abort(abort_all=True)
        else:
            self.decoder.abort(req.rid)
        return web.Response(status=200)

    # -- pause / flush ----------------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        req = PauseGenerationRequest.model_validate(await self._body(request, optional=True))
        affected = await asyncio.wrap_future(self.decoder.pause(req.mode))
        return web.json_response({"message": "Generation paused successfully.", "status": "ok",
                                  "mode": req.mode, "num_paused_requests": affected})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await self._body(request, optional=True)
        await asyncio.wrap_future(self.decoder.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        ok = await asyncio.wrap_future(self.decoder.flush())
        if ok:
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: requests are holding KV cache "
                            "(pause with mode abort or retract first).\n")

    # -- weight updates -------------------------------------------------------------------------------
    def _result(self, success: bool, message: str, **extra: Any) -> web.Response:
        return web.json_response({"success": success, "message": message, **extra},
                                 status=200 if success else 400)

    async def _apply_weights(self, tensors: dict[str, Any], version: str | None,
                             abort_all: bool, flush: bool) -> str:
        from rollout.engines.weight_receiver import load_into_model

        if abort_all:
            self.decoder.abort(abort_all=True)
        await self._on_decoder(lambda: load_into_model(self.model, tensors))
        message = f"Updated {len(tensors)} tensors."
        if version is not None:
            await asyncio.wrap_future(self.decoder.set_weight_version(version))
            message += f" Weight version updated to {version}."
        if flush:
            await asyncio.wrap_future(self.decoder.flush())
        return message

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        from rollout.engines.weight_receiver import WeightUpdateError, named_for_model, read_checkpoint

        req = UpdateWeightsFromDiskRequest.model_validate(await self._body(request))
        if req.load_format not in (None, "auto", "safetensors"):
            return self._result(False, f"load_format {req.load_format!r} is not supported "
                                f"(safetensors folders only)", num_paused_requests=0)
        if not Path(req.model_path).is_dir():
            return self._result(False, f"model_path {req.model_path!r} does not exist",
                                num_paused_requests=0)
        try:
            tensors = await asyncio.to_thread(read_checkpoint, req.model_path)
            tensors = named_for_model(self.model, tensors)
            message = await self._apply_weights(tensors, req.weight_version,
                                                req.abort_all_requests, req.flush_cache)
        except WeightUpdateError as e:
            return self._result(False, f"update from {req.model_path!r} failed: {e}",
                                num_paused_requests=0)
        self.model_path = req.model_path
        return self._result(True, f"Succeeded to update model weights. {message}",
                            num_paused_requests=0)

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        import threading

        from rollout.engines.weight_receiver import WeightGroup, create_group

        req = InitWeightsUpdateGroupRequest.model_validate(await self._body(request))
        if req.group_name in self.groups:
            return self._result(False, f"weight update group {req.group_name!r} already exists; "
                                "destroy it first")
        if req.backend == "nccl" and self.device.type != "cuda":
            return self._result(False, "backend nccl needs a CUDA engine; use backend gloo on CPU")
        try:
            pg = await asyncio.to_thread(
                create_group, master_address=req.master_address, master_port=req.master_port,
                rank=req.rank_offset, world_size=req.world_size, group_name=req.group_name,
                backend=req.backend, timeout_s=self.args.weight_group_timeout_s)
        except Exception as e:
            return self._result(False, f"failed to join weight update group {req.group_name!r} "
                                f"at {req.master_address}:{req.master_port} as rank "
                                f"{req.rank_offset}/{req.world_size}: {type(e).__name__}: {e}")
        self.groups[req.group_name] = WeightGroup(req.group_name, req.rank_offset, req.world_size,
                                                  req.backend, pg, threading.Lock())
        return self._result(True, f"Joined weight update group {req.group_name!r} as rank "
                            f"{req.rank_offset} of {req.world_size}.")

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        req = DestroyWeightsUpdateGroupRequest.model_validate(await self._body(request, optional=True))
        from rollout.engines.weight_receiver import destroy_group

        group = self.groups.pop(req.group_name, None)
        if group is None:
            return self._result(False, f"no weight update group {req.group_name!r}")
        await asyncio.to_thread(destroy_group, group.group)
        return self._result(True, f"Destroyed weight update group {req.group_name!r}.")

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
        from rollout.engines.weight_receiver import (
            WeightUpdateError, check_named_shapes, parse_dtype, receive_bucket)

        req = UpdateWeightsFromDistributedRequest.model_validate(await self._body(request))
        group = self.groups.get(req.group_name)
        if group is None:
            return self._result(False, f"no weight update group {req.group_name!r}; call "
                                "/init_weights_update_group first")
        try:
            for d in req.dtypes:
                parse_dtype(d)
        except WeightUpdateError as e:
            return self._result(False, str(e))
        try:
            tensors = await asyncio.to_thread(receive_bucket, group, req.names, req.dtypes,
                                              req.shapes, self.device)
        except Exception as e:
            return self._result(False, f"receiving the bucket over group {req.group_name!r} "
                                f"failed: {type(e).__name__}: {e}")
        try:
            check_named_shapes(self.model, ((n, tuple(s)) for n, s in zip(req.names, req.shapes)))
            message = await self._apply_weights(tensors, req.weight_version,
                                                req.abort_all_requests, req.flush_cache)
        except WeightUpdateError as e:
            return self._result(False, f"bucket received but not applied: {e}")
        return self._result(True, f"Succeeded to update parameter online. {message}")

    async def update_weight_version(self, request: web.Request) -> web.Response:
        req = UpdateWeightVersionRequest.model_validate(await self._body(request))
        if req.abort_all_requests:
            self.decoder.abort(abort_all=True)
        await asyncio.wrap_future(self.decoder.set_weight_version(req.new_version))
        return web.json_response({"success": True, "message": f"Weight version updated to "
                                  f"{req.new_version}", "new_version": req.new_version})


# -- process entry point ----------------------------------------------------------------------------
def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout.engines.hf_server", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
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
    p.add_argument("--log-level", default="warning")
    return p


async def _serve(server: EngineServer, host: str, port: int, port_file: str | None) -> None:
    runner = web.AppRunner(server.app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    server.public_url = f"http://{host}:{bound}"
    if port_file:
        tmp = f"{port_file}.tmp"
        Path(tmp).write_text(str(bound))
        os.replace(tmp, port_file)
    log.warning("%s serving %s on http://%s:%d", ENGINE_NAME, server.model_path, host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(_IgnoreHttp2Probes())
    import torch

    torch.set_num_threads(max(1, args.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    server = EngineServer(args)
    asyncio.run(_serve(server, args.host, args.port, args.port_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Typed models of the SGLang HTTP protocol subset rlkit speaks, and every version quirk.

The client builds its requests from these models (so what it sends is validated), the built-in
`hf` server validates what it receives with them, and the client parses responses with them.
Field names and defaults follow SGLang 0.5.x (`io_struct.py`, `sampling_params.py`,
`http_server.py`); see docs/engines.md for the endpoint table.

Version quirks handled here and nowhere else:
- `/server_info` and `/model_info` are newer spellings of `/get_server_info` / `/get_model_info`
  (try the new one, fall back on 404): `SERVER_INFO_PATHS`, `MODEL_INFO_PATHS`. An engine's
  weight version is `/model_info`'s `weight_version` (0.5.23 has no `/get_weight_version`).
- `/v1/loads` answers `{"loads": [{num_running_reqs, num_waiting_reqs, ...}, ...]}` (one entry
  per DP rank); older servers answer a list or a dict with `num_reqs` / `num_total_reqs`:
  `total_requests`. From 0.5.23 each entry is the snapshot its scheduler last published, with
  the time it did (`timestamp`): `progress_mark`.
- A request's final chunk carries `weight_versions`, exact per-token spans
  `[{"version", "start", "end"}, ...]` over its output (0.5.23); a chunk's `weight_version` is
  only the version when it was sent: `OutputChunk.versions_by_token`.
- An aborted non-streaming `/generate` answers HTTP 200 with `finish_reason.type == "abort"` and
  the partial tokens on most versions, but an HTTP error (400/500/503) on some:
  `is_abort_failure`. `weight_version` may be missing on aborted outputs.
- Streaming chunks are cumulative by default and incremental with
  `--incremental-streaming-output`: `new_output_entries` takes only the new suffix either way.
- `/abort_request` without a `rid` returned 422 on mid-2025 SGLang: `AbortRequest` always sends
  `rid` (empty for abort_all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
LOADS_PATHS = ("/v1/loads", "/get_load")
# rlkit's hf engine names itself on /generate answers (the router passes worker headers through)
ENGINE_URL_HEADER = "X-Engine-Url"

FinishType = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]

# SGLang accepts these penalties; rlkit's hf engine implements none of them, so they are accepted
# only at their neutral value (anything else is refused with a 400 rather than ignored).
NEUTRAL_PENALTIES = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}


class ProtocolError(ValueError):
    """A payload that does not follow the protocol (bad request, or an unparseable answer)."""


# -- /generate --------------------------------------------------------------------------------
class SamplingParams(BaseModel):
    """`sampling_params` of `/generate` (SGLang's SamplingParams, the subset rlkit uses)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = Field(128, ge=0)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    n: int = Field(1, ge=1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens "
                f"({self.max_new_tokens})"
            )
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_by_hf(self) -> list[str]:
        """Settings the built-in engine does not implement (it refuses them with a 400)."""
        bad = [k for k, neutral in NEUTRAL_PENALTIES.items() if getattr(self, k) != neutral]
        if self.n != 1:
            bad.append("n")
        return bad


class GenerateRequest(BaseModel):
    """`POST /generate` body: one prompt (rlkit never sends batched requests; the router
    refuses them anyway). Unknown top-level keys are ignored, as SGLang does, because the router
    adds its own defaults (log_metrics, return_hidden_states, ...)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    rid: str | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    model: str | None = None  # the router forwards an OpenAI-style model name
    lora_path: str | None = None  # SGLang's: the name of a loaded LoRA adapter to generate with

    @model_validator(mode="before")
    @classmethod
    def _not_batched(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in ("text", "input_ids", "rid"):
                value = data.get(key)
                if isinstance(value, list) and value and isinstance(value[0], (list, str)):
                    raise ValueError(f"batched /generate ({key} is a list of prompts) is not supported")
            if data.get("sampling_params") is None:
                data = {k: v for k, v in data.items() if k != "sampling_params"}
        return data

    @model_validator(mode="after")
    def _one_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty")
        if self.input_ids is not None and min(self.input_ids) < 0:
            raise ValueError("input_ids contains a negative token id")
        return self

    def payload(self) -> dict[str, Any]:
        """JSON body as a client sends it: the core sampling fields always, other fields only
        when they differ from SGLang's defaults."""
        body: dict[str, Any] = {}
        for key in ("text", "input_ids", "rid", "model", "lora_path"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        sp = self.sampling_params.model_dump(exclude_defaults=True)
        for key in ("max_new_tokens", "temperature", "top_p", "top_k"):
            sp[key] = getattr(self.sampling_params, key)
        body["sampling_params"] = sp
        body["stream"] = self.stream
        body["return_logprob"] = self.return_logprob
        if self.logprob_start_len != -1:
            body["logprob_start_len"] = self.logprob_start_len
        if self.top_logprobs_num:
            body["top_logprobs_num"] = self.top_logprobs_num
        return body


class FinishReason(BaseModel):
    """`meta_info.finish_reason` (SGLang's BaseFinishReason.to_json())."""

    model_config = ConfigDict(extra="allow")

    type: str
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None

    @classmethod
    def stop(cls, matched: int | str | None) -> "FinishReason":
        return cls(type="stop", matched=matched)

    @classmethod
    def of_length(cls, length: int) -> "FinishReason":
        return cls(type="length", length=length)

    @classmethod
    def abort(cls, message: str = "Aborted", status_code: int | None = None) -> "FinishReason":
        return cls(type="abort", message=message, status_code=status_code)

    def wire(self) -> dict[str, Any]:
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": self.type, "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


class MetaInfo(BaseModel):
    """`meta_info` of a /generate answer or stream chunk (SGLang adds many more keys)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # [[logprob, token_id, text_or_null], ...]: the output tokens only (logprob_start_len=-1)
    output_token_logprobs: list[list[Any]] | None = None
    weight_version: str | None = None
    # final chunk only: [{"version": str, "start": int, "end": int}, ...] over the output tokens
    weight_versions: list[dict[str, Any]] | None = None

    @field_validator("weight_version", mode="before")
    @classmethod
    def _version_str(cls, v: Any) -> Any:
        return None if v is None else str(v)


class GenerateResponse(BaseModel):
    """A /generate answer, or one SSE chunk of a streamed one."""

    model_config = ConfigDict(extra="allow")

    text: str = ""
    output_ids: list[int] | None = None
    meta_info: MetaInfo = Field(default_factory=MetaInfo)

    def output_entries(self) -> tuple[list[int], list[float]]:
        """(token ids, logprobs) of this payload's output (see `_output_entries`)."""
        return _output_entries(self.meta_info.output_token_logprobs, self.output_ids)

    def weight_version_int(self, default: int) -> int:
        return _version_int(self.meta_info.weight_version, default)


@dataclass(frozen=True)
class OutputChunk:
    """What the client needs of one /generate answer or stream chunk."""

    ids: list[int]
    logprobs: list[float]  # empty when the answer carries no logprobs
    completion_tokens: int
    finish: FinishReason | None
    weight_version: str | None
    # the final chunk's exact spans: ((version, start, end), ...) over this request's output
    weight_versions: tuple[tuple[str, int, int], ...] | None = None
    # input_token_logprobs (a request with logprob_start_len): ((logprob | None, token), ...)
    input_logprobs: tuple[tuple[float | None, int], ...] | None = None

    def weight_version_int(self, default: int) -> int:
        return _version_int(self.weight_version, default)

    def versions_by_token(self, default: int, tokens: int) -> list[int] | None:
        """The version of each of this request's first `tokens` output tokens, from the spans
        (None without spans). Spans must tile 0..tokens; a token past the last span keeps the
        last span's version (SGLang clips spans to the output it counted)."""
        if not self.weight_versions:
            return None
        out: list[int] = []
        for version, start, end in self.weight_versions:
            if start != len(out) or end < start:
                raise ProtocolError(f"weight_versions spans {list(self.weight_versions)} do not "
                                    f"tile the output")
            out.extend([_version_int(version, default)] * (end - start))
        if len(out) > tokens:
            raise ProtocolError(f"weight_versions spans cover {len(out)} tokens of a "
                                f"{tokens}-token output")
        return out + out[-1:] * (tokens - len(out)) if out else None


def _version_int(version: str | None, default: int) -> int:
    """A weight version stamp as an int (rlkit stamps ints as strings); `default` when missing
    (aborted outputs may lack it) or not an integer (SGLang's initial "default")."""
    try:
        return int(version) if version is not None else default
    except ValueError:
        return default


def _output_entries(entries: Any, output_ids: Any) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of an answer's output: from output_token_logprobs (needs
    return_logprob; a real SGLang answer's output_ids can be longer than completion_tokens),
    else from output_ids (then logprobs are empty)."""
    if entries is not None:
        ids = [int(e[1]) for e in entries]
        lps = [float(e[0]) if e[0] is not None else float("nan") for e in entries]
        return ids, lps
    return [int(t) for t in output_ids or ()], []


def parse_output(payload: Any) -> OutputChunk:
    """Parse a /generate answer or chunk by hand: this runs once per streamed token per
    request, where building a pydantic model per chunk costs more than the rest of the client."""
    try:
        meta = payload["meta_info"]
        ids, lps = _output_entries(meta.get("output_token_logprobs"), payload.get("output_ids"))
        fr = meta.get("finish_reason")
        version = meta.get("weight_version")
        spans = meta.get("weight_versions")
        scored = meta.get("input_token_logprobs")
        return OutputChunk(
            ids=ids, logprobs=lps, completion_tokens=int(meta.get("completion_tokens") or 0),
            finish=FinishReason.model_validate(fr) if fr is not None else None,
            weight_version=None if version is None else str(version),
            weight_versions=None if spans is None else tuple(_span(x) for x in spans),
            input_logprobs=tuple((None if e[0] is None else float(e[0]), int(e[1]))
                                 for e in scored) if scored else None,
        )
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ProtocolError(f"unparseable /generate answer ({type(e).__name__}: {e}): "
                            f"{str(payload)[:200]}") from None


def version_spans(versions: list[str], current: str) -> list[dict[str, Any]]:
    """`weight_versions` of a final chunk: runs of equal versions over the output tokens, as
    {"version", "start", "end"}; an empty output is one empty span of `current`."""
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans or [{"version": current, "start": 0, "end": 0}]


def _span(x: Any) -> tuple[str, int, int]:
    """One `weight_versions` span: a {"version", "start", "end"} object (SGLang's JSON) or a
    [version, start, end] array (its msgspec struct is array_like)."""
    v, a, b = (x["version"], x["start"], x["end"]) if isinstance(x, dict) else x
    return str(v), int(a), int(b)


def new_output_entries(chunk: OutputChunk, received: int) -> tuple[list[int], list[float]]:
    """The output tokens of a stream chunk not received before (`received` tokens so far).

    Works for cumulative chunks (SGLang's default: every chunk repeats all entries) and
    incremental ones: `completion_tokens` is cumulative in both modes, so the new tokens are the
    last `completion_tokens - received` entries of the chunk."""
    ids, lps = chunk.ids, chunk.logprobs
    total = chunk.completion_tokens or (received + len(ids))
    fresh = max(0, total - received)
    if fresh > len(ids):
        raise ProtocolError(
            f"stream chunk claims {total} completion tokens but carries {len(ids)} entries "
            f"after {received} received: tokens were lost"
        )
    if fresh == 0:
        return [], []
    return ids[len(ids) - fresh:], lps[len(lps) - fresh:] if lps else []


def parse_sse_line(line: bytes | str) -> dict[str, Any] | None:
    """One SSE line -> its JSON payload; None for blank/comment lines and `data: [DONE]`."""
    raw = line.encode() if isinstance(line, str) else line
    raw = raw.strip()
    if not raw.startswith(b"data:"):
        return None
    data = raw[5:].strip()
    if not data or data == b"[DONE]":
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"malformed SSE data line {raw[:200]!r}: {e}") from None


class SSEDecoder:
    """Incremental SSE parser: feed raw bytes as they arrive, get the JSON payloads of the
    complete `data:` lines (reading a stream block-wise costs far less than line by line)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, block: bytes) -> list[dict[str, Any]]:
        self._buffer += block
        *lines, self._buffer = self._buffer.split(b"\n")
        out = []
        for line in lines:
            payload = parse_sse_line(line)
            if payload is not None:
                out.append(payload)
        return out

    def close(self) -> list[dict[str, Any]]:
        rest, self._buffer = self._buffer, b""
        payload = parse_sse_line(rest)
        return [payload] if payload is not None else []


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes (orjson: several times faster than json on the streaming hot path)."""
    return orjson.dumps(obj)


def error_message(body: Any) -> str | None:
    """The message of an error payload in any of SGLang's shapes, else None.
    Shapes: {"error": {"message"}}, {"error": "..."}, {"object": "error", "message"},
    {"detail": ...} (FastAPI), {"success": false, "message"}."""
    if not isinstance(body, dict):
        return None
    err = body.get("error")
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    if isinstance(err, str):
        return err
    if body.get("object") == "error" and "message" in body:
        return str(body["message"])
    if "detail" in body:
        return str(body["detail"])
    if body.get("success") is False:
        return str(body.get("message", "failed"))
    return None


def is_abort_failure(status: int, body: Any) -> bool:
    """An HTTP error answer that some SGLang versions give an aborted request."""
    if status < 400:
        return False
    msg = (error_message(body) or (body if isinstance(body, str) else "") or "").lower()
    return "abort" in msg


# -- loads ------------------------------------------------------------------------------------
def total_requests(body: Any) -> int:
    """Requests running or queued on one worker, from any known `/v1/loads` shape."""
    if isinstance(body, dict) and isinstance(body.get("loads"), list):
        entries = body["loads"]
    elif isinstance(body, list):
        entries = body
    elif isinstance(body, dict):
        entries = [body]
    else:
        raise ProtocolError(f"unrecognised loads payload: {str(body)[:200]}")
    total = 0
    for e in entries:
        if not isinstance(e, dict):
            raise ProtocolError(f"unrecognised loads entry: {str(e)[:200]}")
        if "num_reqs" in e:
            total += int(e["num_reqs"])
        elif "num_total_reqs" in e:
            total += int(e["num_total_reqs"])
        elif "num_running_reqs" in e or "num_waiting_reqs" in e:
            total += int(e.get("num_running_reqs", 0)) + int(e.get("num_waiting_reqs", 0))
        else:
            raise ProtocolError(f"loads entry without request counts: {str(e)[:200]}")
    return total


def progress_mark(body: Any) -> int | None:
    """The engine's progress mark from a `/v1/loads` answer: the sum over its entries (one per
    DP rank) of each entry's `timestamp` in microseconds, the time its scheduler last published
    the entry. SGLang 0.5.23's scheduler publishes after every prefill batch, every
    `--load-snapshot-publish-interval` (15) decode batches, and while it waits with work queued
    (LoadSnapshot, read from shared memory by the HTTP process, so the answer does not wait for
    the scheduler); the built-in engine stamps the last time its decoder moved (a loop turn, or
    a decoder layer of a forward done). So two equal marks mean the scheduler did not move in between; a stopped or
    deadlocked one never changes it. None when no entry has a timestamp (older servers, or a
    dict shape whose `timestamp` is the answer's own time): progress cannot be told."""
    if isinstance(body, dict) and isinstance(body.get("loads"), list):
        entries = body["loads"]
    elif isinstance(body, list):
        entries = body
    else:
        return None
    stamps = [e["timestamp"] for e in entries if isinstance(e, dict)
              and isinstance(e.get("timestamp"), (int, float)) and not isinstance(e["timestamp"], bool)]
    if not stamps:
        return None
    return sum(int(round(float(t) * 1e6)) for t in stamps)


# -- control ----------------------------------------------------------------------------------
class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _target(self) -> "AbortRequest":
        if not self.rid and not self.abort_all:
            raise ValueError("give a rid or abort_all=true (an empty rid would match everything)")
        return self


class PauseGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    mode: PauseMode = "abort"  # SGLang's default; rlkit's client always sends it explicitly


class LoadLoraAdapterRequest(BaseModel):
    """`POST /load_lora_adapter` (SGLang's LoadLoRAAdapterReqInput): a PEFT folder by path."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    lora_path: str
    pinned: bool = False


class LoadLoraAdapterFromTensorsRequest(BaseModel):
    """`POST /load_lora_adapter_from_tensors` (SGLang's LoadLoRAAdapterFromTensorsReqInput): the
    PEFT config and one serialized copy of the tensors per TP rank, as update_weights_from_tensor."""

    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    load_format: str | None = None
    pinned: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class InitWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # SGLang's default; CPU engines need "gloo"

    @model_validator(mode="after")
    def _rank(self) -> "InitWeightsUpdateGroupRequest":
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} >= world_size {self.world_size}")
        return self


class UpdateWeightsFromDistributedRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> "UpdateWeightsFromDistributedRequest":
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and shapes "
                f"({len(self.shapes)}) must be equally long"
            )
        return self


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    group_name: str = "weight_update_group"


class UpdateWeightVersionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    new_version: str
    abort_all_requests: bool = True  # SGLang's default (miles#2372): rlkit always sends it


def error_body(message: str, status: int) -> dict[str, Any]:
    """SGLang's ErrorResponse shape."""
    from http import HTTPStatus

    return {"object": "error", "message": message, "type": HTTPStatus(status).phrase,
            "param": None, "code": status}



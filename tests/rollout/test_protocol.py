"""The typed protocol: what the client sends validates, what SGLang answers parses, and every
version quirk resolves in one place. Contract tests against SGLang's own request schema run
where the sglang package is importable (GPU machines) and are skipped elsewhere."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rlkit.buffers.sample import Sample
from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.http.protocol import (
    AbortRequest,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    ProtocolError,
    SamplingParams,
    SSEDecoder,
    UpdateWeightsFromDistributedRequest,
    error_message,
    is_abort_failure,
    new_output_entries,
    parse_output,
    parse_sse_line,
    total_requests,
)
from tests.rollout.helpers import fixture_json, fixture_text


def _client_request(sample: Sample, sampling: SamplingConfig, max_new: int) -> dict:
    client = EngineClient("http://router.invalid")
    return client.build_request(sample, sampling, max_new, "rid-1", stream=True)


def test_client_request_is_a_resume_by_tokens():
    s = Sample(index=0, group_id=0, prompt_ids=[1, 2, 3])
    s.start_request()
    s.append([7, 8], [-0.1, -0.2], 0)
    body = _client_request(s, SamplingConfig(max_new_tokens=10, min_new_tokens=5, temperature=0.7), 8)
    assert body["input_ids"] == [1, 2, 3, 7, 8]
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 8
    assert sp["min_new_tokens"] == 3  # 5 required, 2 already generated
    assert sp["temperature"] == 0.7 and sp["top_p"] == 1.0 and sp["top_k"] == -1
    assert body["rid"] == "rid-1" and body["stream"] is True and body["return_logprob"] is True
    # what the client sends is what the server-side model accepts
    assert GenerateRequest.model_validate(body).input_ids == [1, 2, 3, 7, 8]


@pytest.mark.parametrize("bad, where", [
    ({"input_ids": "x"}, "input_ids"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"logit_bias": {"1": 2}}}, "logit_bias"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, "min_new_tokens"),
    ({"input_ids": [[1], [2]]}, "batched"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, -4]}, "negative"),
])
def test_bad_generate_requests_are_rejected_with_the_field_named(bad, where):
    with pytest.raises(ValidationError) as e:
        GenerateRequest.model_validate(bad)
    assert where in str(e.value)


def test_router_added_keys_are_ignored():
    # sglang-router 0.3.2 re-serialises /generate with these defaults (measured, docs/facts.md).
    body = {"input_ids": [1, 2], "model": None, "return_text_in_logprobs": False,
            "log_metrics": True, "return_hidden_states": False, "background": False,
            "no_logs": False, "return_bytes": False, "return_entropy": False, "stream": False}
    assert GenerateRequest.model_validate(body).input_ids == [1, 2]


def test_unsupported_penalties_are_named():
    assert SamplingParams(frequency_penalty=0.5, n=2).unsupported_by_hf() == ["frequency_penalty", "n"]
    assert SamplingParams().unsupported_by_hf() == []


def test_normal_sglang_answer_parses():
    r = GenerateResponse.model_validate(fixture_json("generate_normal.json"))
    ids, lps = r.output_entries()
    assert len(ids) == 32 and ids[0] == 12095 and lps == []  # no return_logprob: ids only
    assert r.meta_info.finish_reason.type == "length" and r.meta_info.finish_reason.length == 32
    assert r.weight_version_int(default=5) == 5  # "default" is not a number


def test_logprob_answer_prefers_output_token_logprobs():
    r = GenerateResponse.model_validate(fixture_json("generate_logprobs.json"))
    # this real answer's output_ids is longer than completion_tokens; logprob entries are right
    assert r.output_entries() == ([5338], [-0.014046513475477695])
    assert new_output_entries(parse_output(fixture_json("generate_logprobs.json")), 0) == (
        [5338], [-0.014046513475477695])


@pytest.mark.parametrize("name", ["generate_stream_cumulative.sse", "generate_stream_incremental.sse"])
def test_stream_chunks_yield_each_token_once(name):
    received, ids, lps, finish = 0, [], [], None
    for line in fixture_text(name).splitlines():
        payload = parse_sse_line(line)
        if payload is None:
            continue
        chunk = parse_output(payload)
        new_ids, new_lps = new_output_entries(chunk, received)
        ids += new_ids
        lps += new_lps
        received += len(new_ids)
        finish = chunk.finish
        # the pydantic model reads every chunk the same way
        assert GenerateResponse.model_validate(payload).meta_info.completion_tokens == chunk.completion_tokens
    assert ids == [576, 4226, 374, 220, 19]
    assert lps == [-0.51, -1.25, -0.02, -0.3, -0.01]
    assert finish.type == "stop" and finish.matched == 151645


def test_a_chunk_that_lost_tokens_is_an_error():
    chunk = parse_output({"meta_info": {"completion_tokens": 5, "output_token_logprobs": [[-1.0, 3, None]]}})
    with pytest.raises(ProtocolError, match="lost"):
        new_output_entries(chunk, 2)
    with pytest.raises(ProtocolError, match="unparseable"):
        parse_output({"meta_info": {"output_token_logprobs": [["x"]]}})


def test_sse_lines():
    assert parse_sse_line(b"data: [DONE]") is None
    assert parse_sse_line("") is None and parse_sse_line(": keep-alive") is None
    assert parse_sse_line('data: {"a": 1}\n') == {"a": 1}
    with pytest.raises(ProtocolError):
        parse_sse_line("data: {broken")


def test_abort_answers_of_every_shape():
    aborted = GenerateResponse.model_validate(fixture_json("generate_aborted.json"))
    assert aborted.meta_info.finish_reason.type == "abort"
    assert aborted.meta_info.weight_version is None  # may be missing on aborts (slime#327)
    assert aborted.output_entries()[0] == [576, 4226]
    assert is_abort_failure(500, fixture_json("abort_http_error.json"))
    assert not is_abort_failure(400, {"object": "error", "message": "bad top_k"})
    assert not is_abort_failure(200, {"meta_info": {}})


def test_error_messages_of_every_shape():
    assert error_message({"error": {"message": "m1"}}) == "m1"
    assert error_message({"object": "error", "message": "m2"}) == "m2"
    assert error_message({"detail": "m3"}) == "m3"
    assert error_message({"success": False, "message": "m4"}) == "m4"
    assert error_message({"text": "fine"}) is None


def test_loads_of_every_shape():
    assert total_requests(fixture_json("loads.json")) == 6  # 3+1 on rank 0, 0+2 on rank 1
    assert total_requests([{"num_reqs": 2}, {"num_total_reqs": 3}]) == 5
    assert total_requests({"num_running_reqs": 1}) == 1
    with pytest.raises(ProtocolError):
        total_requests({"loads": [{"token_usage": 0.1}]})


def test_control_payloads():
    assert AbortRequest(abort_all=True).model_dump() == {"rid": "", "abort_all": True}
    with pytest.raises(ValidationError, match="empty rid"):
        AbortRequest()
    with pytest.raises(ValidationError, match="rank_offset"):
        InitWeightsUpdateGroupRequest(master_address="h", master_port=1, rank_offset=2, world_size=2)
    with pytest.raises(ValidationError, match="equally long"):
        UpdateWeightsFromDistributedRequest(names=["a"], dtypes=[], shapes=[[1]])


# -- contract tests against SGLang's own schema (GPU machines) ---------------------------------
sglang_missing = importlib.util.find_spec("sglang") is None


@pytest.mark.skipif(sglang_missing, reason="sglang is not importable here (CPU machine)")
def test_client_requests_validate_against_sglang_schema():
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

    s = Sample(index=0, group_id=0, prompt_ids=[1, 2, 3])
    body = _client_request(s, SamplingConfig(max_new_tokens=16, stop=["\n\n"], stop_token_ids=[7],
                                             ignore_eos=True), 16)
    req = GenerateReqInput(**body)
    req.normalize_batch_and_arguments()
    sp = SGLangSamplingParams(**body["sampling_params"])
    sp.verify(vocab_size=1000)
    assert req.rid == "rid-1" and req.stream is True and req.return_logprob is True


@pytest.mark.skipif(sglang_missing, reason="sglang is not importable here (CPU machine)")
def test_control_payloads_validate_against_sglang_schema():
    from sglang.srt.managers import io_struct

    io_struct.AbortReq(rid="", abort_all=True)
    io_struct.PauseGenerationReqInput(mode="retract")
    io_struct.UpdateWeightFromDiskReqInput(model_path="/m", weight_version="3",
                                           abort_all_requests=False, flush_cache=False)
    io_struct.InitWeightsUpdateGroupReqInput(master_address="h", master_port=1, rank_offset=1,
                                             world_size=2, group_name="g", backend="gloo")
    io_struct.UpdateWeightsFromDistributedReqInput(names=["a"], dtypes=["float32"], shapes=[[2]],
                                                   group_name="g", flush_cache=False,
                                                   weight_version="3")


@given(st.lists(st.integers(1, 97), min_size=1, max_size=60))
def test_sse_decoder_is_indifferent_to_block_boundaries(cuts):
    raw = fixture_text("generate_stream_cumulative.sse").encode()
    whole = [p for p in (parse_sse_line(line) for line in raw.splitlines()) if p is not None]
    decoder, got, pos = SSEDecoder(), [], 0
    for cut in cuts:
        got += decoder.feed(raw[pos:pos + cut])
        pos += cut
    got += decoder.feed(raw[pos:]) + decoder.close()
    assert got == whole


def test_weight_version_spans_give_each_token_its_version():
    from rlkit.rollout.http.protocol import ProtocolError, parse_output

    def meta(spans):
        return {"meta_info": {"completion_tokens": 4, "weight_version": "7", "weight_versions": spans,
                              "output_token_logprobs": [[-0.1, t, None] for t in range(4)]}}

    chunk = parse_output(meta([{"version": "6", "start": 0, "end": 1}, {"version": "7", "start": 1, "end": 4}]))
    assert chunk.versions_by_token(default=0, tokens=4) == [6, 7, 7, 7]
    assert parse_output(meta([["default", 0, 4]])).versions_by_token(default=2, tokens=4) == [2] * 4
    # SGLang clips spans to the output it counted: a token past the last span keeps its version
    assert parse_output(meta([["6", 0, 3]])).versions_by_token(default=0, tokens=4) == [6, 6, 6, 6]
    assert parse_output({"meta_info": {"completion_tokens": 1}}).versions_by_token(0, 1) is None
    with pytest.raises(ProtocolError, match="tile"):
        parse_output(meta([["6", 1, 4]])).versions_by_token(default=0, tokens=4)
    with pytest.raises(ProtocolError, match="cover 5 tokens"):
        parse_output(meta([["6", 0, 5]])).versions_by_token(default=0, tokens=4)

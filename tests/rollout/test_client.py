"""EngineClient against scriptable fake workers: SGLang answers of every shape land on the
sample correctly, retries follow the per-endpoint policy, an aborted request is never
re-submitted, abort_all repeats until the worker is idle."""

from __future__ import annotations

import asyncio

import pytest

from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.http.client import DEFAULT_RETRY_POLICIES, EngineClient, RetryPolicy
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError, Engines
from rlkit.rollout.engines.process import free_port
from tests.rollout.fake_worker import FakeWorker, answer_json, answer_sse, tokens_chunk
from rlkit.common.engine_http import EngineControlError
from tests.rollout.helpers import EngineControls, fixture_json, fixture_text

SAMPLING = SamplingConfig(max_new_tokens=64)


def fresh() -> Sample:
    return Sample(index=0, group_id=0, prompt_ids=[1, 2, 3])


async def client_for(*workers: FakeWorker, **kw) -> EngineClient:
    return await EngineClient(None, worker_urls=[w.url for w in workers], **kw).connect()


async def test_client_implements_the_engines_protocol(worker):
    c = await client_for(worker)
    try:
        assert isinstance(c, Engines) and c.workers() == [worker.url]
    finally:
        await c.close()


@pytest.mark.parametrize("name", ["generate_stream_cumulative.sse", "generate_stream_incremental.sse"])
async def test_streamed_sglang_answers_land_on_the_sample(worker, name):
    worker.generate.append(answer_sse(fixture_text(name)))
    c = await client_for(worker)
    try:
        s = fresh()
        served = await c.generate(s, SAMPLING, max_new_tokens=10, version=2, worker=worker.url)
    finally:
        await c.close()
    assert served == worker.url
    assert s.response_ids == [576, 4226, 374, 220, 19]
    assert s.logprobs == [-0.51, -1.25, -0.02, -0.3, -0.01]
    assert s.versions == [7] * 5  # the engine's stamp wins over the caller's version
    assert s.status is SampleStatus.DONE and s.finish_reason == "stop" and s.requests == 1
    sent = worker.calls("/generate")[0]
    assert sent["input_ids"] == [1, 2, 3] and sent["stream"] is True and sent["rid"]


async def test_the_final_chunk_s_spans_restamp_every_token(worker):
    """Across two weight updates (retract/in_place pauses): chunks carry the version current
    when sent, which is wrong for tokens made before an update; the final chunk's spans (SGLang
    0.5.23, built by its srt/utils/weight_versions.py: the conformance test checks this
    fixture's spans against it) give each token its own."""
    worker.generate.append(answer_sse(fixture_text("generate_stream_weight_versions.sse")))
    c = await client_for(worker)
    try:
        s = fresh()
        await c.generate(s, SAMPLING, max_new_tokens=9, version=2, worker=worker.url)
    finally:
        await c.close()
    assert s.response_ids == list(range(11, 20))
    assert s.versions == [3, 3, 3, 3, 4, 4, 4, 5, 5]


async def test_non_streamed_answers_and_missing_version(worker):
    worker.generate.append(answer_json(fixture_json("generate_logprobs.json")))
    c = await client_for(worker, stream=False)
    try:
        s = fresh()
        await c.generate(s, SAMPLING, max_new_tokens=1, version=4, worker=worker.url)
    finally:
        await c.close()
    # "default" is not an int: the caller's version stamps the tokens
    assert s.response_ids == [5338] and s.versions == [4] and s.status is SampleStatus.TRUNCATED


@pytest.mark.parametrize("shape", ["stream", "json", "http_error"])
async def test_an_aborted_answer_leaves_the_sample_partial(worker, shape):
    if shape == "stream":
        worker.generate.append(answer_sse(fixture_text("generate_stream_aborted.sse")))
    elif shape == "json":
        worker.generate.append(answer_json(fixture_json("generate_aborted.json")))
    else:
        worker.generate.append(answer_json(fixture_json("abort_http_error.json"), status=500))
    c = await client_for(worker, stream=(shape == "stream"))
    try:
        s = fresh()
        await c.generate(s, SAMPLING, max_new_tokens=10, version=0, worker=worker.url)
    finally:
        await c.close()
    assert s.status is (SampleStatus.PENDING if shape == "http_error" else SampleStatus.PARTIAL)
    assert s.response_ids == ([] if shape == "http_error" else [576, 4226])
    assert len(worker.calls("/generate")) == 1  # never re-submitted


async def test_abort_mid_stream_keeps_tokens_and_is_not_resubmitted(worker):
    stream = "\n".join([
        tokens_chunk([11], [-0.1], total=1, finish=None),
        tokens_chunk([12], [-0.2], total=2, finish=None),
        tokens_chunk([13], [-0.3], total=3, finish=None),
    ])
    worker.generate.append(answer_sse(stream, stall_after=2))
    worker.loads_sequence = [1, 0]
    c = await client_for(worker, abort_poll_interval_s=0.01)
    try:
        s = fresh()
        task = asyncio.create_task(c.generate(s, SAMPLING, max_new_tokens=10, version=0, worker=worker.url))
        while len(s.response_ids) < 2:
            await asyncio.sleep(0.01)
        await c.abort_all()  # the worker reports 1 request, then 0: abort is sent twice
        task.cancel()  # the fake worker does not end the stream by itself
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await c.close()
    assert s.response_ids == [11, 12] and s.status is SampleStatus.PARTIAL
    assert worker.calls("/abort_request") == [{"rid": "", "abort_all": True}] * 2
    assert len(worker.calls("/generate")) == 1


async def test_cancelling_the_task_leaves_the_sample_resumable(worker):
    worker.generate.append(answer_sse(tokens_chunk([9], [-1.0], total=1, finish=None) + "\n" +
                                      tokens_chunk([8], [-1.0], total=2, finish=None), stall_after=1))
    c = await client_for(worker)
    try:
        s = fresh()
        task = asyncio.create_task(c.generate(s, SAMPLING, max_new_tokens=10, version=0, worker=worker.url))
        while not s.response_ids:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await c.close()
    assert s.status is SampleStatus.PARTIAL and s.response_ids == [9]


async def test_failures_before_any_token_are_retried(worker):
    worker.generate += [
        answer_json({"error": {"message": "no worker"}}, status=503),
        answer_sse(tokens_chunk([5], [-0.5], total=1, finish={"type": "length", "length": 1})),
    ]
    c = await client_for(worker, retry_policies={**DEFAULT_RETRY_POLICIES,
                                                 "generate": RetryPolicy(attempts=3, backoff_s=0.01, retry_statuses=frozenset({503}))})
    try:
        s = fresh()
        await c.generate(s, SAMPLING, max_new_tokens=1, version=0, worker=worker.url)
    finally:
        await c.close()
    assert s.response_ids == [5] and s.status is SampleStatus.TRUNCATED
    rids = [b["rid"] for b in worker.calls("/generate")]
    assert len(rids) == 2 and rids[0] != rids[1]  # a fresh rid per attempt


async def test_abort_all_while_waiting_to_retry_is_not_resubmitted(worker):
    worker.generate += [answer_json({"error": {"message": "no worker"}}, status=503)]
    c = await client_for(worker, retry_policies={**DEFAULT_RETRY_POLICIES,
                                                 "generate": RetryPolicy(attempts=3, backoff_s=0.5, retry_statuses=frozenset({503}))})
    try:
        s = fresh()
        task = asyncio.create_task(c.generate(s, SAMPLING, max_new_tokens=4, version=0, worker=worker.url))
        while not worker.calls("/generate"):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the 503 is answered; the client waits to retry
        await c.abort_all()
        await asyncio.wait_for(task, 5)
    finally:
        await c.close()
    assert len(worker.calls("/generate")) == 1
    assert s.status is SampleStatus.PENDING and s.response_ids == []


async def test_connection_refused_is_retried_then_reported():
    dead = f"http://127.0.0.1:{free_port()}"
    policies = {**DEFAULT_RETRY_POLICIES, "generate": RetryPolicy(attempts=2, backoff_s=0.01)}
    c = await EngineClient(None, worker_urls=[dead], retry_policies=policies).connect()
    try:
        s = fresh()
        with pytest.raises(EngineError, match="2 attempt"):
            await c.generate(s, SAMPLING, max_new_tokens=4, version=0, worker=dead)
    finally:
        await c.close()
    assert s.status is SampleStatus.PENDING


async def test_a_stream_broken_after_tokens_is_an_error_not_a_retry(worker):
    worker.generate.append(answer_sse(tokens_chunk([4], [-0.4], total=1, finish=None) + "\n" +
                                      tokens_chunk([4], [-0.4], total=2, finish=None), close_after=1))
    c = await client_for(worker)
    try:
        s = fresh()
        with pytest.raises(EngineError, match="finish reason|broke"):
            await c.generate(s, SAMPLING, max_new_tokens=10, version=0, worker=worker.url)
    finally:
        await c.close()
    assert s.response_ids == [4] and s.status is SampleStatus.PARTIAL
    assert len(worker.calls("/generate")) == 1


async def test_a_refused_request_raises_with_the_engines_message(worker):
    worker.generate.append(answer_json({"object": "error", "message": "The input (9000 tokens) is longer"}, status=400))
    c = await client_for(worker)
    try:
        with pytest.raises(EngineError, match="9000 tokens"):
            await c.generate(fresh(), SAMPLING, max_new_tokens=4, version=0, worker=worker.url)
    finally:
        await c.close()


async def test_control_calls_reach_every_worker_through_the_one_control_client():
    """The weight sync's control calls go through rlkit.common.engine_http (the one
    control client) to each worker itself; the EngineClient speaks generation only."""
    a, b = await FakeWorker().start(), await FakeWorker().start()
    ctl = EngineControls([a.url, b.url], timeout_s=10)
    c = await client_for(a, b)
    try:
        await ctl.pause("retract")
        await ctl.flush_cache()
        await ctl.update_weights_from_disk("/ckpt/v3", 3)
        await ctl.init_weights_update_group("10.0.0.1", 29500, group_name="g", backend="gloo")
        await ctl.update_weights_from_distributed(["w"], ["float32"], [[2, 2]], version=3, group_name="g")
        await ctl.continue_generation()
        assert await c.loads() == {a.url: 0, b.url: 0}
        assert await ctl.health() == {a.url: True, b.url: True}
    finally:
        await c.close()
        await a.stop()
        await b.stop()
    for w in (a, b):
        assert w.calls("/pause_generation") == [{"mode": "retract"}]
        assert w.calls("/update_weights_from_disk")[0]["weight_version"] == "3"
        assert w.calls("/update_weights_from_distributed")[0]["names"] == ["w"]
        assert len(w.calls("/continue_generation")) == 1
    ranks = [w.calls("/init_weights_update_group")[0]["rank_offset"] for w in (a, b)]
    assert ranks == [1, 2]
    assert a.calls("/init_weights_update_group")[0]["world_size"] == 3
    assert not hasattr(EngineClient, "pause") and not hasattr(EngineClient, "update_weights_from_disk")


async def test_a_failing_worker_is_named(worker):
    dead = f"http://127.0.0.1:{free_port()}"
    ctl = EngineControls([worker.url, dead], timeout_s=5)
    with pytest.raises(EngineControlError, match=dead.replace(".", r"\.")):
        await ctl.continue_generation()
    assert await ctl.health() == {worker.url: True, dead: False}


# -- engine faults (rollout.health) ---------------------------------------------------------------
async def test_probe_tells_answered_refused_and_timed_out(worker):
    async def stuck(request, body):
        await asyncio.sleep(3600)

    worker.generate += [answer_json({"text": "", "meta_info": {"finish_reason": {"type": "length"}}}),
                        stuck]
    dead = f"http://127.0.0.1:{free_port()}"
    c = await client_for(worker)
    try:
        assert await c.probe(worker.url, 5.0) is None
        assert (await c.probe(worker.url, 0.3)).startswith("timeout")
        refused = await c.probe(dead, 5.0)
        assert refused is not None and not refused.startswith("timeout")
    finally:
        await c.close()
    probe = worker.calls("/generate")[0]
    assert probe["sampling_params"]["max_new_tokens"] == 1 and probe["stream"] is False


async def test_abort_worker_ends_its_requests_keeping_their_tokens(worker):
    """A hung engine: the stream stalls after two tokens. abort_worker ends the request at once
    with WorkerLost, the sample PARTIAL with both tokens; a request on another engine goes on."""
    from rlkit.rollout.engine_api import WorkerLost

    other = await FakeWorker().start()
    stream = "\n".join(tokens_chunk([11 + i], [-0.1], total=i + 1, finish=None) for i in range(3))
    worker.generate.append(answer_sse(stream, stall_after=2))
    other.generate.append(answer_sse(stream, stall_after=1))
    c = await client_for(worker, other)
    try:
        s, t = fresh(), Sample(index=1, group_id=0, prompt_ids=[1])
        task = asyncio.create_task(c.generate(s, SAMPLING, max_new_tokens=10, version=0, worker=worker.url))
        keep = asyncio.create_task(c.generate(t, SAMPLING, max_new_tokens=10, version=0, worker=other.url))
        while len(s.response_ids) < 2 or not t.response_ids:
            await asyncio.sleep(0.01)
        assert await c.abort_worker(worker.url) == 1
        with pytest.raises(WorkerLost) as lost:
            await task
        assert lost.value.worker == worker.url
        assert not keep.done()
        keep.cancel()
        await asyncio.gather(keep, return_exceptions=True)
        await c.remove_worker(worker.url)
        assert c.workers() == [other.url]
        await c.add_worker(worker.url)
        assert c.workers() == [other.url, worker.url]
    finally:
        await c.close()
        await other.stop()
    assert s.response_ids == [11, 12] and s.status is SampleStatus.PARTIAL
    assert len(worker.calls("/generate")) == 1  # ended, never re-submitted by the client


async def test_final_chunk_weight_version_spans_restamp_the_requests_tokens(worker):
    """SGLang 0.5.23 stamps a chunk with the version when it is sent, and gives exact per-token
    spans on the final chunk: a weight update (retract/in_place) between a token's generation
    and its chunk must not credit the new version with the old weights' tokens. The spans count
    this request's output only: a resumed sample's earlier tokens keep their stamps."""
    import json

    def chunk(ids, total, version, finish=None, spans=None):
        meta = {"id": "x", "finish_reason": finish, "completion_tokens": total,
                "weight_version": version,
                "output_token_logprobs": [[-0.5, t, None] for t in ids]}
        if spans is not None:
            meta["weight_versions"] = spans
        return "data: " + json.dumps({"text": "", "meta_info": meta})

    stream = "\n".join([
        chunk([11, 12], 2, "3"),
        chunk([13], 3, "4"),  # sent after the update: token 13 is 4's, 14 and 15 too
        chunk([14, 15], 5, "4", finish={"type": "stop"},
              spans=[{"version": "3", "start": 0, "end": 3}, {"version": "4", "start": 3, "end": 5}]),
    ])
    worker.generate.append(answer_sse(stream))
    c = await client_for(worker)
    try:
        s = fresh()
        s.append([9], [-0.1], 2)  # a resumed sample: one token of version 2 from before
        s.interrupt()
        await c.generate(s, SAMPLING, max_new_tokens=10, version=3, worker=worker.url)
        assert s.response_ids == [9, 11, 12, 13, 14, 15]
        assert s.versions == [2, 3, 3, 3, 4, 4]  # token 13 was 3's, though its chunk said 4
        assert s.status is SampleStatus.DONE

        worker.generate.append(answer_sse(chunk([21, 22], 2, "5", finish={"type": "stop"},
                                                spans=[["5", 0, 1], ["4", 1, 2]])))
        bad = fresh()
        with pytest.raises(EngineError, match="decrease"):
            await c.generate(bad, SAMPLING, max_new_tokens=10, version=5, worker=worker.url)
        assert bad.status is SampleStatus.PARTIAL  # tokens kept, resumable
    finally:
        await c.close()


async def test_scoring_the_sync_check_s_probe_asks_again_when_a_step_s_abort_catches_it(worker):
    """The check after a sync scores a probe straight on each worker (EngineClient.score); in
    async mode the next step's end aborts every request on the engines, the probe's too: it is
    asked again, and an engine that keeps aborting it is an error naming the reason."""
    scored = {"text": "x", "output_ids": [7], "meta_info": {
        "id": "p", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3,
        "completion_tokens": 1, "output_token_logprobs": [[-0.5, 7, None]],
        "input_token_logprobs": [[None, 1, None], [-1.5, 2, None], [-2.5, 3, None]]}}
    worker.generate += [answer_json(fixture_json("generate_aborted.json")), answer_json(scored)]
    c = await client_for(worker)
    try:
        assert await c.score(worker.url, [1, 2, 3], temperature=1.0, adapter="policy@v2") == [-1.5, -2.5]
        sent = worker.calls("/generate")[-1]
        assert (sent["logprob_start_len"], sent["lora_path"]) == (0, "policy@v2")
        worker.generate += [answer_json(fixture_json("generate_aborted.json"))] * 5
        with pytest.raises(EngineError, match="aborted 5 times .last: Abort request"):
            await c.score(worker.url, [1, 2, 3], temperature=1.0)
    finally:
        await c.close()

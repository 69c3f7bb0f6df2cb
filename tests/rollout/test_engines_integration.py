"""The real sglang-router in front of two built-in engine servers on the tiny model, over
loopback: generation, abort with partial tokens, resume, weight updates, pause, bad requests,
a killed worker. Generation goes through the EngineClient, control calls through the one
control client (the weight sender's HttpEngine, as EngineControls). One fleet per module
keeps CI time down."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest
import torch

from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.fleet import EngineFleet
from rlkit.rollout.engines.process import free_port
from rlkit.rollout.engines.builtin.weight_receiver import create_group, destroy_group
from rlkit.common.engine_http import EngineControlError
from tests.rollout.helpers import LOGPROB_TOLERANCE, EngineControls, teacher_forced_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENGINE = EngineConfig(num_engines=2, cpu_threads=1, max_running_requests=16, startup_timeout_s=120)
ROUTER = RouterConfig(health_check_interval_s=1, health_failure_threshold=2)
PROMPTS = [[5, 9, 13, 17], [7, 7, 7], [100, 200, 300], [42, 43], [11, 12, 13, 14, 15], [300]]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory):
    with EngineFleet(str(tiny_model_dir), ENGINE, ROUTER,
                     log_dir=tmp_path_factory.mktemp("fleet-logs")) as f:
        yield f


def samples(n: int, start: int = 0) -> list[Sample]:
    return [Sample(index=start + i, group_id=i, prompt_ids=PROMPTS[i % len(PROMPTS)]) for i in range(n)]


@pytest.mark.parametrize("stream", [True, False])
async def test_generation_through_the_router(fleet, stream):
    async with fleet.client(stream=stream) as c:
        batch = samples(8)
        served = await asyncio.gather(*(
            c.generate(s, SamplingConfig(max_new_tokens=24), max_new_tokens=24, version=0)
            for s in batch))
    assert set(served) == set(fleet.worker_urls)  # round robin used both workers
    for s in batch:
        assert s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED)
        assert 1 <= len(s.response_ids) <= 24 and len(s.logprobs) == len(s.response_ids)
        assert all(lp <= 0 for lp in s.logprobs)
        s.check()


async def test_abort_keeps_partial_tokens_whose_logprobs_match_teacher_forcing(fleet, tiny_model):
    sampling = SamplingConfig(max_new_tokens=300, ignore_eos=True, temperature=1.0)
    async with fleet.client(abort_poll_interval_s=0.05) as c:
        batch = samples(4)
        tasks = [asyncio.create_task(c.generate(s, sampling, max_new_tokens=300, version=0))
                 for s in batch]
        while min(len(s.response_ids) for s in batch) < 5:
            await asyncio.sleep(0.01)
        await c.abort_all()
        await asyncio.gather(*tasks)
        assert set((await c.loads()).values()) == {0}
        partial = {s.index: list(s.response_ids) for s in batch}
        for s in batch:
            assert s.status is SampleStatus.PARTIAL and 5 <= len(s.response_ids) < 300
            ref = teacher_forced_logprobs(tiny_model, s.prompt_ids, s.response_ids)
            assert max(abs(a - b) for a, b in zip(ref, s.logprobs)) < LOGPROB_TOLERANCE

        # Resume: prompt + partial as input_ids, the remaining budget; the response continues.
        await asyncio.gather(*(
            c.generate(s, sampling, max_new_tokens=s.remaining_tokens(40), version=0)
            for s in batch if s.remaining_tokens(40) > 0))
    for s in batch:
        assert s.response_ids[:len(partial[s.index])] == partial[s.index]
        if len(partial[s.index]) < 40:
            assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 40
            assert s.requests == 2
            ref = teacher_forced_logprobs(tiny_model, s.prompt_ids, s.response_ids)
            assert max(abs(a - b) for a, b in zip(ref, s.logprobs)) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("stream", [True, False])
async def test_a_resumed_sample_is_rescored_and_cut_past_the_bound(fleet, stream):
    """rollout.max_resume_log_ratio through the router and the built-in engine: a resumed
    request asks for the parked tokens' input logprobs; the client records their mean log-ratio
    against the recorded ones and, past the bound, cuts the request before keeping anything.
    Here the engine's weights are those that generated the tokens, so a recorded logprob
    shifted by d reads as a log-ratio of exactly d."""
    sampling = SamplingConfig(max_new_tokens=30, ignore_eos=True)
    async with fleet.client(stream=stream) as c:
        first = samples(3, start=200)
        await asyncio.gather(*(c.generate(s, sampling, max_new_tokens=8, version=0)
                               for s in first))
    shifts = [0.0, 0.3, -0.3]
    parked = []
    for s, shift in zip(first, shifts):
        p = Sample(index=s.index + 10, group_id=s.group_id, prompt_ids=s.prompt_ids)
        p.append(s.response_ids, [lp - shift for lp in s.logprobs], 0)
        p.interrupt()
        parked.append(p)
    async with fleet.client(stream=stream, max_resume_log_ratio=0.2) as c:
        await asyncio.gather(*(c.generate(p, sampling, max_new_tokens=22, version=1)
                               for p in parked))
        # the cut requests are gone: the engine aborts each when its connection closes, which
        # it learns after the client returns, so wait for that (a condition, not a duration)
        deadline = time.monotonic() + 60
        while set((await c.loads()).values()) != {0}:
            assert time.monotonic() < deadline, "a cut request still runs on its engine"
            await asyncio.sleep(0.05)
    for p, s, shift in zip(parked, first, shifts):
        assert p.resume_log_ratio == pytest.approx(shift, abs=LOGPROB_TOLERANCE)
        assert p.resumes == 1
    assert parked[0].status is SampleStatus.TRUNCATED and len(parked[0].response_ids) == 30
    assert parked[0].response_ids[:8] == first[0].response_ids
    for p, s in zip(parked[1:], first[1:]):
        assert p.status is SampleStatus.PARTIAL and p.response_ids == s.response_ids


async def test_trace_replay_lengths_are_exact_through_the_router(fleet):
    lengths = [3, 17, 1, 40, 9, 26, 2, 33]
    sampling = SamplingConfig(max_new_tokens=64, ignore_eos=True)
    async with fleet.client() as c:
        batch = samples(len(lengths), start=100)
        await asyncio.gather(*(c.generate(s, sampling, max_new_tokens=n, version=0)
                               for s, n in zip(batch, lengths)))
    assert [len(s.response_ids) for s in batch] == lengths


async def test_pause_in_place_freezes_and_continue_resumes(fleet):
    sampling = SamplingConfig(max_new_tokens=400, ignore_eos=True)
    ctl = EngineControls(fleet.worker_urls)
    async with fleet.client() as c:
        s = samples(1)[0]
        worker = fleet.worker_urls[0]
        task = asyncio.create_task(c.generate(s, sampling, max_new_tokens=400, version=0, worker=worker))
        while len(s.response_ids) < 5:
            await asyncio.sleep(0.01)
        await ctl.pause("in_place")
        frozen = len(s.response_ids)
        await asyncio.sleep(0.3)
        assert len(s.response_ids) == frozen and not task.done()
        assert (await c.loads())[worker] == 1
        with pytest.raises(EngineControlError, match="flush_cache"):  # KV held in place: refused
            await ctl.flush_cache()
        await ctl.continue_generation()
        await task
    assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 400


async def test_pause_retract_frees_kv_and_continues_the_same_request(fleet):
    sampling = SamplingConfig(max_new_tokens=300, ignore_eos=True)
    ctl = EngineControls(fleet.worker_urls)
    async with fleet.client() as c:
        s = samples(1)[0]
        task = asyncio.create_task(c.generate(s, sampling, max_new_tokens=300, version=0,
                                              worker=fleet.worker_urls[1]))
        while len(s.response_ids) < 5:
            await asyncio.sleep(0.01)
        await ctl.pause("retract")
        await ctl.flush_cache()  # nothing holds KV any more
        await ctl.continue_generation()
        await task
    assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) == 300 and s.requests == 1


def _perturbed_copy(model_dir, out_dir) -> str:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(123)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" not in name:
                p.add_(0.05 * torch.randn_like(p))
    m.save_pretrained(out_dir)
    return str(out_dir)


async def _greedy(c: EngineClient, n: int = 2) -> list[Sample]:
    batch = samples(n, start=500)
    await asyncio.gather(*(c.generate(s, SamplingConfig(max_new_tokens=12, top_k=1,
                                                        ignore_eos=True), max_new_tokens=12, version=0)
                           for s in batch))
    return batch


async def test_weight_update_from_disk_changes_outputs_and_version(fleet, tiny_model_dir, tmp_path):
    new_weights = _perturbed_copy(tiny_model_dir, tmp_path / "v5")
    ctl = EngineControls(fleet.worker_urls)
    async with fleet.client() as c:
        before = await _greedy(c)
        await ctl.pause("abort")
        await ctl.flush_cache()
        await ctl.update_weights_from_disk(new_weights, 5)
        await ctl.continue_generation()
        after = await _greedy(c)
        assert await ctl.weight_versions() == {w: "5" for w in fleet.worker_urls}
        # restore the original weights for the other tests
        await ctl.pause("abort")
        await ctl.update_weights_from_disk(str(tiny_model_dir), 6)
        await ctl.continue_generation()
        restored = await _greedy(c)
        with pytest.raises(EngineControlError, match="does not exist"):
            await ctl.update_weights_from_disk(str(tmp_path / "nope"), 7)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.versions == [5] * 12 for s in after)
    assert [s.response_ids for s in restored] == [s.response_ids for s in before]


async def test_distributed_weight_update_in_buckets(fleet, tiny_model, tmp_path):
    """This process plays the trainer: rank 0 of a gloo group, broadcasting each bucket's
    tensors while the engines receive them (as train/weight_sync does)."""
    port, group_name = free_port(), "rlkit-test"
    holder: dict[str, object] = {}

    def join() -> None:
        holder["pg"] = create_group(master_address="127.0.0.1", master_port=port, rank=0,
                                    world_size=3, group_name=group_name, backend="gloo", timeout_s=60)

    def broadcast(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            torch.distributed.broadcast(t, src=0, group=holder["pg"])

    state = {n: t.detach().clone() for n, t in tiny_model.state_dict().items()
             if n != "lm_head.weight"}  # tied to embed_tokens
    torch.manual_seed(7)
    new_state = {n: t + 0.05 * torch.randn_like(t) if "norm" not in n else t for n, t in state.items()}
    names = sorted(new_state)
    buckets = [names[i:i + 7] for i in range(0, len(names), 7)]

    async def push(tensors: dict[str, torch.Tensor], version: int) -> None:
        await ctl.begin_weight_update()
        for bucket in buckets:
            thread = threading.Thread(target=broadcast, args=([tensors[n] for n in bucket],))
            thread.start()
            await ctl.update_weights_from_distributed(
                bucket, ["float32"] * len(bucket), [list(tensors[n].shape) for n in bucket],
                version=version, group_name=group_name)
            thread.join()
        await ctl.end_weight_update()

    ctl = EngineControls(fleet.worker_urls)
    async with fleet.client() as c:
        before = await _greedy(c)
        joiner = threading.Thread(target=join)
        joiner.start()
        await ctl.init_weights_update_group("127.0.0.1", port, group_name=group_name, backend="gloo")
        joiner.join()
        await ctl.pause("abort")
        await push(new_state, 8)
        await ctl.continue_generation()
        after = await _greedy(c)

        # A bucket naming an unknown parameter is drained (no hang) and refused.
        thread = threading.Thread(target=broadcast, args=([torch.zeros(3)],))
        thread.start()
        with pytest.raises(EngineControlError, match="unknown parameter"):
            await ctl.update_weights_from_distributed(["not.a.weight"], ["float32"], [[3]],
                                                      version=8, group_name=group_name)
        thread.join()

        await push(state, 9)  # restore
        restored = await _greedy(c)
        await ctl.destroy_weights_update_group(group_name)
    destroy_group(holder["pg"])
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.versions == [8] * 12 for s in after)
    assert [s.response_ids for s in restored] == [s.response_ids for s in before]
    assert all(s.versions == [9] * 12 for s in restored)


async def test_bad_requests_get_4xx_with_a_message_and_the_server_keeps_serving(fleet):
    worker, router = fleet.worker_urls[0], fleet.router.url
    cases = [
        (worker, {"input_ids": "oops"}, 400, "input_ids"),
        (router, {"input_ids": "oops"}, 422, "input_ids"),
        (worker, {"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, 400, "max_new_tokens"),
        (worker, {"input_ids": [1], "model": "no-such-model"}, 404, "no-such-model"),
        (router, {"input_ids": [1], "model": "no-such-model"}, 404, "no-such-model"),
        (worker, {"input_ids": [1] * 5000}, 400, "context length"),
        (router, {"input_ids": [1], "sampling_params": {"max_new_tokens": 10_000}}, 400, "context length"),
        (worker, {"input_ids": [10_000]}, 400, "vocabulary"),
        (worker, {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.3}}, 400, "frequency_penalty"),
        (worker, {"input_ids": [1], "sampling_params": {"no_such_param": 1}}, 400, "no_such_param"),
        (worker, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, 400,
         "logprob_start_len (2) must be -1 or in [0, 2)"),
        (worker, {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 0,
                  "sampling_params": {"max_new_tokens": 0}}, 400, "prefill-only scoring"),
    ]
    async with aiohttp.ClientSession() as http:
        for base, body, status, needle in cases:
            async with http.post(f"{base}/generate", json=body) as r:
                text = await r.text()
                assert r.status == status, (body, text)
                assert needle in text, (body, text)
        async with http.post(f"{worker}/generate", data=b"{not json",
                             headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "JSON" in await r.text()
        async with http.post(f"{worker}/abort_request", json={}) as r:
            assert r.status == 400
        for stream in (False, True):  # max_new_tokens 0: an immediate, empty answer
            async with http.post(f"{worker}/generate", json={
                    "input_ids": [1, 2], "stream": stream,
                    "sampling_params": {"max_new_tokens": 0}}) as r:
                text = await r.text()
                assert r.status == 200 and '"length"' in text and '"completion_tokens":0' in text.replace(" ", "")
        for base in (worker, router):
            async with http.get(f"{base}/health") as r:
                assert r.status == 200
    async with fleet.client() as c:
        ok = samples(2)
        await asyncio.gather(*(c.generate(s, SamplingConfig(max_new_tokens=4), max_new_tokens=4,
                                          version=0) for s in ok))
    assert all(len(s.response_ids) >= 1 for s in ok)


async def test_router_worker_management(fleet):
    router, (a, b) = fleet.router, fleet.worker_urls
    assert {w.url for w in router.list_workers()} == {a, b}
    router.remove_worker(a)
    try:
        assert [w.url for w in router.list_workers()] == [b]
        async with EngineClient(router.url, worker_urls=[b]) as c:
            served = await asyncio.gather(*(c.generate(s, SamplingConfig(max_new_tokens=3),
                                                       max_new_tokens=3, version=0)
                                            for s in samples(4)))
        assert set(served) == {b}
    finally:
        router.add_worker(a)
    assert {w.url for w in router.list_workers()} == {a, b}


# -- a killed worker (its own fleet: it breaks the fleet) ---------------------------------------
async def test_a_killed_worker_is_reported_and_the_router_retries_elsewhere(tiny_model_dir, tmp_path):
    with EngineFleet(str(tiny_model_dir), ENGINE, ROUTER, log_dir=tmp_path) as f:
        victim, survivor = f.engines[0], f.worker_urls[1]
        ctl = EngineControls(f.worker_urls)
        async with f.client() as c:
            victim.kill()
            assert await ctl.health() == {victim.url: False, survivor: True}
            batch = samples(6)
            served = await asyncio.gather(*(c.generate(s, SamplingConfig(max_new_tokens=5),
                                                       max_new_tokens=5, version=0) for s in batch))
            assert set(served) == {survivor}  # requests routed to the dead one were retried
            assert all(s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED) for s in batch)
            with pytest.raises(EngineError, match=victim.url.replace(".", r"\.")):
                await c.loads()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            health = {w.url: w.is_healthy for w in f.router.list_workers()}
            if health.get(victim.url) is False:
                break
            await asyncio.sleep(0.5)
        assert health == {victim.url: False, survivor: True}


async def test_the_trainers_weight_sender_drives_these_engines(fleet, tiny_model, tmp_path):
    """Contract test with the other side: the rollout side's EngineUpdates opens each update
    and train/weight_sync's WeightSender (what the trainer runs) publishes into it, over the
    distributed and the disk path, on the built-in engines."""
    from rlkit.rollout.engine_updates import EngineUpdates

    sender_mod = pytest.importorskip("rlkit.train.weight_sync.sender")
    sender = sender_mod.WeightSender(bucket_mb=1, timeout_s=120)
    by_broadcast = EngineUpdates(method="distributed", pause_mode="retract", timeout_s=120)
    by_disk = EngineUpdates(method="disk", pause_mode="retract", timeout_s=120)
    try:
        async with fleet.client() as c:
            before = await _greedy(c)
            torch.manual_seed(3)
            new = [(n, t + 0.05 * torch.randn_like(t)) for n, t in tiny_model.state_dict().items()
                   if n != "lm_head.weight"]
            report = await asyncio.to_thread(by_broadcast.run, fleet.worker_urls, 11,
                                             lambda u: sender.sync_distributed(u, new))
            after = await _greedy(c)
            await asyncio.to_thread(by_disk.run, fleet.worker_urls, 12, lambda u: sender.sync_from_disk(
                u, tmp_path / "w12", write=lambda p: tiny_model.save_pretrained(p)))
            restored = await _greedy(c)
    finally:
        await asyncio.to_thread(sender.close)
    assert report.tensors == len(new)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.versions == [11] * 12 for s in after)
    assert [s.response_ids for s in restored] == [s.response_ids for s in before]
    assert all(s.versions == [12] * 12 for s in restored)


async def test_each_token_carries_the_version_of_the_weights_that_made_it(fleet, tiny_model,
                                                                          tiny_model_dir, tmp_path):
    """A weight update in the middle of a streamed request (pause retract -> update -> continue):
    tokens before it carry the old version and old-weight logprobs, tokens after it the new
    ones, even though a chunk holds several tokens (stream interval 8)."""
    from transformers import AutoModelForCausalLM

    new_dir = _perturbed_copy(tiny_model_dir, tmp_path / "v77")
    new_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    sampling = SamplingConfig(max_new_tokens=160, ignore_eos=True)
    ctl = EngineControls(fleet.worker_urls)
    async with fleet.client() as c:
        old_version = int((await ctl.weight_versions())[fleet.worker_urls[0]])
        s = samples(1)[0]
        task = asyncio.create_task(c.generate(s, sampling, max_new_tokens=160, version=0,
                                              worker=fleet.worker_urls[0]))
        while len(s.response_ids) < 20:
            await asyncio.sleep(0.005)
        await ctl.pause("retract")
        await ctl.flush_cache()
        await ctl.update_weights_from_disk(new_dir, 77)
        await ctl.continue_generation()
        await task
        await ctl.pause("abort")  # restore the original weights for the other tests
        await ctl.update_weights_from_disk(str(tiny_model_dir), old_version + 1)
        await ctl.continue_generation()
    k = s.versions.index(77)
    assert k >= 20 and s.versions == [old_version] * k + [77] * (160 - k)
    old_ref = teacher_forced_logprobs(tiny_model, s.prompt_ids, s.response_ids[:k])
    assert max(abs(a - b) for a, b in zip(old_ref, s.logprobs[:k])) < LOGPROB_TOLERANCE
    new_ref = teacher_forced_logprobs(new_model, s.prompt_ids, s.response_ids)[k:]
    assert max(abs(a - b) for a, b in zip(new_ref, s.logprobs[k:])) < LOGPROB_TOLERANCE

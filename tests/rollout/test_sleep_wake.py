"""Sleep and wake of the built-in engine: SGLang's /release_memory_occupation and
/resume_memory_occupation on a real engine process (the tiny model), driven through the one
control client (HttpEngine), plus the decoder's host-backup mode in process.

What is checked (docs/engines.md, "Sleep and wake"): a release frees exactly the parameter bytes
and the KV cache's bytes and /server_info shows it; requests that arrive while asleep are queued
and answered after the wake; /health stays 200 and /health_generate is 503 while asleep; a weight
update is refused while the weights are released and lands while the KV cache still is (and its
flush allocates nothing); the staged wake (weights, update, kv_cache) gives greedy tokens
identical to before the sleep; a release is refused, with SGLang's message, while requests run
(paused in place or not) and allowed once they are retracted to the queue."""

from __future__ import annotations

import asyncio
import copy
import json
import time
import urllib.error
import urllib.request

import aiohttp
import pytest

from rlkit.rollout.engines.config import EngineConfig
from rlkit.rollout.engines.process import start_hf_server
from rlkit.common.engine_http import EngineControlError, HttpEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENGINE = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=8, startup_timeout_s=120)
PROMPTS = [[5, 9, 13, 17], [7, 7, 7], [100, 200, 300]]
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]
NOT_IDLE = "release_memory_occupation should be called only when server is idle."


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    proc = start_hf_server(str(tiny_model_dir), ENGINE,
                           log_path=tmp_path_factory.mktemp("sleep-wake") / "engine.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def ctl(engine) -> HttpEngine:
    return HttpEngine(engine.url, timeout_s=120)


def param_bytes(model) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings are one)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def memory(engine) -> dict:
    status, body = get(f"{engine.url}/server_info")
    assert status == 200
    return json.loads(body)["memory_occupation"]


def loads(engine) -> dict:
    return json.loads(get(f"{engine.url}/v1/loads")[1])["loads"][0]


async def until(condition, timeout_s: float = 60.0) -> None:
    """Wait for a condition on the engine's state (checked in a thread: the calls block)."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def generate(session: aiohttp.ClientSession, engine, prompt, n: int = 16) -> dict:
    body = {"input_ids": prompt, "stream": False,
            "sampling_params": {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}}
    async with session.post(f"{engine.url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def greedy(session, engine) -> list[list[int]]:
    answers = await asyncio.gather(*(generate(session, engine, p) for p in PROMPTS))
    return [a["output_ids"] for a in answers]


async def test_release_all_then_staged_wake_frees_memory_queues_requests_and_generates_the_same(
        engine, ctl, tiny_model, tiny_model_dir):
    async with aiohttp.ClientSession() as session:
        before = await greedy(session, engine)
        awake = memory(engine)
        assert awake["released"] == [] and not awake["asleep"]
        assert awake["weights_bytes"] == param_bytes(tiny_model) > 0
        kv_bytes = awake["kv_cache_bytes"]
        assert kv_bytes > 0

        # Sleep: everything (tags None). Freed: exactly the parameters and the KV buffers.
        report = await asyncio.to_thread(ctl.release_memory)
        assert report["success"] and report["tags"] == ALL_TAGS
        assert report["freed_bytes"] == {"kv_cache": kv_bytes, "weights": param_bytes(tiny_model),
                                         "cuda_graph": 0}
        assert "rss" in report["before"] and "rss" in report["after"]
        asleep = memory(engine)
        assert asleep["released"] == ALL_TAGS and asleep["asleep"]
        assert asleep["weights_bytes"] == 0 and asleep["kv_cache_bytes"] == 0
        print(f"\nrelease: freed {report['freed_bytes']}; rss {report['before']['rss']} -> "
              f"{report['after']['rss']}")

        # Alive but asleep: /health 200, /health_generate 503 saying why.
        assert get(f"{engine.url}/health") == (200, "OK")
        status, body = get(f"{engine.url}/health_generate")
        assert status == 503 and "asleep" in body and "resume_memory_occupation" in body

        # A request that arrives now is queued, not refused.
        queued = asyncio.create_task(generate(session, engine, PROMPTS[0]))
        await until(lambda: loads(engine)["num_waiting_reqs"] == 1)
        assert not queued.done() and loads(engine)["num_running_reqs"] == 0

        # A weight update cannot land in released weights.
        with pytest.raises(EngineControlError, match="weights are released"):
            await asyncio.to_thread(ctl.update_from_disk, str(tiny_model_dir), 1)

        # Staged wake as verl does: weights, the weight update, then the KV cache.
        report = await asyncio.to_thread(ctl.resume_memory, ["weights"])
        assert report["resumed_bytes"] == {"weights": param_bytes(tiny_model)}
        state = memory(engine)
        assert state["released"] == ["kv_cache", "cuda_graph"] and state["weights_stale"]
        assert state["stale_parameters"] == len(list(tiny_model.parameters()))
        assert "weight update" in report["message"]

        # The update (flush_cache true, as the weight sender sends it) lands while the KV
        # cache is still released, and its flush allocates no KV.
        await asyncio.to_thread(ctl.update_from_disk, str(tiny_model_dir), 1)
        state = memory(engine)
        assert not state["weights_stale"] and state["kv_cache_bytes"] == 0 and state["asleep"]
        assert loads(engine)["num_waiting_reqs"] == 1 and not queued.done()  # still asleep

        report = await asyncio.to_thread(ctl.resume_memory, ["kv_cache", "cuda_graph"])
        assert report["resumed_bytes"] == {"kv_cache": kv_bytes, "cuda_graph": 0}
        state = memory(engine)
        assert state["released"] == [] and not state["asleep"]
        assert state["weights_bytes"] == param_bytes(tiny_model)
        assert get(f"{engine.url}/health_generate") == (200, "OK")

        # The queued request was answered after the wake, with the same greedy tokens as
        # before the sleep, stamped with the new version; so is everything after.
        answer = await queued
        assert answer["output_ids"] == before[0]
        assert answer["meta_info"]["weight_version"] == "1"
        assert await greedy(session, engine) == before
    assert ctl.gpu_ids() == []  # a CPU engine names no GPU (the NCCL check's input)


async def test_release_is_refused_while_requests_run_and_allowed_once_they_are_retracted(
        engine, ctl, tiny_model_dir):
    async with aiohttp.ClientSession() as session:
        long = asyncio.create_task(generate(session, engine, PROMPTS[1], n=1500))
        await until(lambda: loads(engine)["num_running_reqs"] == 1)

        # Running, not paused: refused with SGLang's message (SGLang's scheduler asserts).
        with pytest.raises(EngineControlError, match="HTTP 400") as refused:
            await asyncio.to_thread(ctl.release_memory)
        assert NOT_IDLE in str(refused.value) and "1 requests running" in str(refused.value)

        # Paused in place, the request still holds its KV: refused too.
        await asyncio.to_thread(ctl.pause, "in_place")
        with pytest.raises(EngineControlError, match="paused in_place"):
            await asyncio.to_thread(ctl.release_memory, ["kv_cache"])
        assert memory(engine)["released"] == []  # nothing was released

        # Retracted to the queue (its KV freed, its tokens kept): allowed, as SGLang allows
        # queued requests while paused.
        await asyncio.to_thread(ctl.continue_generation)
        await asyncio.to_thread(ctl.pause, "retract")
        assert loads(engine)["num_waiting_reqs"] == 1
        report = await asyncio.to_thread(ctl.release_memory, ALL_TAGS)
        assert report["freed_bytes"]["weights"] > 0 and memory(engine)["asleep"]

        # Wake and continue: the same request finishes with all its tokens.
        await asyncio.to_thread(ctl.resume_memory, ["weights"])
        await asyncio.to_thread(ctl.update_from_disk, str(tiny_model_dir), 2)
        await asyncio.to_thread(ctl.resume_memory, ["kv_cache", "cuda_graph"])
        assert not long.done()  # still paused
        await asyncio.to_thread(ctl.continue_generation)
        answer = await long
        assert len(answer["output_ids"]) == 1500
        assert answer["meta_info"]["finish_reason"]["type"] == "length"


async def test_memory_endpoints_read_bodies_as_sglang_does(engine, ctl, tiny_model_dir):
    url = engine.url
    async with aiohttp.ClientSession() as session:
        # tags [] means all, as null does; a second release frees nothing and succeeds.
        async with session.post(f"{url}/release_memory_occupation", json={"tags": []}) as r:
            first = await r.json()
            assert r.status == 200 and first["tags"] == ALL_TAGS
        async with session.post(f"{url}/release_memory_occupation",
                                json={"tags": ["weights"], "rid": None}) as r:
            again = await r.json()
            assert r.status == 200 and again["freed_bytes"] == {"weights": 0}
        # Unknown tags and wrong types: 400 with a message, nothing changes.
        async with session.post(f"{url}/resume_memory_occupation", json={"tags": ["weight"]}) as r:
            assert r.status == 400 and "unknown memory tags ['weight']" in (await r.json())["message"]
        async with session.post(f"{url}/resume_memory_occupation", json={"tags": "weights"}) as r:
            assert r.status == 400 and "list of strings" in await r.text()
        assert memory(engine)["released"] == ALL_TAGS
        # SGLang also routes GET; an empty body means all tags.
        async with session.get(f"{url}/resume_memory_occupation") as r:
            body = await r.json()
            assert r.status == 200 and body["tags"] == ALL_TAGS
            assert body["resumed_bytes"]["weights"] > 0 and body["resumed_bytes"]["kv_cache"] > 0
        # Resuming what is resident is left as it is.
        report = await asyncio.to_thread(ctl.resume_memory, ["kv_cache"])
        assert report["resumed_bytes"] == {"kv_cache": 0}
    # The weights came back without their values (no host backup): asleep until they are loaded.
    state = memory(engine)
    assert state["released"] == [] and state["weights_stale"] and state["asleep"]
    await asyncio.to_thread(ctl.update_from_disk, str(tiny_model_dir), 3)
    assert not memory(engine)["asleep"]


def test_weights_cpu_backup_restores_the_values_without_a_weight_update(tiny_model):
    """SGLang's --enable-weights-cpu-backup: the decoder keeps a host copy of the released
    weights and puts it back on resume (in process, on a copy of the model)."""
    from rlkit.rollout.engines.builtin.batched_decoder import BatchedDecoder, DecodeParams, DecodeRequest

    model = copy.deepcopy(tiny_model)
    decoder = BatchedDecoder(model, eos_token_ids={0}, weights_cpu_backup=True)
    decoder.start()

    def run(rid: str) -> list[int]:
        r = DecodeRequest(rid=rid, input_ids=PROMPTS[0], params=DecodeParams(
            max_new_tokens=12, ignore_eos=True, temperature=0.0))
        decoder.submit(r)
        deadline = time.monotonic() + 60
        while not r.finished:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return r.output_ids

    try:
        before = run("a")
        freed = decoder.release_memory(["weights"]).result()["freed_bytes"]
        assert freed == {"weights": param_bytes(tiny_model)}
        assert all(p.numel() == 0 for p in model.parameters())
        assert decoder.resume_memory(None).result()["resumed_bytes"]["weights"] == param_bytes(tiny_model)
        assert not decoder.memory_state()["weights_stale"]
        assert run("b") == before
    finally:
        decoder.stop()


def test_kv_cache_release_frees_its_buffers_and_resume_restores_their_shape():
    import torch

    from rlkit.rollout.engines.builtin.kv_cache import SlotKVCache

    cache = SlotKVCache(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu",
                        slots=4, capacity=16)
    size = 2 * 2 * 4 * 2 * 16 * 8 * 4  # layers x (k, v) x slots x heads x capacity x dim x 4 B
    assert cache.nbytes == size
    cache.lengths = [3]  # a cached row: nothing may be released under it
    with pytest.raises(RuntimeError, match="1 rows are cached"):
        cache.release()
    cache.clear()
    assert cache.release() == size and cache.released and cache.nbytes == 0
    assert cache.release() == 0
    with pytest.raises(RuntimeError, match="released"):
        cache.reserve(1, 1)
    assert cache.resume() == size and not cache.released
    assert (cache.slots, cache.capacity) == (4, 16) and cache.resume() == 0


async def test_the_memory_endpoints_are_behind_the_control_token():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from rlkit.rollout.engines.builtin.hf_server import _auth_middleware

    MEMORY_PATHS = ("/release_memory_occupation", "/resume_memory_occupation")

    async def ok(request):
        return web.Response(text="OK")

    app = web.Application(middlewares=[_auth_middleware("secret")])
    for path in MEMORY_PATHS:
        app.router.add_post(path, ok)
    async with TestClient(TestServer(app)) as client:
        for path in sorted(MEMORY_PATHS):
            assert (await client.post(path, json={})).status == 401
            assert (await client.post(path, json={}, headers={"Authorization": "Bearer x"})).status == 403
            assert (await client.post(path, json={},
                                      headers={"Authorization": "Bearer secret"})).status == 200

"""LoRA adapters in the built-in engine over real HTTP (SGLang's endpoints): an adapter loaded from
tensors (the trainer's in-memory path) or from a PEFT folder answers with the merged model's
logprobs; two adapters and the base model serve requests by name in one batch; an adapter a
request still names cannot be unloaded; unknown adapters and bad tensors are refused with the
reason."""

from __future__ import annotations

import asyncio
import base64

import aiohttp
import pytest
import torch

from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.fleet import EngineFleet
from rlkit.train.megatron.lora import peft_tensor_names, write_peft_folder
from rlkit.train.weight_sync.in_memory import serialize_named_tensors
from tests.rollout.helpers import LOGPROB_TOLERANCE, teacher_forced_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENGINE = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=16, startup_timeout_s=120)
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 9, 13, 17, 21]


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    with EngineFleet(str(tiny_model_dir), ENGINE, RouterConfig(),
                     log_dir=tmp_path_factory.mktemp("lora-logs")) as f:
        yield f.worker_urls[0], f


def random_adapter(model, seed: int, rank: int = 4, alpha: float = 8.0):
    """PEFT tensors for every layer's linear modules, B not zero (a trained adapter)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in MODULES:
            a_name, b_name = peft_tensor_names(name)
            tensors[a_name] = torch.randn(rank, module.in_features, generator=g) * 0.3
            tensors[b_name] = torch.randn(module.out_features, rank, generator=g) * 0.3
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": MODULES}
    return config, tensors


def merged(model, config, tensors):
    """The base model with W + (alpha / r) B A: what an adapter request must sample from."""
    import copy

    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    scale = config["lora_alpha"] / config["r"]
    with torch.no_grad():
        for name in {n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in tensors}:
            a_name, b_name = peft_tensor_names(name)
            modules[name].weight += scale * tensors[b_name] @ tensors[a_name]
    return out


async def post(session, url, path, body):
    async with session.post(url + path, json=body) as r:
        return r.status, await r.json()


async def generate(session, url, lora=None, max_new=12, ignore_eos=False):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 1.0,
                                "ignore_eos": ignore_eos}}
    if lora is not None:
        body["lora_path"] = lora
    return await post(session, url, "/generate", body)


async def holds_a_request(session, url) -> bool:
    async with session.get(url + "/v1/loads") as r:
        load = (await r.json())["loads"][0]
    return load["num_running_reqs"] + load["num_waiting_reqs"] > 0


def tokens_and_logprobs(answer):
    pairs = answer["meta_info"]["output_token_logprobs"]
    return [t for _, t, _ in pairs], [lp for lp, _, _ in pairs]


def check_sampled_from(model, answer):
    ids, lps = tokens_and_logprobs(answer)
    ref = teacher_forced_logprobs(model, PROMPT, ids)
    return max(abs(a - b) for a, b in zip(ref, lps))


async def test_adapters_by_name_beside_the_base_model(engine, tiny_model, tmp_path):
    url, _ = engine
    cfg1, t1 = random_adapter(tiny_model, 1)
    cfg2, t2 = random_adapter(tiny_model, 2)
    folder = write_peft_folder(tmp_path / "two", t2, cfg2)
    keep = list(t1.items())  # the shared-memory handles must outlive the load
    body = {"lora_name": "policy@v1", "config_dict": cfg1, "serialized_named_tensors": [
        base64.b64encode(serialize_named_tensors(keep)).decode()]}
    async with aiohttp.ClientSession() as s:
        status, out = await post(s, url, "/load_lora_adapter_from_tensors", body)
        assert (status, out["success"]) == (200, True), out
        status, out = await post(s, url, "/load_lora_adapter",
                                 {"lora_name": "policy@v2", "lora_path": str(folder)})
        assert (status, out["success"]) == (200, True), out
        assert out["loaded_adapters"] == {"policy@v1": "__tensor__", "policy@v2": str(folder)}
        # one batch: base, adapter 1 and adapter 2 requests at once
        answers = await asyncio.gather(*(generate(s, url, lora) for lora in
                                         (None, "policy@v1", "policy@v2") * 3))
    for (status, answer), model in zip(answers, [tiny_model, merged(tiny_model, cfg1, t1),
                                                 merged(tiny_model, cfg2, t2)] * 3):
        assert status == 200
        assert check_sampled_from(model, answer) < LOGPROB_TOLERANCE
    # and not from the base model (the adapters change the distribution)
    assert check_sampled_from(tiny_model, answers[1][1]) > 1e-2


async def test_an_adapter_in_use_cannot_be_unloaded_and_unknown_ones_are_refused(engine, tiny_model):
    url, _ = engine
    cfg, t = random_adapter(tiny_model, 3)
    keep = list(t.items())
    body = {"lora_name": "busy", "config_dict": cfg, "serialized_named_tensors": [
        base64.b64encode(serialize_named_tensors(keep)).decode()]}
    async with aiohttp.ClientSession() as s:
        assert (await post(s, url, "/load_lora_adapter_from_tensors", body))[0] == 200
        status, out = await post(s, url, "/load_lora_adapter_from_tensors", body)
        assert status == 400 and "already loaded" in out["error_message"]
        # generation paused: the request waits in the queue until continue, so it cannot finish
        # before the unload below, however slow this machine
        assert (await post(s, url, "/pause_generation", {"mode": "in_place"}))[0] == 200
        long = asyncio.create_task(generate(s, url, "busy", max_new=16, ignore_eos=True))
        while not await holds_a_request(s, url):  # a condition: the engine has it
            await asyncio.sleep(0.01)
        status, out = await post(s, url, "/unload_lora_adapter", {"lora_name": "busy"})
        assert status == 400 and "named by 1 running or queued request" in out["error_message"]
        assert (await post(s, url, "/continue_generation", {}))[0] == 200
        assert (await long)[0] == 200
        status, out = await post(s, url, "/unload_lora_adapter", {"lora_name": "busy"})
        assert (status, "busy" in out["loaded_adapters"]) == (200, False)
        status, out = await generate(s, url, "busy")
        assert status == 400 and "not loaded" in str(out)
        status, out = await post(s, url, "/unload_lora_adapter", {"lora_name": "busy"})
        assert status == 400 and "not loaded" in out["error_message"]
        # tensors that do not fit the model are refused with what is wrong
        a_name, b_name = peft_tensor_names("model.layers.0.self_attn.q_proj")
        bad = [(a_name, torch.zeros(4, 3)), (b_name, torch.zeros(64, 4))]
        status, out = await post(s, url, "/load_lora_adapter_from_tensors", {
            "lora_name": "bad", "config_dict": cfg, "serialized_named_tensors": [
                base64.b64encode(serialize_named_tensors(bad)).decode()]})
        assert status == 400 and "do not fit" in out["error_message"]


@pytest.mark.parametrize("method", ["tensor", "disk"])
async def test_the_trainer_s_adapter_sync_serves_the_trainer_s_policy(engine, tiny_model_dir, tmp_path,
                                                                      method):
    """Adapter-only sync from the megatron trainer (train.lora.sync: adapter): in memory or as a
    PEFT folder, loaded as policy@v<version>; a request naming it samples what the trainer's
    policy gives (its logprobs of the sampled tokens, fp32), a few KB instead of the model."""
    from rlkit.common.weight_update import WeightUpdate, adapter_name
    from rlkit.train.batch import TrainBatch, TrainSample
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer
    from tests.train.helpers import random_batch

    url, _ = engine
    trainer = MegatronTrainer.single_process(tiny_model_dir, TrainConfig.model_validate({
        "device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-2},
        "lora": {"rank": 4, "alpha": 8.0}}))
    for seed in (1, 2):  # B and A both off their start
        trainer.accumulate(random_batch(6, seed=seed))
        trainer.step()
    version = 7 if method == "tensor" else 8
    metrics = trainer.publish_weights(WeightUpdate(
        version, (url,), method, folder=str(tmp_path), adapter=adapter_name(version)))
    assert metrics["sync/adapter"] == 1.0
    full = sum(p.numel() * p.element_size() for p in trainer.module.parameters())
    assert 0 < metrics["sync/bytes"] < 0.2 * full
    async with aiohttp.ClientSession() as s:
        status, answer = await generate(s, url, adapter_name(version), max_new=16)
        assert status == 200
        status, out = await post(s, url, "/unload_lora_adapter", {"lora_name": adapter_name(version)})
        assert status == 200
    ids, lps = tokens_and_logprobs(answer)
    sample = TrainSample(index=0, group_id=0, tokens=torch.tensor(PROMPT + ids),
                         prompt_length=len(PROMPT), loss_mask=torch.ones(len(ids)),
                         rollout_logprobs=torch.tensor(lps), advantage=0.0, reward=0.0,
                         min_version=version, max_version=version)
    ours = trainer.logprobs(TrainBatch([sample], version))[0]
    assert float((ours - torch.tensor(lps)).abs().max()) < LOGPROB_TOLERANCE


class TrainerPublisher:
    """The in-process trainer as the rollout side's WeightPublisher."""

    def __init__(self, trainer):
        self.trainer = trainer

    async def publish(self, update):
        return await asyncio.to_thread(self.trainer.publish_weights, update)


@pytest.mark.parametrize("what", ["weights", "adapter"])
async def test_the_weight_sync_check_stops_a_sync_that_did_not_arrive(what, tiny_model_dir, tmp_path,
                                                                      monkeypatch):
    """train.weight_sync.verify: the engine scores the trainer's probe after every sync. The
    engine's test-only switch answers the second load as a success without applying it (the
    silent failure: full weights left at the previous version; an adapter's name served by the
    base model); the check raises WeightsMismatch naming the engine and the numbers."""
    from rlkit.buffers import ListPromptSource
    from rlkit.buffers.source import records_from_token_lists
    from rlkit.common.fault_switch import ENGINE_FAULT_ENV
    from rlkit.common.weight_update import WeightsMismatch
    from rlkit.config import load_recipe
    from rlkit.driver.rollout_service import RolloutService
    from rlkit.rollout.engine_updates import EngineUpdates
    from rlkit.rollout.http.client import EngineClient
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer
    from tests.train.helpers import random_batch

    at = "/update_weights_from_tensor" if what == "weights" else "/load_lora_adapter_from_tensors"
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=drop,at={at},calls=2,dir={tmp_path / 'fault'}")
    trainer = MegatronTrainer.single_process(tiny_model_dir, TrainConfig.model_validate({
        "device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-2},
        **({"lora": {"rank": 4, "alpha": 8.0}} if what == "adapter" else {})}))
    with EngineFleet(str(tiny_model_dir), ENGINE, RouterConfig(), log_dir=tmp_path / "logs") as fleet:
        client = await EngineClient(None, worker_urls=fleet.worker_urls).connect()
        try:
            r = load_recipe(None, [])
            source = ListPromptSource(records_from_token_lists([[1, 2]]), shuffle=False)

            async def score(sample, group):
                return 0.0

            service = RolloutService.from_config(
                r.rollout, source, client, score,
                updates=EngineUpdates(method="tensor", pause_mode="abort", folder=str(tmp_path)))
            service.adapter_sync = what == "adapter"
            # a bound the drop stays under (lr 1e-2, one step: about 0.14): the comparison with
            # the previous sync's trainer, or the base model's, is what must catch it
            service.verify_tolerance = 1.0
            publisher = TrainerPublisher(trainer)
            for version in (1, 2):
                trainer.accumulate(random_batch(6, seed=version))
                trainer.step()
                if version == 1:
                    metrics = await service.update_weights(version, publisher)
                    assert metrics["sync/verify_abs_diff"] < 1e-4, metrics
            with pytest.raises(WeightsMismatch, match=r"did not arrive") as failed:
                await service.update_weights(2, publisher)
            message = str(failed.value)
            assert fleet.worker_urls[0] in message
            # full weights left at version 1; the adapter's name served by the base model
            assert ("previous sync's trainer" if what == "weights" else "the base model") in message
        finally:
            await client.close()


async def test_a_parked_sample_resumes_under_its_own_adapter_while_it_is_kept(engine, tiny_model):
    """train.lora.resume 'own': the client names the adapter a sample's response began under
    while the rollout side keeps it (kept_adapters), so the whole response is one policy's
    (every token version 11, logprobs of adapter 11's merged model); once it is gone the sample
    resumes under the newest (versions 11 then 12), counted as a fallback. (Versions 11 and 12:
    the module's engine still holds the policy@v1 and @v2 of an earlier test.)"""
    from rlkit.buffers.sample import Sample, SampleStatus
    from rlkit.rollout.config import SamplingConfig
    from rlkit.rollout.http.client import EngineClient

    url, _ = engine
    adapters = {}
    async with aiohttp.ClientSession() as s:
        for v in (11, 12):
            cfg, t = random_adapter(tiny_model, v)
            adapters[v] = merged(tiny_model, cfg, t)
            keep = list(t.items())
            status, out = await post(s, url, "/load_lora_adapter_from_tensors", {
                "lora_name": f"policy@v{v}", "config_dict": cfg, "serialized_named_tensors": [
                    base64.b64encode(serialize_named_tensors(keep)).decode()]})
            assert (status, out["success"]) == (200, True), out
        parked = []
        for index in range(2):  # two responses parked after 4 tokens of version 11
            status, answer = await generate(s, url, "policy@v11", max_new=4, ignore_eos=True)
            ids, lps = tokens_and_logprobs(answer)
            sample = Sample(index, 0, PROMPT)
            sample.append(ids, lps, 11)
            sample.interrupt()
            assert sample.status is SampleStatus.PARTIAL
            parked.append(sample)
    sampling = SamplingConfig(max_new_tokens=12, ignore_eos=True, temperature=1.0)
    client = await EngineClient(None, worker_urls=[url]).connect()
    try:
        client.adapter, client.resume_own_adapter = "policy@v12", True
        client.kept_adapters = frozenset({"policy@v11", "policy@v12"})
        await client.generate(parked[0], sampling, max_new_tokens=8, version=12, worker=url)
        client.kept_adapters = frozenset({"policy@v12"})  # v11 unloaded by the rollout side
        await client.generate(parked[1], sampling, max_new_tokens=8, version=12, worker=url)
        assert client.own_adapter_metrics() == {"rollout/own_adapter_requests": 1.0,
                                                "rollout/own_adapter_fallbacks": 1.0}
    finally:
        await client.close()
    own, fallback = parked
    assert own.versions == [11] * 12 and fallback.versions == [11] * 4 + [12] * 8
    # each token's logprob is the adapter's its version names
    ref = teacher_forced_logprobs(adapters[11], PROMPT, own.response_ids)
    assert max(abs(a - b) for a, b in zip(ref, own.logprobs)) < LOGPROB_TOLERANCE
    ref = teacher_forced_logprobs(adapters[12], PROMPT, fallback.response_ids)
    assert max(abs(a - b) for a, b in zip(ref[4:], fallback.logprobs[4:])) < LOGPROB_TOLERANCE
    async with aiohttp.ClientSession() as s:
        for v in (11, 12):
            assert (await post(s, url, "/unload_lora_adapter", {"lora_name": f"policy@v{v}"}))[0] == 200

"""The rollout side of a weight sync (RolloutService): LoRA adapter sync (train.lora.sync:
adapter) opens each update as an adapter update named policy@v<version>, new requests name it,
and an adapter is unloaded once no request in flight names it (one still named waits for a later
update); the check after the sync (train.weight_sync.verify) passes an engine serving the
trainer's policy, skips one lost meanwhile and raises for one that cannot answer."""

import asyncio

from rlkit.buffers import ListPromptSource
from rlkit.buffers.source import records_from_token_lists
from rlkit.config import load_recipe
from rlkit.driver.rollout_service import RolloutService
from rlkit.rollout.engine_updates import StatelessEngines
from tests.manager.fakes import FakeEngines


class RecordingUpdates(StatelessEngines):
    def __init__(self):
        super().__init__()
        self.opened, self.unloads = [], []

    def open(self, urls, version, *, colocated=False, adapter=None):
        self.opened.append((version, adapter))
        return super().open(urls, version, colocated=colocated, adapter=adapter)

    def unload_adapters(self, urls, names):
        self.unloads.append(list(names))
        return list(names)


class Publisher:
    def __init__(self):
        self.updates = []

    async def publish(self, update):
        self.updates.append(update)
        return {}


def test_adapters_are_named_per_version_and_unloaded_once_no_request_names_them():
    r = load_recipe(None, ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2"])
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(8)]), shuffle=False)
    engines = FakeEngines(lambda s: 4)
    in_use: dict[str, int] = {}
    engines.adapters_in_use = lambda: dict(in_use)

    async def score(sample, group):
        return 0.0

    updates = RecordingUpdates()
    service = RolloutService.from_config(r.rollout, source, engines, score, updates=updates)
    service.adapter_sync = True
    publisher = Publisher()

    async def go():
        m1 = await service.update_weights(1, publisher)
        assert engines.adapter == "policy@v1" and m1["sync/adapters_loaded"] == 1.0
        in_use["policy@v1"] = 2  # requests in flight still name it
        m2 = await service.update_weights(2, publisher)
        assert engines.adapter == "policy@v2" and m2["sync/adapters_loaded"] == 2.0
        in_use.clear()
        m3 = await service.update_weights(3, publisher)
        assert engines.adapter == "policy@v3" and m3["sync/adapters_loaded"] == 1.0

    asyncio.run(go())
    assert updates.opened == [(1, "policy@v1"), (2, "policy@v2"), (3, "policy@v3")]
    assert [u.adapter for u in publisher.updates] == ["policy@v1", "policy@v2", "policy@v3"]
    assert updates.unloads == [["policy@v1", "policy@v2"]]  # v1 waited until nothing named it


def test_without_adapter_sync_updates_carry_no_adapter():
    r = load_recipe(None, ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2"])
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(8)]), shuffle=False)

    async def score(sample, group):
        return 0.0

    updates = RecordingUpdates()
    service = RolloutService.from_config(r.rollout, source, FakeEngines(lambda s: 4), score,
                                         updates=updates)
    asyncio.run(service.update_weights(1, Publisher()))
    assert updates.opened == [(1, None)] and updates.unloads == []


class ProbePublisher(Publisher):
    """A trainer answering the check's probe with fixed logprobs."""

    async def publish(self, update):
        await super().publish(update)
        assert update.probe
        return {"sync/probe_ids": [1, 2, 3], "sync/probe_logprobs": [-1.0, -2.0]}


class ScoringEngines(FakeEngines):
    def __init__(self, answers):
        super().__init__(lambda s: 4, workers=len(answers))
        self.answers = dict(zip(self.workers(), answers))

    def workers(self):
        return list(getattr(self, "answers", {}) or super().workers())

    async def score(self, worker, ids, *, temperature, adapter=None):
        answer = self.answers[worker]
        if isinstance(answer, Exception):
            raise answer
        return answer


def checked_service(engines):
    r = load_recipe(None, ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2"])
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(8)]), shuffle=False)

    async def score(sample, group):
        return 0.0

    service = RolloutService.from_config(r.rollout, source, engines, score, updates=RecordingUpdates())
    service.verify_tolerance = 0.1
    return service


def test_the_check_passes_an_engine_that_serves_the_trainer_and_skips_one_lost_meanwhile():
    from rlkit.rollout.engine_api import EngineError

    engines = ScoringEngines([[-1.0, -2.0], EngineError("connection refused")])
    service = checked_service(engines)
    lost = engines.workers()[1]

    async def health_takes_it_out():  # what rollout.health's sweep does with a dead engine
        del engines.answers[lost]
        return 1

    service.check_engines = health_takes_it_out
    metrics = asyncio.run(service.update_weights(1, ProbePublisher()))
    assert metrics["sync/verify_abs_diff"] == 0.0 and "sync/probe_ids" not in metrics


def test_the_check_raises_for_an_engine_that_cannot_score_and_is_not_lost():
    import pytest

    from rlkit.rollout.engine_api import EngineError

    service = checked_service(ScoringEngines([[-1.0, -2.0], EngineError("HTTP 400: bad")]))
    with pytest.raises(EngineError, match="HTTP 400"):
        asyncio.run(service.update_weights(1, ProbePublisher()))


def test_resume_own_keeps_the_adapters_unfinished_samples_began_under_up_to_keep_versions():
    """train.lora.resume 'own' with keep_versions 2: besides the newest, the adapter of the
    newest version an unfinished sample began under stays loaded (and the client may name it);
    the rest go once no request names them; a restarted engine holds the newest alone."""
    from collections import Counter

    r = load_recipe(None, ["rollout.batch_size=2", "rollout.n_samples_per_prompt=2"])
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(8)]), shuffle=False)
    engines = FakeEngines(lambda s: 4)
    engines.adapters_in_use = dict
    engines.kept_adapters = frozenset()

    async def score(sample, group):
        return 0.0

    updates = RecordingUpdates()
    service = RolloutService.from_config(r.rollout, source, engines, score, updates=updates)
    service.adapter_sync, service.resume_own_adapter, service.keep_versions = True, True, 2
    began: Counter[int] = Counter()
    service.buffer.unfinished_versions = lambda: Counter(began)
    publisher = Publisher()

    async def go():
        await service.update_weights(1, publisher)
        began.update({1: 2})  # two responses parked under v1
        m = await service.update_weights(2, publisher)
        assert m["sync/adapters_loaded"] == 2.0
        assert engines.kept_adapters == {"policy@v1", "policy@v2"}
        began.update({2: 1})  # v1's and v2's unfinished: the newest of them stays
        m = await service.update_weights(3, publisher)
        assert engines.kept_adapters == {"policy@v2", "policy@v3"}
        assert m["sync/adapters_loaded"] == 2.0
        began.clear()
        await service.update_weights(4, publisher)
        assert engines.kept_adapters == {"policy@v4"}

    asyncio.run(go())
    assert updates.unloads == [["policy@v1"], ["policy@v2", "policy@v3"]]


def test_an_adapter_an_engine_does_not_hold_counts_as_unloaded_and_a_refusal_keeps_it():
    """EngineUpdates.unload_adapters over real HTTP: an engine answering in SGLang's words that
    it holds no such adapter (restarted since) counts as unloaded; one refusing (a request still
    names it) keeps the adapter listed for the next try."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from rlkit.rollout.engine_updates import EngineUpdates

    answers = {"policy@v1": "LoRA with name policy@v1 does not exist. Loaded LoRAs: dict_keys([])",
               "policy@v2": "LoRA adapter 'policy@v2' is named by 1 running or queued request"}

    async def unload(request):
        name = (await request.json())["lora_name"]
        if name in answers:
            return web.json_response({"success": False, "error_message": answers[name]})
        return web.json_response({"success": True, "error_message": ""})

    async def go():
        app = web.Application()
        app.router.add_post("/unload_lora_adapter", unload)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            url = str(server.make_url("")).rstrip("/")
            updates = EngineUpdates(method="disk", pause_mode="abort", folder="/tmp")
            return await asyncio.to_thread(updates.unload_adapters, [url],
                                           ["policy@v1", "policy@v2", "policy@v3"])
        finally:
            await server.close()

    assert asyncio.run(go()) == ["policy@v1", "policy@v3"]

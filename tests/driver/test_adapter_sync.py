"""LoRA adapter sync on the rollout side (RolloutService, train.lora.sync: adapter): each update
opens as an adapter update named policy@v<version>, new requests name it, and an adapter is
unloaded once no request in flight names it (one still named waits for a later update)."""

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

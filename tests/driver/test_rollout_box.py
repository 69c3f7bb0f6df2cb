"""One rollout box: the protocol's calls are listed once (BOX_CALLS) and the RolloutService
implements each; the Ray proxy forwards exactly those by name; a rollout step's stream pushes
progress when there is news (not on a poll) and ends with the step's result."""

import asyncio
import inspect

import pytest

from rlkit.driver.proxies import RemoteRolloutBox
from rlkit.driver.rollout_box import BOX_CALLS, RolloutBox, RolloutResult
from rlkit.driver.rollout_service import RolloutService
from tests.driver.test_modes import make_box, recipe


def test_the_service_implements_every_call_of_the_protocol_as_declared():
    assert BOX_CALLS == {"next_ready", "take", "admits", "evaluate", "update_weights",
                         "sleep_engines", "give_back_untrained", "save", "load"}
    for name in [*BOX_CALLS, "start_step"]:
        declared = getattr(RolloutBox, name)
        mine = getattr(RolloutService, name)
        assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(declared), name
        assert list(inspect.signature(mine).parameters) == list(inspect.signature(declared).parameters), name


class RecordingActor:
    """Stands for a Ray actor handle: `actor.call.remote(name, ...)` is an awaitable."""

    def __init__(self):
        self.calls = []
        self.call = self

    async def _answer(self, name, args):
        self.calls.append((name, args))
        return len(self.calls)

    def remote(self, name, *args):
        return self._answer(name, args)


def test_the_proxy_forwards_the_protocols_calls_by_name_and_nothing_else():
    actor = RecordingActor()
    box = RemoteRolloutBox(actor)
    assert asyncio.run(box.admits(3)) == 1
    assert asyncio.run(box.sleep_engines()) == 2
    assert actor.calls == [("admits", (3,)), ("sleep_engines", ())]
    with pytest.raises(AttributeError):
        box.run_step  # noqa: B018 - not a box call: the step goes through start_step's stream


def test_a_steps_stream_pushes_progress_on_news_and_ends_with_the_result(tmp_path):
    service = make_box(recipe(tmp_path, 1)).s

    async def main():
        async def news_once_running():  # an engine event while the step runs
            while service.manager.current is None:
                await asyncio.sleep(0)
            service._news.set()

        news = asyncio.ensure_future(news_once_running())
        items = [x async for x in service.run_step_streamed(0, for_version=0, final=False,
                                                            heartbeat_s=3600)]
        await news
        return items

    items = asyncio.run(main())
    assert isinstance(items[-1], RolloutResult) and items[-1].completed
    progress = items[:-1]
    assert len(progress) == 1  # the news, and no heartbeat in an hour
    assert {"completed", "target", "tokens", "seconds", "awaiting_weights"} <= set(progress[0])
    assert service.buffer.stats()["balanced"]

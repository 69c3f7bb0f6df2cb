"""Multi-turn episodes end to end on the real stack (Ray, the sglang-router, two built-in
engines, megatron-core) with partial rollouts: the tiny random model plays the guessing game,
each of its turns ended by a space (`turn_stop`), so episodes run several turns; observations
go in with loss mask 0 and the trainer trains on them; accounting balances, nothing is lost."""

import json
import os
from pathlib import Path

import pytest

from rlkit.config import load_recipe
from rlkit.driver.run import train
from tests.e2e.test_train_tiny import processes_with, rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_multi_turn_episodes_with_partial_rollouts_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    r = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [
        f"run.output_dir={out}", "tracking.progress=false", "run.num_steps=3",
        "rollout.episode.generator=multi_turn", "rollout.episode.environment=guess_number",
        "rollout.episode.env_kwargs={high: 10, max_turns: 4}", "rollout.episode.turn_stop=[' ']",
        "rollout.sampling.max_new_tokens=48",
    ])
    state = train(r)
    run_dir = out / r.run.name
    assert (state.step, state.version) == (3, 3)
    m = rows(run_dir)
    assert all(x["buffer/balanced"] and x["buffer/dropped"] == 0 for x in m)
    assert all(x["batch/groups"] == r.rollout.batch_size for x in m)
    last = m[-1]
    # several model turns per episode on average: the turns ended at a space, and went on
    assert last["rollout/episodes/turns"] > last["rollout/episodes/episodes_started"] > 0
    assert last["rollout/episodes/episodes_ended"] > 0 and last["rollout/episodes/episodes_restarted"] == 0
    assert all(last[f"rollout/tool_failures/{k}"] == 0 for k in ("raised", "timeout", "bad_output"))
    groups = [json.loads(x) for x in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert len({g["group_id"] for g in groups}) == len(groups) == 3 * r.rollout.batch_size
    # every trained response is an episode: the environment's reward (0 or 1), or the recipe's
    # reward for one cut by the budget
    assert all(r_ is not None for g in groups for r_ in g["rewards"])
    assert processes_with(str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")) == []

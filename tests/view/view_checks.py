"""What `rlkit view` shows of a real run folder, checked against the run's own records: rides
on an end-to-end run of the tiny model (tests/e2e/test_train_tiny.py) so no run is paid for it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlkit.view.run_data import RunData
from rlkit.view.trace_export import chrome_trace, validate_trace
from tests.view.browser import check_pages


def check_real_run(run_dir: Path, recipe: Any, metrics: list[dict[str, Any]]) -> None:
    run = RunData(run_dir)
    steps = list(range(1, recipe.run.num_steps + 1))
    rows = run.steps()["rows"]
    assert [r["step"] for r in rows] == steps
    titles = {p["title"] for p in run.steps()["panels"]}
    assert {"reward", "seconds per step", "response length (tokens)", "engines idle (share of the "
            "rollout's engine-seconds)", "zero-variance and mixed-version shares"} <= titles
    tl = run.timeline()
    engines = [w for w in tl["workers"] if not w.startswith("frozen:")]
    assert len(engines) == recipe.rollout.engine.num_engines
    # the trainer's phases per step: colocated, the engines' sleep, then train and sync
    names = ["sleep", "train", "sync"] if recipe.cluster.placement == "colocated" else ["train", "sync"]
    assert [(p["step"], p["name"]) for p in tl["phases"]] == [(s, n) for s in steps for n in names]
    for p in tl["phases"]:
        window = next(s for s in tl["steps"] if s["step"] == p["step"])
        assert window["end"] <= p["start"] + 1e-6 <= p["end"] + 1e-6  # on the rollout's clock
    for m in metrics:
        g = run.groups(m["step"])
        kept = [x for x in g["groups"] if x["kept"]]
        dropped = [x for x in g["groups"] if not x["kept"]]
        assert len(kept) == m["batch/groups"]
        assert len(dropped) == m.get("rollout/filtered_groups", 0) + sum(
            v for k, v in m.items() if k.startswith("rollout/dropped/"))
        assert all(x["dropped"].startswith("filtered:") or x["dropped"] in ("engine_failed", "reward_failed", "stale")
                   for x in dropped)
        # the saved samples: round-robin, one from each of the first groups handed
        want = min(recipe.tracking.samples_per_step, len(kept) * recipe.rollout.n_samples_per_prompt)
        assert len(g["samples"]) == want
        rewards = {x["group_id"]: x["rewards"] for x in kept}
        for s in g["samples"]:
            n = len(s["ids"])
            assert n > 0 and len(s["tokens"]) == len(s["versions"]) == len(s["loss_mask"]) == len(s["logprobs"]) == n
            assert s["group_id"] in rewards and s["group_rewards"] == rewards[s["group_id"]]
            assert s["reward"] in s["group_rewards"] and max(s["versions"]) <= m["step"] - 1
            # the trainer's logprobs of the same tokens, from the weights the step trained from:
            # on-policy tokens agree with the engine's to numerics (fp32 on CPU)
            assert len(s["trainer_logprobs"]) == n
            if set(s["versions"]) == {m["step"] - 1}:
                assert max(abs(a - b) for a, b in zip(s["logprobs"], s["trainer_logprobs"])) < 1e-2
    assert validate_trace(chrome_trace(run)) == []
    if recipe.tracking.wandb != "disabled":  # the same rows as a wandb Table per step
        tables = sorted(run_dir.glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
        assert len(tables) == len(steps)
        for t in tables:
            assert len(json.loads(t.read_text())["data"]) == recipe.tracking.samples_per_step
    check_pages(run_dir)

"""The stream and async modes end to end on the real stack (Ray, the sglang-router, two
built-in engines, megatron-core) with partial rollouts and with tail batching, two of them over
multi-turn episodes: steps complete,
versions advance, accounting balances, no trained token lags the bound, nothing is trained
twice, and an async run resumed mid-run continues with its buffered partial groups."""

import json
import os
from pathlib import Path

import pytest

from rlkit.common.fault_switch import ROUTER_FAULT_ENV, read_fired
from rlkit.config import load_recipe
from rlkit.driver.run import train
from rlkit.train.algorithms.mismatch import LAG_BUCKETS
from rlkit.checkpoint import latest_checkpoint
from tests.e2e.test_train_tiny import TEACHER, check_distillation, processes_with, rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def trained_groups(run_dir: Path) -> list[int]:
    return [json.loads(x)["group_id"] for x in (run_dir / "groups.jsonl").read_text().splitlines()]


# Multi-turn episodes (docs/episodes.md): the tiny random model plays the guessing game, each of
# its turns ended by any token with an 'e', so its episodes run several turns.
EPISODES = ["rollout.episode.generator=multi_turn", "rollout.episode.environment=guess_number",
            "rollout.episode.env_kwargs={high: 10, max_turns: 4, intro: false}",
            "rollout.episode.turn_stop=['e']", "rollout.sampling.max_new_tokens=48"]


@pytest.mark.parametrize("mode,recipe,episodes,router_killed,lora", [
    ("stream", "grpo_tiny_ci.yaml", True, True, False),
    # (stream with tail batching and LoRA ran here until 2026-11-29: each part rides on another
    # run, and the 20-minute CI budget needed its 22 s)
    ("async", "grpo_tiny_tail_ci.yaml", True, True, True),
])
def test_a_mode_with_a_policy_end_to_end(tmp_path, monkeypatch, mode, recipe, episodes, router_killed,
                                         lora):
    """Also, with `episodes`, over multi-turn episodes: observations go in with loss mask 0 and
    the trainer trains on them; partial rollouts and tail batching park episodes with their
    tokens (mid-turn or on a tool call) and resume them; no tool fails. Stream mode's episodes
    run also evaluate: held-out prompts played as episodes. With `router_killed`, the router is
    SIGKILLed in step 1's rollout once 8 tokens went through it (the rollout actor's test-only
    switch): it is restarted, its requests go on with their tokens, and everything above holds.
    With `lora`, the trainer trains LoRA adapters and each sync sends the adapter alone; the
    deferred prompts resume (not restart), each response under the adapter it began with."""
    evaluated = episodes and mode == "stream"
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    if router_killed:
        monkeypatch.setenv(ROUTER_FAULT_ENV, f"action=kill,phase=rollout,step=1,tokens=8,dir={tmp_path / 'fault'}")
    out = tmp_path / "runs"
    r = load_recipe(ROOT / "recipes" / recipe, [
        f"mode={mode}", f"run.output_dir={out}", "tracking.progress=false", "run.num_steps=3",
        "rollout.max_staleness=1", "train.algorithm.off_policy_correction=tis",
        *(EPISODES if episodes else []),
        # LoRA: deferred prompts resume in the long round, each under the adapter it began with
        *(["train.lora.rank=4", "train.lora.alpha=8", "train.lora.resume=own",
           "rollout.tail_batching.deferred=resume"] if lora else []),
        *(["eval.datasets=[{name: held, path: 'builtin:arithmetic?split=test&rows=4'}]",
           "eval.before_first_step=true", "eval.n_samples=2", "eval.k=1"] if evaluated else []),
    ])
    state = train(r)
    run_dir = out / r.run.name
    assert (state.step, state.version) == (3, 3)
    metrics = rows(run_dir)
    assert [m["version"] for m in metrics] == [1, 2, 3]
    assert all(m["buffer/balanced"] for m in metrics)
    assert all(m["batch/groups"] == r.rollout.batch_size for m in metrics)
    # the bound (1) holds; stream with tail batching (restart: on-policy) trains no old token
    on_policy = mode == "stream" and "tail" in recipe and not lora
    assert all(m["batch/max_staleness"] <= (0 if on_policy else 1) for m in metrics)
    # the mismatch telemetry sees every trained token once, at the lag its version gives
    for m in metrics:
        lag_tokens = [m.get(f"mismatch/{b}/tokens", 0) for b in LAG_BUCKETS]
        assert sum(lag_tokens) == m.get("mismatch/fresh/tokens", 0) + m.get("mismatch/resumed/tokens", 0)
        assert sum(lag_tokens) == m["train/loss_denominator"] > 0  # token_mean: the trained tokens
        assert lag_tokens[2:] == [0, 0] and (lag_tokens[1] == 0 or not on_policy), m
    ids = trained_groups(run_dir)
    assert len(ids) == len(set(ids)) == 3 * r.rollout.batch_size
    if mode == "async":
        assert [m["async/overlapped"] for m in metrics] == [1.0, 1.0, 0.0]
    if "tail" in recipe:
        assert "long" in [m["rollout/round"] for m in metrics]
    if lora:  # the adapter alone, checked on every engine after every sync
        assert all(m["sync/adapter"] == 1.0 and m["sync/bytes"] <= 64 * 1024 for m in metrics), metrics
        assert all(m["sync/verify_abs_diff"] < 1e-4 for m in metrics)
        # resume 'own': no trained response spans two versions, none fell back to the newest
        # adapter (how many resume under an older one depends on the zero-variance filter,
        # which drops most of the tiny model's groups: tests/rollout/test_engine_lora.py
        # checks the resumed tokens themselves). An engine restarted (a probe timed out on a
        # starved machine) holds the newest adapter alone: its samples fall back, by design.
        if not any(m.get("engines/restarted") for m in metrics):
            assert all(m["rollout/own_adapter_fallbacks"] == 0 for m in metrics)
            assert all(m["batch/mixed_version_share"] == 0 for m in metrics)
    if episodes:  # several model turns per episode on average, each after an observation
        last = metrics[-1]
        assert last["rollout/episodes/turns"] > last["rollout/episodes/episodes_started"] > 0, last
        assert last["rollout/episodes/observations"] > 0 and last["rollout/episodes/episodes_restarted"] == 0
        assert all(last[f"rollout/tool_failures/{k}"] == 0 for k in ("raised", "timeout", "bad_output"))
    if evaluated:  # every held-out sample played as an episode, before the first step
        first = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])
        assert first["step"] == 0
        for mode_ in ("greedy", "sampled"):
            base = f"eval/held/{mode_}"
            assert first[f"{base}/episodes/episodes_ended"] == first[f"{base}/samples"] > 0, first
            assert first[f"{base}/tool_failures/raised"] == first[f"{base}/failures/engine"] == 0
    if router_killed:  # restarted once; step 2's requests through it went on with their tokens
        assert read_fired(tmp_path / "fault")["step"] == 1
        counts = [(m["router/lost"], m["router/restarts"], m["rollout/requests_relaunched"]) for m in metrics]
        assert counts[-1][:2] == (1, 1), counts  # lost and restarted once
        assert metrics[0]["rollout/requests_relaunched"] > 0 and metrics[0]["rollout/relaunched_tokens"] > 0, counts
    assert processes_with(str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")) == []


def test_async_partial_resumed_mid_run_continues_and_trains_nothing_twice(tmp_path, monkeypatch):
    """With LoRA (train.lora, adapter sync): each update sends the adapter alone, loaded on the
    engines as policy@v<version> beside the ones requests in flight still name; the checkpoint
    holds the adapters and the resumed run loads its version's adapter before generating.
    Distilled from a frozen teacher group (rollout.frozen_engines; the initial model, so step
    1's reverse KL is zero but for the engine/trainer mismatch), with partial rollouts (the
    recipe's policy): every complete sample carries its teacher logprobs and a parked one none,
    through the checkpoint and the resume; the teacher's engine never gets an update."""
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    base = [f"run.output_dir={out}", "tracking.progress=false", "checkpoint.every_steps=1",
            "mode=async", "rollout.max_staleness=1", "train.lora.rank=4", "train.lora.alpha=8",
            *TEACHER]
    r = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [*base, "run.num_steps=2"])
    train(r)
    run_dir = out / r.run.name
    first = rows(run_dir)
    check_distillation(first, latest_checkpoint(run_dir).buffer_file)
    assert [m["async/overlapped"] for m in first] == [1.0, 0.0]
    assert all(m["batch/max_staleness"] <= 1 for m in first)
    assert sum(m["rollout/groups_carried_over"] for m in first) > 0

    r3 = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [*base, "run.num_steps=3"])
    state = train(r3)  # resume: auto
    assert (state.step, state.version) == (3, 3)
    last = rows(run_dir)[-1]
    assert last["step"] == 3 and last["buffer/balanced"] and last["batch/max_staleness"] <= 1
    check_distillation(rows(run_dir), latest_checkpoint(run_dir).buffer_file, first_step=False)
    ids = trained_groups(run_dir)
    assert len(ids) == len(set(ids)) == 3 * r.rollout.batch_size  # nothing trained twice
    # every sync sent the adapter alone (A and B of 4 layers x 2 tiny layers, fp32: 32 KiB),
    # and adapters no request named any more were unloaded
    synced = rows(run_dir)
    assert all(m["sync/adapter"] == 1.0 and 0 < m["sync/bytes"] <= 64 * 1024 for m in synced), synced
    assert all(1 <= m["sync/adapters_loaded"] <= 2 for m in synced)
    assert processes_with(str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")) == []

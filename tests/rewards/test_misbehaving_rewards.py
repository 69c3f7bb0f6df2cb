"""Rewards that misbehave: a sync reward that hangs (sleeping, or spinning on the CPU without ever
yielding), raises, exits, or returns NaN / inf / a non-number is recorded on the sample with its
reason and counted by kind; it never holds the step past its timeout, later rewards and other
to_thread users still run, and the process still exits."""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlkit.buffers import Group, ListPromptSource, PromptRecord, SampleStatus
from rlkit.driver.rollout_service import RolloutService
from rlkit.rewards import RewardNotFound, call_reward
from rlkit.rewards.scoring import make_score_fn
from rlkit.rewards.worker import ProcessRewardRunner, ThreadRewardRunner
from rlkit.rollout.config import RewardConfig, RolloutConfig
from rlkit.rollout.reward_scheduler import RewardScheduler, check_reward_value
from tests.manager.fakes import FakeEngines

ROOT = Path(__file__).resolve().parents[2]
BY_LABEL = "tests.rewards.misbehaving:by_label"
SLACK_S = 60.0  # guards against hangs only; no timing is asserted beyond "it came back"


def group_with(label, n=1):
    g = Group.new(0, PromptRecord(ids=(1,), text="q", label=label), n, 0, 0)
    for s in g.samples:
        s.append([4, 5], [-0.1, -0.2], 0, finish_reason="stop")
    return g


def scheduler(isolation="process", timeout=2.0, workers=2):
    cfg = RewardConfig(name=BY_LABEL, timeout_s=timeout, isolation=isolation, workers=workers)
    return RewardScheduler(make_score_fn(cfg, decode=lambda ids: "r"), timeout_s=timeout), cfg


# (label, kind of failure or None, expected reward, words the recorded reason contains)
CASES = [
    ("ok", None, 0.5, ""),
    ("true", None, 1.0, ""),
    ("false", None, 0.0, ""),
    ("np_true", None, 1.0, ""),
    ("np_float", None, 0.25, ""),
    ("int", None, 2.0, ""),
    ("fraction", None, 0.25, ""),
    ("raise", "error", None, "ValueError: cannot grade this"),
    ("system_exit", "error", None, "SystemExit"),
    ("nan", "invalid", None, "finite"),
    ("inf", "invalid", None, "finite"),
    ("-inf", "invalid", None, "finite"),
    ("np_nan", "invalid", None, "finite"),
    ("np_inf", "invalid", None, "finite"),
    ("str", "invalid", None, "'1.0' (str); expected a float"),
    ("none", "invalid", None, "None (NoneType); expected a float"),
    ("list", "invalid", None, "expected a float"),
    ("array", "invalid", None, "expected a float"),
    ("huge", "invalid", None, "not a float (OverflowError"),
]


@pytest.mark.parametrize("isolation", ["process", "thread"])
async def test_every_bad_value_and_error_is_recorded_on_the_sample_and_counted_by_kind(isolation):
    sched, _ = scheduler(isolation, timeout=30.0)
    for label, kind, reward, reason in CASES:
        g = group_with(label)
        s = g.samples[0]
        ok = await sched.score(s, g)
        assert ok is (kind is None), label
        if kind is None:
            assert s.reward == reward and isinstance(s.reward, float), label
        else:
            assert s.status is SampleStatus.FAILED and s.reward is None, label
            assert reason in s.error and s.error.startswith("reward "), (label, s.error)
    expected = {}
    for _, kind, _, _ in CASES:
        if kind:
            expected[kind] = expected.get(kind, 0) + 1
    assert dict(sched.failures) == expected


async def test_a_value_that_cannot_leave_the_worker_process_is_invalid():
    sched, _ = scheduler("process", timeout=30.0)
    g = group_with("generator")
    assert not await sched.score(g.samples[0], g)
    assert "generator" in g.samples[0].error and sched.failures == {"invalid": 1}


async def test_a_reward_that_kills_its_worker_is_an_error_and_the_next_call_gets_a_new_one():
    sched, _ = scheduler("process", timeout=30.0)
    g = group_with("exit")
    assert not await sched.score(g.samples[0], g)
    assert "ended mid-call (exit code 3)" in g.samples[0].error
    g2 = group_with("ok")
    assert await sched.score(g2.samples[0], g2) and g2.samples[0].reward == 0.5
    assert sched.failures == {"error": 1}


@pytest.mark.parametrize("label", ["spin", "sleep"])
async def test_hung_rewards_in_processes_are_killed_at_the_timeout_and_starve_nothing(label):
    """More hung calls than the default executor has threads (min(32, cpus + 4)), two workers:
    every call ends at its timeout, the hung workers are killed, later rewards and to_thread
    users run."""
    runner = ProcessRewardRunner(workers=2)
    procs = []
    start = runner._start
    runner._start = lambda: procs.append(start()) or procs[-1]
    call = call_reward(__import__("tests.rewards.misbehaving", fromlist=["x"]).by_label, runner)

    async def score(sample, group):
        from rlkit.rewards.scoring import reward_input
        return await call(reward_input(sample, group, lambda ids: "r"), {})

    sched = RewardScheduler(score, timeout_s=2.0)
    hung = [group_with(label) for _ in range(8)]
    t0 = time.monotonic()
    results = await asyncio.wait_for(
        asyncio.gather(*(sched.score(g.samples[0], g) for g in hung)), SLACK_S)
    assert results == [False] * 8 and sched.failures == {"timeout": 8}
    assert all("timed out after 2.0 s" in g.samples[0].error for g in hung)
    assert time.monotonic() - t0 < SLACK_S
    # the two that got a worker first (a waiter woken as a slot frees, just before its own
    # timeout fires, may start one more): every worker started was killed, none is left
    assert runner.killed == len(procs) >= 2
    assert all(p.proc.poll() is not None for p in procs)  # killed, reaped
    assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), SLACK_S) == 42
    good = group_with("ok")
    assert await sched.score(good.samples[0], good) and good.samples[0].reward == 0.5
    runner.close()


async def test_thread_isolation_frees_the_slot_at_the_timeout_and_counts_the_stuck_thread():
    """(A sleeping hang: a spinning one would burn this test process's CPU until it exits; the
    subprocess test below spins.)"""
    runner = ThreadRewardRunner(workers=1, max_stuck=2)
    fn = __import__("tests.rewards.misbehaving", fromlist=["x"]).by_label

    async def score(sample, group):
        from rlkit.rewards.scoring import reward_input
        return await call_reward(fn, runner)(reward_input(sample, group, lambda ids: "r"), {})

    sched = RewardScheduler(score, timeout_s=0.5)
    for _ in range(2):
        g = group_with("sleep")
        assert not await asyncio.wait_for(sched.score(g.samples[0], g), SLACK_S)
    assert runner.stuck == 2 and sched.failures == {"timeout": 2}
    g = group_with("ok")  # at max_stuck: refused at once, as an error that says why
    assert not await sched.score(g.samples[0], g)
    assert "2 reward threads are still running" in g.samples[0].error
    assert sched.failures == {"timeout": 2, "error": 1}
    runner.max_stuck = 3  # the one free slot still serves
    g = group_with("ok")
    assert await sched.score(g.samples[0], g) and g.samples[0].reward == 0.5


EXIT_SCRIPT = textwrap.dedent("""
    import asyncio, sys, time
    from rlkit.buffers import Group, PromptRecord
    from rlkit.rewards.scoring import make_score_fn
    from rlkit.rollout.config import RewardConfig
    from rlkit.rollout.reward_scheduler import RewardScheduler

    async def main(isolation):
        cfg = RewardConfig(name="tests.rewards.misbehaving:by_label", timeout_s=1.0,
                           isolation=isolation, workers=2)
        sched = RewardScheduler(make_score_fn(cfg, lambda ids: "r"), timeout_s=1.0)
        groups = [Group.new(i, PromptRecord(ids=(1,), text="q", label="spin"), 1, 0, 0)
                  for i in range(8)]
        for g in groups:
            g.samples[0].append([4], [-0.1], 0, finish_reason="stop")
        await asyncio.gather(*(sched.score(g.samples[0], g) for g in groups))
        ok = Group.new(9, PromptRecord(ids=(1,), text="q", label="ok"), 1, 0, 0)
        ok.samples[0].append([4], [-0.1], 0, finish_reason="stop")
        await sched.score(ok.samples[0], ok)
        print(dict(sched.failures), ok.samples[0].reward, await asyncio.to_thread(lambda: "free"),
              flush=True)

    asyncio.run(main(sys.argv[1]))  # asyncio.run joins the default executor's threads at exit
""")


@pytest.mark.parametrize("isolation", ["process", "thread"])
def test_the_process_exits_with_spinning_rewards_behind_it(isolation, tmp_path):
    """A CPU-bound reward that never returns, eight times at once: the step goes on, a later
    reward runs, and the interpreter exits (with the default executor it would not)."""
    script = tmp_path / "spin.py"
    script.write_text(EXIT_SCRIPT)
    out = subprocess.run([sys.executable, str(script), isolation], cwd=ROOT, capture_output=True,
                         text=True, timeout=SLACK_S * 2, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    if isolation == "thread":  # workers=2 with max_stuck=8: 2 ran and were abandoned at once...
        assert "'timeout': " in out.stdout
    assert out.stdout.split("}")[1].split() == ["0.5", "free"], out.stdout
    counts = eval(out.stdout.split("}")[0] + "}")  # noqa: S307 - our own printed dict
    assert sum(counts.values()) == 8 and counts.get("timeout", 0) >= 2


def test_check_reward_survives_a_reward_that_never_returns(tmp_path):
    samples = tmp_path / "s.jsonl"
    samples.write_text("\n".join(json.dumps({"response": r, "label": "1"}) for r in ("a", "b")))
    out = subprocess.run(
        [sys.executable, "-m", "rlkit.cli", "check-reward", "tests.rewards.misbehaving:spin_always",
         "--samples", str(samples), "--timeout", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=SLACK_S * 2)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.count("took longer than 1.0 s") == 2


def test_a_sync_reward_a_worker_cannot_import_is_refused_at_load_with_the_way_out():
    import tests.rewards.misbehaving as m

    m.closure = lambda sample, **kw: 1.0  # not importable under its own name (<lambda>)
    try:
        with pytest.raises(RewardNotFound, match="isolation: thread"):
            make_score_fn(RewardConfig(name="tests.rewards.misbehaving:closure"), lambda ids: "")
        score = make_score_fn(RewardConfig(name="tests.rewards.misbehaving:closure",
                                           isolation="thread"), lambda ids: "")
        g = group_with("ok")
        assert asyncio.run(score(g.samples[0], g)) == 1.0
    finally:
        del m.closure


def test_bools_are_rewards_and_nan_is_not():
    import numpy as np

    assert check_reward_value(True) is None and check_reward_value(np.bool_(False)) is None
    assert "finite" in check_reward_value(np.float64("nan"))
    assert "expected a float" in check_reward_value("0.5")
    assert "expected a float" in check_reward_value(None)


def test_step_metrics_count_reward_failures_by_kind():
    labels = ["ok", "raise", "nan", "sleep", "ok", "str"]
    records = [PromptRecord((1, i), text="", label=label, source_index=i)
               for i, label in enumerate(labels)]
    cfg = RolloutConfig(batch_size=6, n_samples_per_prompt=1,
                        reward=RewardConfig(name=BY_LABEL, timeout_s=2.0, workers=2))
    score = make_score_fn(cfg.reward, decode=lambda ids: "r")
    service = RolloutService.from_config(cfg, ListPromptSource(records, shuffle=False),
                                         FakeEngines(lambda s: 4), score)
    result = asyncio.run(asyncio.wait_for(service.run_step(0), SLACK_S))
    m = result.metrics
    # failed groups are dropped and the step launches others (the source wraps around), so
    # each kind may count more than once: the step's counts are the scheduler's, by kind
    by_kind = {k: m[f"rollout/reward_failures/{k}"] for k in ("error", "invalid", "timeout")}
    assert by_kind == dict(service.manager.rewards.failures) and min(by_kind.values()) >= 1
    assert sum(by_kind.values()) == m["rollout/reward_failures"]
    assert by_kind["invalid"] >= by_kind["error"]  # two invalid labels per error label
    assert len(result.completed) == 6
    again = asyncio.run(asyncio.wait_for(service.run_step(1), SLACK_S)).metrics
    assert sum(again[f"rollout/reward_failures/{k}"] for k in by_kind) == again["rollout/reward_failures"]

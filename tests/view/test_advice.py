"""Each advice rule fires on the run it is about, and stays quiet on one without the problem."""

from __future__ import annotations

from rlkit.view.advice import RULES, RunFacts, advise


def facts(rows, **recipe):
    return RunFacts([{"step": i, **r} for i, r in enumerate(rows)], recipe)


def rules_of(f):
    return [a["rule"] for a in advise(f)]


def test_every_rule_is_tested_here():
    assert {r.__name__ for r in RULES} == {"engines_idle", "zero_variance", "truncated",
                                          "train_bound", "stale_mismatch", "failures"}


def test_engines_idle_says_what_to_change_for_the_policy_and_mode():
    idle = [{"timeline/engine_idle_share": 0.9}] * 3
    [a] = advise(facts(idle, run={"mode": "sync"}, rollout={"policy": "sync"}))
    assert a["rule"] == "engines_idle" and "rollout.policy: partial" in a["message"] and "run.mode" in a["message"]
    [a] = advise(facts(idle, run={"mode": "async"}, rollout={"policy": "partial"}))
    assert "over_provision" in a["message"] and "run.mode" not in a["message"]
    # the first step (warm-up) is not read when there are others
    assert rules_of(facts([{"timeline/engine_idle_share": 0.9}, {"timeline/engine_idle_share": 0.2}])) == []


def test_zero_variance_asks_for_dynamic_sampling_unless_it_is_on():
    rows = [{"batch/zero_variance_share": 0.7}] * 2
    [a] = advise(facts(rows))
    assert a["level"] == "warn" and "rollout.filter.name: zero_variance" in a["message"]
    [a] = advise(facts(rows, rollout={"filter": {"name": "zero_variance"}}))
    assert a["level"] == "info"
    assert rules_of(facts([{"batch/zero_variance_share": 0.3}] * 2)) == []


def test_truncated_against_the_cap():
    rows = [{"batch/response_length_mean": 120, "batch/response_length_max": 128}] * 2
    assert rules_of(facts(rows, rollout={"sampling": {"max_new_tokens": 128}})) == ["truncated"]
    assert rules_of(facts(rows, rollout={"sampling": {"max_new_tokens": 1024}})) == []


def test_train_bound_only_in_sync_mode():
    rows = [{"rollout/seconds": 2.0, "train/seconds": 3.0, "sync/seconds": 0.5}] * 2
    assert rules_of(facts(rows, run={"mode": "sync"})) == ["train_bound"]
    assert rules_of(facts(rows, run={"mode": "async"})) == []


def test_stale_mismatch_against_the_on_policy_tokens():
    rows = [{"mismatch/lag0/kl_k3": 1e-4, "mismatch/lag1/kl_k3": 5e-3}] * 2
    [a] = advise(facts(rows, run={"mode": "async"}))
    assert a["rule"] == "stale_mismatch" and "off_policy_correction" in a["message"]
    assert "rollout.max_staleness" in a["message"] and "max_token_lag" not in a["message"]
    [a] = advise(facts(rows, rollout={"policy": "partial"},
                       train={"algorithm": {"off_policy_correction": {"estimator": "icepop"}}}))
    assert "rollout.max_token_lag" in a["message"] and "(icepop)" in a["message"]
    assert rules_of(facts([{"mismatch/lag0/kl_k3": 1e-4, "mismatch/lag1/kl_k3": 2e-4}] * 2)) == []


def test_failures_are_summed_over_the_run():
    [a] = advise(facts([{"rollout/engine_failures": 2}, {"rollout/engine_failures": 1}]))
    assert a["rule"] == "failures" and "engine_failures 3" in a["evidence"]
    assert rules_of(facts([{"rollout/engine_failures": 0}])) == []

"""The lag of the trained tokens, through the real driver loop (buffer, manager, partial rollouts,
the per-rank training path): the metrics row's rollout/trained_lag*_share and trained_max_lag are
what the trainer itself was given, and rollout.max_token_lag keeps every trained token within its
bound by restarting parked samples (counted in rollout/lag_restarts), where without it tokens
lag further."""

import pytest

from tests.driver.test_modes import RecordingTrainer, run_mode


class LagTrainer(RecordingTrainer):
    """Counts each optimizer step's trained tokens (loss mask 1) by lag behind its version."""

    def __init__(self, engines=None):
        super().__init__(engines)
        self.step_s = 0.0
        self.lags: list[dict[int, int]] = []
        self._lags: dict[int, int] = {}

    def accumulate(self, batch):
        for s in batch.samples:
            for v, m in zip(s.versions.tolist(), s.loss_mask.tolist()):
                if m:
                    lag = batch.policy_version - v
                    self._lags[lag] = self._lags.get(lag, 0) + 1
        return super().accumulate(batch)

    def step(self):
        self.lags.append(self._lags)
        self._lags = {}
        return super().step()


def long_tail(sample):
    return 300 if sample.group_id % 5 == 0 else 8  # every 5th prompt is long


def run(tmp_path, mode, *extra, steps=6):
    _, trainer, service, rows = run_mode(
        tmp_path, mode, "rollout.policy=partial", "rollout.partial.over_provision=2.0",
        "rollout.max_staleness=20", "train.algorithm.off_policy_correction=tis", *extra,
        steps=steps, length=long_tail, trainer_cls=LagTrainer, prompts=60)
    return trainer, service, rows


def shares(lags):
    total = sum(lags.values())
    buckets = [lags.get(0, 0), lags.get(1, 0), lags.get(2, 0),
               sum(n for lag, n in lags.items() if lag >= 3)]
    return [n / total for n in buckets]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_row_s_lag_shares_are_what_the_trainer_trained(tmp_path, mode):
    trainer, service, rows = run(tmp_path, mode)
    assert len(rows) == len(trainer.lags) == 6
    keys = [f"rollout/trained_{k}_share" for k in ("lag0", "lag1", "lag2", "lag3plus")]
    for row, lags in zip(rows, trainer.lags):
        assert [row[k] for k in keys] == pytest.approx(shares(lags))
        assert row["rollout/trained_max_lag"] == max(lags) == row["batch/max_staleness"]
        assert row["rollout/lag_restarts"] == row["rollout/lag_restart_tokens"] == 0
    # partial rollouts trained tokens of earlier versions: the shares are not all at lag 0
    assert max(max(lags) for lags in trainer.lags) >= 3  # past both bounds tested below
    if mode == "async":  # generated one version ahead: nothing is trained at lag 0 before the sync
        assert any(row["rollout/trained_lag1_share"] > 0 for row in rows)


@pytest.mark.parametrize("mode, bound", [("sync", 1), ("async", 1), ("async", 2)])
def test_max_token_lag_bounds_every_trained_token_and_partial_waits_instead_of_restarting(
        tmp_path, mode, bound):
    """Partial rollouts under the bound: a group on its last chance (resumed next step, a
    sample would lag past the bound) is waited for, so nothing is restarted or dropped."""
    trainer, service, rows = run(tmp_path, mode, f"rollout.max_token_lag={bound}")
    assert all(max(lags) <= bound for lags in trainer.lags)
    assert all(row["rollout/trained_max_lag"] <= bound for row in rows)
    stats = service.buffer.stats()
    assert all(row["rollout/lag_restarts"] == 0 for row in rows) and stats["lag_restarts"] == 0
    assert stats["balanced"] and stats["dropped"] == 0 and stats["discarded_tokens"] == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_deferred_samples_resumed_past_the_bound_are_restarted_and_counted(tmp_path, mode):
    """Tail batching with deferred=resume resumes a deferred prompt in a later long round: past
    the bound its samples are restarted from the prompt (the group kept), counted per step."""
    trainer, service, rows = run(
        tmp_path, mode, "rollout.policy=tail_batching", "rollout.tail_batching.deferred=resume",
        "rollout.tail_batching.long_round_size=3", "rollout.max_token_lag=1", steps=8)
    assert all(max(lags) <= 1 for lags in trainer.lags)
    restarts = sum(row["rollout/lag_restarts"] for row in rows)
    stats = service.buffer.stats()
    assert restarts > 0 and stats["lag_restarts"] == restarts  # every restart is in some step's row
    assert sum(row["rollout/lag_restart_tokens"] for row in rows) == stats["lag_restart_tokens"] > 0
    assert stats["balanced"] and stats["dropped"] == 0  # groups kept, not dropped

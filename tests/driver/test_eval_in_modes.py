"""Held-out evaluation in the driver's loops (real buffer, manager, evaluator; fake engines):
it runs at the configured steps on the weights of that step, between steps in sync and stream
and beside the next rollout in async, and never changes the training buffer or its accounting."""

import asyncio
import json

import pytest

from rlkit.buffers import ListPromptSource, PromptRecord
from rlkit.buffers.source import records_from_token_lists
from rlkit.driver.local import run_local
from rlkit.driver.loop import step_recorder
from rlkit.driver.rollout_service import RolloutService
from rlkit.tracking import EVAL_FILE, Tracker
from rlkit.rollout.evaluator import Evaluator
from rlkit.rollout.eval_config import EvalConfig
from tests.driver.test_modes import RecordingTrainer, mode_recipe, slow_tail
from tests.manager.fakes import FakeEngines

EVAL_MARK = 99  # first prompt token of a held-out prompt


class TracedEngines(FakeEngines):
    """FakeEngines that keep each request's (start, end, is_eval)."""

    def __init__(self, length, **kw):
        super().__init__(length, **kw)
        self.spans = []

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            return await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                          version=version, worker=worker)
        finally:
            self.spans.append((t0, loop.time(), sample.prompt_ids[0] == EVAL_MARK))


def held_out(n=3):
    return [PromptRecord((EVAL_MARK, i), text="", label=str(i % 2), source_index=i) for i in range(n)]


def length(sample):
    return 8 if sample.prompt_ids[0] == EVAL_MARK else slow_tail(sample)


def run_with_eval(tmp_path, mode, *extra, steps=4, every=2, before=True, evaluate=True):
    r = mode_recipe(tmp_path / mode, mode, *extra, steps=steps)
    engines = TracedEngines(length)
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(40)]), shuffle=False)

    async def score(sample, group):
        return float(sample.slot)

    async def eval_score(sample, group):  # prompts with label "1" are solved
        return float(group.prompt.label == "1")

    evaluator = None
    if evaluate:
        cfg = EvalConfig(datasets=[{"name": "held", "path": "unused.jsonl"}], every_steps=every,
                         before_first_step=before, n_samples=4, k=2)
        r = r.model_copy(update={"eval": cfg})
        evaluator = Evaluator(cfg, {"held": held_out()}, eval_score, r.rollout.sampling)
    service = RolloutService.from_config(r.rollout, source, engines, score, evaluator=evaluator)
    trainer = RecordingTrainer(engines)
    run_dir = tmp_path / mode
    tracker = Tracker(r.tracking, run_dir, "t", {})
    state = run_local(r, service, trainer, step_recorder(r, tracker, service, trainer, run_dir),
                      on_eval=tracker.log_eval)
    tracker.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = ([json.loads(x) for x in (run_dir / EVAL_FILE).read_text().splitlines()]
             if (run_dir / EVAL_FILE).is_file() else [])
    return state, service, engines, rows, evals


@pytest.mark.parametrize("mode", ["sync", "stream"])
def test_eval_runs_between_steps_at_the_configured_steps_on_that_step_s_weights(tmp_path, mode):
    state, service, engines, rows, evals = run_with_eval(tmp_path, mode)
    assert (state.step, state.version) == (4, 4)
    assert [e["step"] for e in evals] == [0, 2, 4]
    # generated with the weights the engines held after that many steps
    assert [e["eval/held/greedy/version"] for e in evals] == [0, 2, 4]
    assert [e["eval/held/sampled/version"] for e in evals] == [0, 2, 4]
    for e in evals:
        assert e["eval/held/greedy/prompts"] == 3 and e["eval/held/sampled/samples"] == 12
        assert e["eval/held/greedy/pass@1"] == pytest.approx(1 / 3)  # prompt 1 of 0..2
        assert e["eval/held/sampled/pass@2"] == pytest.approx(1 / 3)
        assert e["eval/held/greedy/mean_response_length"] == 8
    # between steps: no eval request overlapped a rollout request
    rollout = [(a, b) for a, b, is_eval in engines.spans if not is_eval]
    for a, b, is_eval in engines.spans:
        if is_eval:
            assert not any(a < rb and ra < b for ra, rb in rollout)


def test_eval_leaves_the_training_buffer_and_its_accounting_alone(tmp_path):
    _, with_eval, _, rows, evals = run_with_eval(tmp_path / "a", "sync")
    _, without, _, base_rows, no_evals = run_with_eval(tmp_path / "b", "sync", evaluate=False)
    assert evals and not no_evals
    assert with_eval.buffer.stats() == without.buffer.stats()
    same = [k for k in base_rows[0] if k.startswith(("buffer/", "batch/")) or k in (
        "rollout/groups_completed", "rollout/groups_launched", "rollout/tokens_generated")]
    assert [[r[k] for k in same] for r in rows] == [[r[k] for k in same] for r in base_rows]
    assert not any(k.startswith("eval/") for r in rows for k in r)  # eval rows are its own file


def test_async_eval_runs_beside_the_next_rollout_without_holding_up_the_step(tmp_path):
    extra = ("rollout.max_staleness=1", "train.algorithm.off_policy_correction=tis")
    state, _, engines, rows, evals = run_with_eval(tmp_path, "async", *extra, steps=5, every=1,
                                                   before=False)
    assert (state.step, state.version) == (5, 5)
    assert [e["step"] for e in evals] == [1, 2, 3, 4, 5]
    assert [e["eval/held/greedy/version"] for e in evals] == [1, 2, 3, 4, 5]
    # eval requests ran while the next step's rollout requests were in flight
    rollout = [(a, b) for a, b, is_eval in engines.spans if not is_eval]
    overlapped = [any(a < rb and ra < b for ra, rb in rollout)
                  for a, b, is_eval in engines.spans if is_eval]
    assert any(overlapped)
    # an evaluation shorter than a step costs the next step no wait: the sync found it done
    waits = [r["eval/wait_seconds"] for r in rows if "eval/wait_seconds" in r]
    assert waits and max(waits) < 0.02


def test_a_resumed_run_does_not_evaluate_its_checkpoint_again(tmp_path):
    from rlkit.driver.loop import LoopState

    r = mode_recipe(tmp_path, "sync", steps=4)
    cfg = EvalConfig(datasets=[{"name": "held", "path": "x.jsonl"}], every_steps=2,
                     before_first_step=True)
    r = r.model_copy(update={"eval": cfg})
    engines = FakeEngines(length)
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(40)]), shuffle=False)

    async def score(sample, group):
        return 1.0

    evaluator = Evaluator(cfg, {"held": held_out()}, score, r.rollout.sampling)
    service = RolloutService.from_config(r.rollout, source, engines, score, evaluator=evaluator)
    seen = []
    run_local(r, service, RecordingTrainer(engines), lambda *a: None, LoopState(step=2, version=2),
              on_eval=lambda step, m: seen.append(step))
    assert seen == [4]

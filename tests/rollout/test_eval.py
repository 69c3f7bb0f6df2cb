"""Evaluation core (rollout.evaluator, rollout.eval_config): the pass@k estimator, evaluate() over
fake and simulated engines, failures counted, and the training buffer left alone."""

from __future__ import annotations

import asyncio
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlkit.buffers import ListPromptSource, PromptRecord, RolloutBuffer
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import RewardConfig, SamplingConfig
from rlkit.rollout.evaluator import EvalResult, evaluate, pass_at_k
from rlkit.rollout.eval_config import EvalConfig, EvalDatasetConfig
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimEngines
from tests.manager.fakes import FakeEngines
from tests.sim.helpers import cluster


def exact(n: int, c: int, k: int) -> float:
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


# -- pass@k ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "n,c,k,want",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 0, 1, 0.0),
        (10, 0, 10, 0.0),
        (7, 7, 1, 1.0),
        (7, 7, 7, 1.0),
        (5, 2, 5, 1.0),  # k = n: any correct one is drawn
        (5, 0, 5, 0.0),
        (4, 1, 4, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (4, 3, 2, 1.0),  # n - c < k
        (10, 3, 3, 1 - 35 / 120),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct():
    for n in range(1, 30):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # math.comb(10000, 500) overflows a float; the product form does not.
    for n, c, k in [(10_000, 3, 500), (10_000, 9_000, 500), (100_000, 1, 1_000), (2_000, 7, 100)]:
        got = pass_at_k(n, c, k)
        assert 0.0 <= got <= 1.0 and math.isfinite(got)
        assert got == pytest.approx(exact(n, c, k), rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_the_exact_binomial_form(nck):
    n, c, k = nck
    got = pass_at_k(n, c, k)
    assert got == pytest.approx(exact(n, c, k), abs=1e-12)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= got - 1e-12  # more draws never hurt
    if c < n:
        assert pass_at_k(n, c + 1, k) >= got - 1e-12


@pytest.mark.parametrize(
    "n,c,k,words",
    [
        (5, 2, 6, "k (6) exceeds n (5"),
        (5, 6, 1, "c (6 correct) exceeds n (5"),
        (5, -1, 1, "c (correct samples) must be >= 0"),
        (5, 1, 0, "k must be >= 1"),
        (5, 1, -2, "k must be >= 1"),
        (0, 0, 1, "n (samples per prompt) must be >= 1"),
        (-3, 0, 1, "n (samples per prompt) must be >= 1"),
        (5.0, 1, 1, "n must be an int"),
        (5, True, 1, "c must be an int"),
    ],
)
def test_pass_at_k_rejects_bad_arguments(n, c, k, words):
    with pytest.raises(ValueError, match=rf"{words.replace('(', '[(]').replace(')', '[)]')}"):
        pass_at_k(n, c, k)


# -- evaluate() over fake engines -------------------------------------------------------------
def labelled(correct_per_prompt):
    """Prompts whose label says how many of their n responses the scripted reward accepts."""
    return [PromptRecord((1, i, 2), text="", label=c, source_index=i)
            for i, c in enumerate(correct_per_prompt)]


def scripted(seen=None):
    async def score(sample, group) -> float:
        if seen is not None:
            seen.append((sample, group))
        return 1.0 if sample.slot < group.prompt.label else 0.0
    return score


def run_eval(engines, prompts, score, **kw):
    args = dict(sampling=SamplingConfig(max_new_tokens=50), n=4, k=2, version=7)
    args.update(kw)
    return run_virtual(evaluate("math", prompts, engines, score=score, **args))


def test_evaluate_metrics_for_a_scripted_reward():
    # even slots stop at 10 tokens; odd slots would run to 100 and are cut at 50 ('length')
    engines = FakeEngines(lambda s: 10 if s.slot % 2 == 0 else 100)
    seen = []
    r = run_eval(engines, labelled([0, 2, 4]), scripted(seen))
    assert isinstance(r, EvalResult)
    assert (r.prompts, r.n, r.k, r.samples, r.scored, r.generated) == (3, 4, 2, 12, 12, 12)
    assert r.correct == [0, 2, 4]
    assert r.mean_reward == pytest.approx(6 / 12)
    assert r.pass_at_1 == pytest.approx((0 + 0.5 + 1) / 3)
    assert r.pass_at_k == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    assert r.mean_response_length == pytest.approx(30.0)
    assert r.max_response_length == 50
    assert r.truncation_rate == pytest.approx(0.5)
    assert (r.engine_failures, r.reward_failures, r.version) == (0, 0, 7)
    assert r.seconds > 0
    # every response was generated (and stamped) at the version asked for
    assert len(seen) == 12 and all(set(s.versions) == {7} for s, _ in seen)
    assert len({id(g) for _, g in seen}) == 3  # one throwaway group per prompt, with its label

    m = r.metrics()
    assert m["eval/math/pass@1"] == pytest.approx(0.5)
    assert m["eval/math/pass@2"] == pytest.approx(r.pass_at_k)
    assert m["eval/math/truncation_rate"] == pytest.approx(0.5)
    assert m["eval/math/failures/engine"] == 0 and m["eval/math/failures/reward"] == 0
    assert m["eval/math/version"] == 7 and m["eval/math/samples"] == 12
    assert all(isinstance(v, float) for v in m.values())
    assert set(r.metrics("val")) == {k.replace("eval/", "val/", 1) for k in m}


def test_success_threshold_decides_what_is_correct():
    async def graded(sample, group) -> float:
        return sample.slot / 4  # 0, .25, .5, .75

    engines = FakeEngines(lambda s: 8)
    r = run_eval(engines, [[1, 2]], graded, success_threshold=0.5)
    assert r.correct == [2] and r.pass_at_1 == pytest.approx(0.5)
    assert r.mean_reward == pytest.approx(1.5 / 4)
    assert r.truncation_rate == 0.0


def test_a_failing_reward_is_counted_and_scores_incorrect():
    async def flaky(sample, group):
        if sample.slot == 0:
            raise RuntimeError("grader crashed")
        if sample.slot == 1:
            return float("nan")
        if sample.slot == 2:
            await asyncio.sleep(100)  # past the timeout
        return 1.0

    engines = FakeEngines(lambda s: 8)
    r = run_eval(engines, [[1, 2], [3, 4]], flaky, reward_timeout_s=5.0)
    assert r.samples == 8 and r.generated == 8  # all were generated...
    assert r.scored == 2 and r.reward_failures == 6  # ...three per prompt could not be scored
    assert r.reward_failures_by_kind == {"error": 2, "invalid": 2, "timeout": 2}
    assert r.correct == [1, 1] and r.pass_at_1 == pytest.approx(0.25)  # failures are incorrect
    assert r.mean_reward == 1.0  # over the scored ones
    assert r.metrics()["eval/math/failures/reward"] == 6
    assert any("grader crashed" in e for e in r.errors)


def test_an_engine_failure_is_counted_not_dropped():
    engines = FakeEngines(lambda s: 8, fail=lambda s: s.slot == 1)
    r = run_eval(engines, labelled([4, 4, 4]), scripted())
    assert r.samples == 12 and r.engine_failures == 3 and r.reward_failures == 0
    assert r.generated == 9 and r.scored == 9
    assert r.correct == [3, 3, 3] and r.pass_at_1 == pytest.approx(0.75)
    assert all("worker crashed" in e for e in r.errors)


def test_bounded_concurrency():
    engines = FakeEngines(lambda s: 40)
    peak = 0

    async def main():
        nonlocal peak

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, sum((await engines.loads()).values()))
                await asyncio.sleep(0.0005)

        w = asyncio.create_task(watch())
        try:
            return await evaluate("m", [[1]] * 6, engines, SamplingConfig(max_new_tokens=50),
                                  n=4, k=4, score=scripted(), version=0, max_concurrency=3)
        finally:
            w.cancel()

    r = run_virtual(main())
    assert r.samples == 24 and r.generated == 24
    assert 1 <= peak <= 3


def test_evaluate_rejects_bad_arguments():
    engines = FakeEngines(lambda s: 8)
    for kw, words in [(dict(k=5), "k must be in"), (dict(n=0), "n must be >= 1"),
                      (dict(max_new_tokens=0), "max_new_tokens must be >= 1")]:
        with pytest.raises(ValueError, match=words):
            run_eval(engines, [[1]], scripted(), **kw)
    with pytest.raises(ValueError, match="no prompts"):
        run_eval(engines, [], scripted())


# -- simulated engines ---------------------------------------------------------------------------
def test_evaluate_over_simulated_engines_with_one_killed():
    sim = SimEngines(cluster(2))

    async def always(sample, group):
        return 1.0

    async def main():
        async def kill_later():
            await asyncio.sleep(0.05)
            sim.kill(sim.workers()[0])

        killer = asyncio.create_task(kill_later())
        r = await evaluate("sim", [[1, i] for i in range(8)], sim,
                           SamplingConfig(max_new_tokens=64), n=2, k=2, score=always, version=3)
        await killer
        return r

    r = run_virtual(main())
    assert r.samples == 16
    assert r.engine_failures > 0  # the killed engine's requests...
    assert r.generated + r.engine_failures == 16  # ...are counted, none lost
    assert r.scored == r.generated and r.truncation_rate == 1.0  # the sim runs to the cap
    assert r.max_response_length == 64 and r.version == 3


# -- the training buffer is never touched ---------------------------------------------------------
def make_buffer(rows: int = 12, n: int = 2) -> RolloutBuffer:
    return RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(rows)]), shuffle=False),
        n_samples_per_prompt=n, max_staleness=2,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.integers(1, 6), n=st.integers(1, 4), acquired=st.integers(0, 4),
    lengths=st.lists(st.integers(1, 80), min_size=1, max_size=5),
)
def test_an_evaluation_leaves_the_rollout_buffer_alone(prompts, n, acquired, lengths):
    buf = make_buffer()
    held = buf.acquire(acquired)  # a step in progress: groups in flight
    before = buf.stats()
    engines = FakeEngines(lambda s: lengths[s.slot % len(lengths)])
    r = run_eval(engines, [[9, i] for i in range(prompts)], scripted(), n=n, k=1,
                 sampling=SamplingConfig(max_new_tokens=40))
    assert buf.stats() == before
    assert all(s.status.value == "pending" for g in held for s in g.samples)
    assert r.samples == prompts * n and r.generated == r.samples
    assert r.truncation_rate == pytest.approx(
        sum(lengths[i % len(lengths)] > 40 for i in range(n)) / n)


# -- EvalConfig ---------------------------------------------------------------------------------
def test_eval_config_defaults_are_off_and_documented():
    cfg = EvalConfig()
    assert not cfg.enabled and not cfg.due(0) and not cfg.due(10)
    for model in (EvalConfig, EvalDatasetConfig):
        for name, f in model.model_fields.items():
            assert f.description, f"{model.__name__}.{name} has no description"
    with pytest.raises(ValidationError):
        EvalConfig(bogus=1)
    with pytest.raises(ValidationError):
        EvalDatasetConfig(name="a", path="x.jsonl", shuffle=True)


def test_eval_dataset_loader_options_match_the_data_section():
    from rlkit.config.schema import DataConfig

    ours = set(EvalDatasetConfig.model_fields) - {"name", "limit"}
    # eval keeps the file order, and trains no response (SFT's)
    theirs = set(DataConfig.model_fields) - {"shuffle", "response_key"}
    assert ours == theirs
    d = EvalDatasetConfig(name="x", path="p.jsonl")
    for key in theirs - {"path"}:
        assert getattr(d, key) == DataConfig.model_fields[key].get_default(call_default_factory=True)


def test_eval_config_validation():
    ds = [EvalDatasetConfig(name="gsm8k", path="g.jsonl")]
    with pytest.raises(ValidationError, match="exceeds eval.n_samples"):
        EvalConfig(datasets=ds, n_samples=4, k=8)
    with pytest.raises(ValidationError, match="unique"):
        EvalConfig(datasets=ds * 2)
    with pytest.raises(ValidationError, match="datasets is empty"):
        EvalConfig(every_steps=5)
    with pytest.raises(ValidationError, match="nothing to run"):
        EvalConfig(datasets=ds, greedy=False)
    with pytest.raises(ValidationError):
        EvalDatasetConfig(name="has space", path="g.jsonl")
    with pytest.raises(ValidationError):
        EvalConfig(datasets=ds, temperature=0)  # greedy is top_k=1, never temperature 0
    cfg = EvalConfig(datasets=ds, every_steps=5, before_first_step=True,
                     reward=RewardConfig(name="exact_match"))
    assert cfg.enabled and cfg.due(0) and cfg.due(5) and cfg.due(10) and not cfg.due(3)


def test_eval_passes():
    ds = [EvalDatasetConfig(name="a", path="a.jsonl"), EvalDatasetConfig(name="b", path="b.jsonl")]
    base = SamplingConfig(max_new_tokens=300, stop=["</answer>"], stop_token_ids=[7],
                          temperature=0.7, ignore_eos=True)
    cfg = EvalConfig(datasets=ds, n_samples=8, k=4, temperature=0.6, top_p=0.95,
                     max_new_tokens=128)
    passes = cfg.passes(base)
    assert [(p.name, p.n, p.k) for p in passes] == [
        ("a/greedy", 1, 1), ("a/sampled", 8, 4), ("b/greedy", 1, 1), ("b/sampled", 8, 4)]
    greedy, sampled = passes[0].sampling, passes[1].sampling
    assert greedy.top_k == 1 and sampled.top_k == -1
    assert (sampled.temperature, sampled.top_p) == (0.6, 0.95)
    for s in (greedy, sampled):
        assert s.max_new_tokens == 128 and s.stop == ["</answer>"] and s.stop_token_ids == [7]
        assert not s.ignore_eos
    assert EvalConfig(datasets=ds).passes(base)[0].sampling.max_new_tokens == 300
    assert [p.mode for p in EvalConfig(datasets=ds, greedy=False, n_samples=2).passes(base)] \
        == ["sampled", "sampled"]


# -- multi-turn evaluation: each sample an episode, with its environment ---------------------
class ScriptedTurns:
    """Engines over the scripted model of tests/manager/test_episodes (the guessing game by
    bisection, one token per character); `lose_at`: the request of that number (counted over
    the run) loses its engine after its first token, as a dead worker does."""

    def __init__(self, lose_at: int | None = None) -> None:
        self.lose_at, self.requests, self.budgets = lose_at, 0, []

    def workers(self) -> list[str]:
        return ["w0"]

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        from rlkit.rollout.engine_api import WorkerLost
        from tests.manager.test_episodes import STOP, ScriptedModel

        self.requests += 1
        self.budgets.append(max_new_tokens)
        assert STOP in sampling.stop  # the turn's stop, from the recipe's turn_stop
        lost = self.requests == self.lose_at
        model = ScriptedModel(sample, abort_at=1 if lost else None)
        model.version = version
        await model.generate(sampling)  # to the episode's budget, which max_new_tokens is left of
        if lost:
            raise WorkerLost("w0")
        return "w0"


def episode_runner_for(sampling):
    from rlkit.rollout.environments.guess_number import guess_number
    from rlkit.rollout.episodes import EpisodeRunner, multi_turn
    from tests.manager.test_episodes import STOP, CharCodec

    turn = sampling.model_copy(update={"stop": [*sampling.stop, STOP]})
    return EpisodeRunner(multi_turn, guess_number, CharCodec(), turn, env_kwargs={"max_turns": 12})


@pytest.mark.parametrize("lose_at", [None, 3], ids=["played", "engine lost mid-episode"])
def test_multi_turn_evaluation_plays_episodes_with_their_environment(lose_at):
    secrets = [37, 1, 100]
    prompts = [PromptRecord((1, 2), text="guess", label=x, source_index=i) for i, x in enumerate(secrets)]
    scored = []

    async def score(sample, group):  # the game ends with its own reward: never asked
        scored.append(sample.index)
        return 0.0

    engines = ScriptedTurns(lose_at)
    runner = episode_runner_for(SamplingConfig(max_new_tokens=400))
    result = run_eval(engines, prompts, score, n=2, k=1, episodes=runner,
                      sampling=SamplingConfig(max_new_tokens=400))
    assert result.pass_at_1 == 1.0 and result.mean_reward == 1.0 and not scored
    assert result.engine_failures == 0 and result.generated == 6
    turns = result.episodes["episodes/turns"]
    assert turns == engines.requests - (lose_at is not None)  # each request one model turn
    # an intro, then an answer after each turn but the last; the episode replayed after its
    # engine was lost had shown its intro (request 3 is a first turn: 6 episodes start at once)
    assert result.episodes["episodes/observations"] == turns + (lose_at is not None)
    assert result.episodes["episodes/episodes_ended"] == 6
    # an episode whose engine was lost is played again from a fresh environment, whole
    assert result.episodes["episodes/episodes_started"] == 6 + (lose_at is not None)
    metrics = result.metrics()
    assert metrics["eval/math/episodes/turns"] == turns
    assert metrics["eval/math/tool_failures/timeout"] == 0
    # the budget is the whole episode's: each turn asks for what is left of it
    assert max(engines.budgets) < 400 and len(set(engines.budgets)) > 1


def test_the_evaluator_gives_each_pass_its_own_episode_runner():
    from rlkit.rollout.evaluator import Evaluator

    cfg = EvalConfig(datasets=[EvalDatasetConfig(name="game", path="x.jsonl")], n_samples=2, k=1,
                     every_steps=1)
    made = []

    def episodes(sampling):
        made.append(sampling)
        return episode_runner_for(sampling)

    prompts = [PromptRecord((1, 2), text="guess", label=x, source_index=i) for i, x in enumerate([5, 60])]

    async def score(sample, group):
        return 0.0

    ev = Evaluator(cfg, {"game": prompts}, score, SamplingConfig(max_new_tokens=300), episodes=episodes)
    results = run_virtual(ev.run(ScriptedTurns(), version=3))
    assert len(made) == len(ev.passes) == len(results)
    assert all(s.max_new_tokens == p.sampling.max_new_tokens for s, p in zip(made, ev.passes))
    assert all(r.pass_at_1 == 1.0 and r.episodes["episodes/episodes_ended"] == r.samples for r in results)

"""The resource split (rlkit/gpu_plan.py, StreamRL Algorithm 1) and `rlkit plan`."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit import gpu_plan as P
from rlkit.cli import main
from rlkit.rollout.engines.profile import load_profile
from rlkit.sim.trace import TraceSpec, generate_trace


def gen_model(a: float, b: float):
    """Monotone P_gen: a fixed part (the longest response) plus work spread over x GPUs."""
    return lambda x: b + a / x


def train_model(c: float, d: float, sync: float = 2.0, overlap: float = 0.5):
    return lambda y: P.TrainCost(d + c / y, sync, overlap * c / y)


def brute_force(n, gen, train, units, mode):
    best = None
    for x, y in itertools.product(range(1, n + 1), repeat=2):
        if x + y > n or x % units.gen or y % units.train:
            continue
        s = P.step_time(mode, gen(x), train(y))
        best = s if best is None else min(best, s)
    return best


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 40), gen_unit=st.sampled_from([1, 2, 4]),
    train_unit=st.sampled_from([1, 2, 8]), a=st.floats(1, 1e4), b=st.floats(0, 100),
    c=st.floats(1, 1e4), d=st.floats(0, 50), mode=st.sampled_from(P.MODES),
)
def test_single_budget_picks_the_brute_force_argmin(n, gen_unit, train_unit, a, b, c, d, mode):
    units = P.Units(gen_unit, train_unit)
    gen, train = gen_model(a, b), train_model(c, d)
    if n < gen_unit + train_unit:
        with pytest.raises(P.PlanError, match="too small for one engine"):
            P.plan_single(n, gen, train, units, mode)
        return
    plan = P.plan_single(n, gen, train, units, mode)
    c_ = plan.chosen
    assert c_.x + c_.y <= n and c_.x % gen_unit == 0 and c_.y % train_unit == 0
    assert c_.step(mode) == pytest.approx(brute_force(n, gen, train, units, mode))
    assert all(c_.step(mode) <= r.step(mode) for r in plan.candidates)
    assert plan.even is not None and plan.speedup_vs_even >= 1.0 - 1e-12


def test_async_balances_the_stages():
    # P_gen = 480 / x, P_train = 160 / y + 1 sync: balanced at x = 3y, 16 GPUs -> 12 + 4
    gen = gen_model(480.0, 0.0)
    train = train_model(160.0, 0.0, sync=0.0)
    plan = P.plan_single(16, gen, train, P.Units(), "async")
    assert (plan.chosen.x, plan.chosen.y) == (12, 4)
    assert plan.chosen.step("async") == pytest.approx(40.0)
    assert (plan.even.x, plan.even.y) == (8, 8)
    assert plan.speedup_vs_even == pytest.approx(60.0 / 40.0)
    assert "least async step time" in plan.reason and "1.50x the even split" in plan.reason
    # sync mode minimises the sum: x/y = sqrt(480/160)
    s = P.plan_single(16, gen, train, P.Units(), "sync").chosen
    assert (s.x, s.y) == (10, 6)


def test_fewest_gpus_on_ties_and_measured_points_only():
    # generation is flat (tail-bound): in async the trainer needs no more than matches it
    gen = {1: 50.0, 2: 50.0, 4: 50.0, 6: 50.0}
    train = train_model(200.0, 0.0, sync=0.0)  # 200 / y
    plan = P.plan_single(8, gen, train, P.Units(), "async", xs=sorted(gen))
    assert (plan.chosen.x, plan.chosen.y) == (1, 4)
    assert [c.x for c in plan.candidates] == [1, 2, 4, 6]  # the even split (4, 4) is a row
    assert "3 GPUs left unused" in plan.reason
    with pytest.raises(P.PlanError, match=r"not multiples of 2"):
        P.plan_single(8, gen, train, P.Units(gen=2), "async", xs=[1, 2])


def test_step_time_per_mode():
    cost = P.TrainCost(train_s=30.0, sync_s=5.0, overlap_s=20.0)
    assert P.step_time("sync", 100.0, cost) == 135.0
    assert P.step_time("stream", 100.0, cost) == 100.0 + 10.0 + 5.0  # 20 s hidden
    assert P.step_time("stream", 10.0, cost) == 20.0 + 10.0 + 5.0  # training is the long pole
    assert P.step_time("async", 100.0, cost) == 100.0
    assert P.step_time("async", 10.0, cost) == 35.0
    with pytest.raises(P.PlanError, match="unknown mode 'fast'"):
        P.step_time("fast", 1.0, cost)


def test_step_time_over_measured_steps():
    cost = P.TrainCost(train_s=40.0, sync_s=0.0)
    # generation alternating 20 s and 60 s: async pays max per step, 50 s, not max(40, 40)
    assert P.expected_step("async", [20.0, 60.0], cost) == 50.0
    assert P.expected_step("sync", [20.0, 60.0], cost) == P.step_time("sync", 40.0, cost)
    assert P.expected_step("async", 30.0, cost) == 40.0
    # a steady generation beats a faster but variable one of the same mean, in async
    gen = {1: [40.0, 40.0], 2: [10.0, 66.0]}
    plan = P.plan_single(4, gen, lambda y: cost, P.Units(), "async")
    assert plan.chosen.x == 1 and plan.candidates[1].gen_s == 38.0
    assert plan.candidates[1].step("async") == 53.0
    with pytest.raises(P.PlanError, match="at least one measured step"):
        P.expected_step("async", [], cost)


def test_cross_datacenter_rule():
    gen = {x: 960.0 / x for x in range(1, 33)}  # P_gen(k) = 960 / k
    train = train_model(320.0, 0.0, sync=0.0)  # P_train(k) = 320 / k
    units = P.Units()
    # generation has GPUs to spare: P_gen(32) = 30 < P_train(8) = 40 -> (k, 8), 960/k ~ 40
    plan = P.plan_cross(32, 8, gen, train, units, "async")
    assert (plan.chosen.x, plan.chosen.y) == (24, 8) and plan.rule is plan.chosen
    assert "P_gen(m=32) = 30.0 s < P_train(n=8) = 40.0 s" in plan.reason
    # training has GPUs to spare: P_gen(8) = 120 >= P_train(32) = 10 -> (8, k), 320/k ~ 120
    plan = P.plan_cross(8, 32, gen, train, units, "async")
    assert (plan.chosen.x, plan.chosen.y) == (8, 3)  # |106.7 - 120| < |160 - 120|
    # k minimises |P_gen(k) - P_train(n)| even when that k is not the fastest
    odd = {4: 100.0, 8: 41.0, 16: 38.0}
    plan = P.plan_cross(16, 8, odd, train, P.Units(gen=4), "async")
    assert (plan.chosen.x, plan.chosen.y) == (8, 8)
    # sync mode: the sum is least with both budgets whole; the rule's split is reported too
    plan = P.plan_cross(32, 8, gen, train, units, "sync")
    assert (plan.chosen.x, plan.chosen.y) == (32, 8) and (plan.rule.x, plan.rule.y) == (24, 8)
    with pytest.raises(P.PlanError, match="generation budget of 1 GPUs is too small"):
        P.plan_cross(1, 8, gen, train, P.Units(gen=2), "async")


def test_dynamic_adjustment():
    a = P.adjustment(8, gen_s=100.0, train_stage_s=80.0, x_more=9, gen_more_s=90.0)
    assert (a.delta_s, a.delta_prime_s, a.add) == (20.0, 10.0, True)
    assert not P.adjustment(8, 100.0, 95.0, 9, 90.0).add  # delta 5 < delta' 10: overshoots
    assert not P.adjustment(8, 100.0, 120.0, 9, 130.0).add  # training is the slower stage
    assert not P.adjustment(8, 100.0, 80.0, 9, 100.0).add  # one more engine shortens nothing


def test_even_split_budget_and_grid():
    assert P.even_split(64, P.Units(1, 2)) == (32, 32)
    assert P.even_split(10, P.Units(4, 1)) == (4, 6)
    assert P.even_split(10, P.Units(2, 8)) == (2, 8)  # half is too few for the trainer
    with pytest.raises(P.PlanError, match=r"budget of 4 GPUs is too small for one engine "
                                          r"\(4 GPUs\) plus the smallest trainer \(1 GPU\)"):
        P.check_budget(4, P.Units(4, 1))
    assert P.grid(62, 1) == [1, 2, 4, 8, 16, 32, 62]
    assert P.grid(60, 4, extra=[32]) == [4, 8, 16, 32, 60]
    assert P.grid(20, 2, step=6, extra=[10]) == [6, 10, 12, 18, 20]
    with pytest.raises(P.PlanError, match="step 3 is not a positive multiple of 2"):
        P.grid(20, 2, step=3)


def test_search_bisects_towards_the_best_within_its_budget():
    calls = []

    def measure(x):
        calls.append(x)
        return 600.0 / x

    def score(x, g):  # async against P_train(64 - x) = 200 / (64 - x): balanced at x = 48
        return max(g, 200.0 / (64 - x))

    got = P.search_gen(P.grid(63, 1), measure, score, 1, max_measures=16)
    assert len(calls) == len(set(calls)) == 16  # 7 on the grid, 9 bisecting (of 63 sizes)
    assert min(got, key=lambda x: score(x, got[x])) == 48
    calls.clear()
    got = P.search_gen(P.grid(63, 1), measure, score, 1, max_measures=10)
    assert len(calls) == 10 and min(got, key=lambda x: score(x, got[x])) == 47
    with pytest.raises(P.PlanError, match="7 generation sizes .* more than the 3 allowed"):
        P.search_gen(P.grid(63, 1), measure, score, 1, max_measures=3)
    cached = {x: 600.0 / x for x in P.grid(63, 1)}
    calls.clear()
    P.search_gen(P.grid(63, 1), measure, score, 1, max_measures=2, measured=cached)
    assert len(calls) == 2  # the grid was free


def test_workload_helpers():
    assert P.gpus_per_engine(load_profile("h100-qwen2.5-32b-tp4")) == 4
    assert P.gpus_per_engine(load_profile("h100-qwen3-4b-tp2-april")) == 2
    assert P.gpus_per_engine(load_profile("docs/profiles/cpu-tiny-t1.json")) == 1
    trace = generate_trace(TraceSpec(rows=64, epochs=1, cap=512, group_size=4, batch_size=8))
    from rlkit.bench.suite import make_policy
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation

    steps = run_simulation(SimConfig(2, load_profile("h100-qwen3-4b-tp1")), trace,
                           make_policy("sync"), steps=3, batch_size=8)
    # the trainer's workload is what a synchronous run trains
    assert P.trained_tokens_per_step(trace, 8, 1, 2) == pytest.approx(
        (steps[1].train_tokens + steps[2].train_tokens) / 2)
    with pytest.raises(P.PlanError, match="has 64 groups, 72 needed"):
        P.trained_tokens_per_step(trace, 8, 1, 8)


SMALL = ["--profile", "h100-qwen2.5-7b-tp1", "--cap", "4096", "--batch-size", "32",
         "--prompts", "512", "--params", "7.6e9", "--steps", "2", "--warmup", "1"]


def test_cli_prints_the_table_and_the_split(capsys, tmp_path):
    cache = tmp_path / "cache.json"
    assert main(["plan", "--gpus", "8", "--mode", "async", "--cache", str(cache), *SMALL]) == 0
    out = capsys.readouterr().out
    assert "| gen GPUs | engines | train GPUs | P_gen s | P_train s |" in out
    assert "**chosen**" in out and "even split" in out
    assert "Chosen: " in out and "vs the even split (4 + 4)" in out and "delta' =" in out
    # --json, from the cache: no simulation
    assert main(["plan", "--gpus", "8", "--mode", "async", "--cache", str(cache), "--json",
                 *SMALL]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["simulations"] == 0
    c = plan["chosen"]
    assert c["gen_gpus"] + c["train_gpus"] <= 8 and plan["mode"] == "async"
    assert c["async_step_s"] == min(r["async_step_s"] for r in plan["candidates"])
    assert plan["even"]["gen_gpus"] == 4 and plan["even"]["train_gpus"] == 4


def test_async_choice_balances_better_than_an_even_split(capsys):
    """Qwen2.5-7B engines and trainer, 8 H100s, 32 x 8 at a 4k cap (default long-tail trace):
    an even split leaves the 4-GPU trainer 4.9 s idle per step; the plan gives generation one
    more GPU and the trainer one less, within 1.6 s of each other."""
    assert main(["plan", "--gpus", "8", "--mode", "async", "--json", *SMALL]) == 0
    plan = json.loads(capsys.readouterr().out)
    c, e = plan["chosen"], plan["even"]
    assert (c["gen_gpus"], c["train_gpus"]) == (5, 3)
    assert (e["gen_gpus"], e["train_gpus"]) == (4, 4)
    assert abs(c["imbalance_s"]) < 2.0 < 4.0 < abs(e["imbalance_s"])
    assert c["async_step_s"] < e["async_step_s"]
    assert plan["speedup_vs_even"] == pytest.approx(1.01, abs=0.005)


def test_cli_verify_simulates_the_mode_loop(capsys):
    assert main(["plan", "--gpus", "8", "--mode", "async", "--verify", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Simulated async loop (trainer included): chosen " in out and "even split " in out


def test_cli_cross_datacenter(capsys):
    assert main(["plan", "--gen-budget", "6", "--train-budget", "4", "--mode", "async",
                 "--json", *SMALL]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kind"] == "cross" and plan["rule"] == plan["chosen"]
    assert plan["chosen"]["gen_gpus"] <= 6 and plan["chosen"]["train_gpus"] <= 4


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "2", "--profile", "h100-qwen3-4b-tp2-april"],
     "--gpus of 2 GPUs is too small for one engine (2 GPUs) plus the smallest trainer (1 GPU): "
     "at least 3 GPUs (profile 'h100-qwen3-4b-tp2-april', --train-unit 1)"),
    (["--gpus", "8", "--profile", "no-such-gpu"], "--profile: no profile named 'no-such-gpu'"),
    (["--gpus", "8", "--profile", "missing.json"],
     "--profile: profile file missing.json does not exist"),
    (["--gen-budget", "8"], "--gen-budget and --train-budget go together"),
    (["--gpus", "8", "--gen-budget", "4", "--train-budget", "4"], "give --gpus N, or"),
    (["--gpus", "8", "--policy", "magic"], "--policy: "),
    (["--gpus", "64", "--profile", "h100-qwen3-4b-tp1", "--gen-step", "1", "--max-sim", "4"],
     "--max-sim 4 is less than the first grid"),
    (["--gpus", "64", "--gen-step", "3"], "--gen-step: step 3 is not a positive multiple of 2"),
])
def test_cli_errors_name_what_and_where(argv, message):
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert message in str(e.value)


# -- placement: colocated (turns on every GPU, sync only) against the best split -------------

def colocated_cost(n, gen, train, turn_s, units=P.Units()):
    return P.ColocatedCost(n, n // units.gen, (gen(n),), train(n).train_s, turn_s / 2, turn_s / 2)


def choose(n, gen, train, turn_s, mode="sync", units=P.Units()):
    split = P.plan_single(n, gen, train, units, mode).chosen
    return P.PlacementChoice(mode, split, colocated_cost(n, gen, train, turn_s, units))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 64), a=st.floats(1, 1e4), b=st.floats(0, 200), c=st.floats(1, 1e4),
       d=st.floats(0, 50), turn=st.floats(0, 100), mode=st.sampled_from(P.MODES))
def test_the_faster_placement_wins_by_its_ratio(n, a, b, c, d, turn, mode):
    gen, train = gen_model(a, b), train_model(c, d)
    ch = choose(n, gen, train, turn, mode)
    colo = gen(n) + train(n).train_s + turn  # rollout + train + turns, all on n GPUs
    assert ch.colocated.step_s == pytest.approx(colo)
    split = ch.disaggregated.step(mode)
    assert ch.winner == ("colocated" if colo < split else "disaggregated")
    assert ch.ratio == pytest.approx(max(colo, split) / min(colo, split)) and ch.ratio >= 1
    assert (P.mode_blocker(mode) is None) == (mode == "sync")


def test_the_winner_flips_where_the_turn_cost_crosses_the_split_saving():
    """Colocated gives both stages every GPU and pays the turns: it wins while the turns cost
    less than what the split loses to having each stage on part of the GPUs."""
    gen, train = gen_model(960.0, 20.0), train_model(320.0, 5.0, sync=2.0)
    n = 16
    split = P.plan_single(n, gen, train, P.Units(), "sync").chosen.step("sync")
    saving = split - (gen(n) + train(n).train_s)  # the break-even turn cost
    assert saving > 0
    turns = [0.0, saving / 2, saving * 0.999, saving * 1.001, 2 * saving, 100.0]
    points = [(t, choose(n, gen, train, t)) for t in turns]
    assert [p.winner for _, p in points] == ["colocated"] * 3 + ["disaggregated"] * 3
    assert P.flips(points) == [(turns[2], turns[3], "colocated", "disaggregated")]


def test_a_tail_bound_rollout_flips_towards_disaggregated_as_gpus_grow():
    """Generation bound by its longest response (flat past a few engines) gains nothing from
    every GPU, so colocation's gain is the trainer's share: as n grows the split's trainer is
    already fast, the fixed turns stay, and the winner flips; `flips` finds where."""
    gen = lambda x: 60.0 + 240.0 / min(x, 4)  # noqa: E731 - flat from 4 engines
    train = train_model(400.0, 5.0, sync=2.0)
    points = [(n, choose(n, gen, train, turn_s=8.0)) for n in (4, 8, 16, 32, 64)]
    winners = [p.winner for _, p in points]
    for n, p in points:  # each winner is what the numbers say
        assert p.winner == min(("colocated", p.colocated.step_s),
                               ("disaggregated", p.disaggregated_s), key=lambda w: w[1])[0]
    assert winners[0] == "colocated" and winners[-1] == "disaggregated"
    assert P.flips(points) == [(a, b, wa, wb) for (a, pa), (b, pb) in zip(points, points[1:])
                               if (wa := pa.winner) != (wb := pb.winner)]


def test_colocated_blockers():
    assert P.colocated_blocker(8, P.Units(2, 2)) is None
    assert "3 GPUs are not whole engines of 2 GPUs" in P.colocated_blocker(3, P.Units(2, 1))
    assert "not whole engines of 1 GPU and whole trainer replicas of 8" in P.colocated_blocker(
        12, P.Units(1, 8))
    assert "cannot run async mode" in P.mode_blocker("async")
    gen, train = gen_model(100.0, 1.0), train_model(100.0, 1.0)
    split = P.plan_single(8, gen, train, P.Units(), "sync").chosen
    assert P.PlacementChoice("sync", split, None, blocker="why").winner == "disaggregated"
    only = P.PlacementChoice("sync", None, colocated_cost(2, gen, train, 1.0),
                             split_blocker="too small")
    assert only.winner == "colocated" and only.ratio is None
    assert P.PlacementChoice("sync", None, colocated_cost(2, gen, train, 1.0)).winner is None


def _agrees(choice):
    """The JSON's winner and ratio are what its own step times say."""
    d, c = choice["disaggregated_step_s"], choice["colocated"]["sync_step_s"]
    assert choice["winner"] == ("colocated" if c < d else "disaggregated")
    assert choice["ratio"] == pytest.approx(max(c, d) / min(c, d))


def test_cli_placement_both_prints_a_winner_that_agrees_with_the_numbers(capsys, tmp_path):
    cache = tmp_path / "cache.json"
    argv = ["plan", "--gpus", "8", "--placement", "both", "--train-unit", "2", "--cache",
            str(cache), *SMALL]
    assert main([*argv, "--json", "--verify"]) == 0
    plan = json.loads(capsys.readouterr().out)
    choice = plan["placement_choice"]
    _agrees(choice)
    assert choice["disaggregated"] == plan["chosen"]  # the best split, as without --placement
    colo = choice["colocated"]
    assert (colo["gpus"], colo["engines"]) == (8, 8) and choice["colocated_mode_blocker"] is None
    assert colo["sync_step_s"] == pytest.approx(colo["gen_s"] + colo["train_s"] + colo["turn_s"])
    assert colo["turn_s"] == pytest.approx(sum(colo["turn_parts_s"].values()))
    # the sync policy trains what it generated: the model is the simulated colocated loop
    assert plan["verified"]["colocated"] == pytest.approx(colo["sync_step_s"], rel=1e-6)
    assert main(argv) == 0  # text, from the cache
    out = capsys.readouterr().out
    assert "| colocated | 8 (8 engines) | 8 | sync |" in out
    assert f"Faster: {choice['winner']}, by {choice['ratio']:.2f}x" in out
    # async: colocated cannot run it; its sync step is compared with the split's async step
    assert main([*argv, "--mode", "async", "--json"]) == 0
    choice = json.loads(capsys.readouterr().out)["placement_choice"]
    assert "cannot run async mode" in choice["colocated_mode_blocker"]
    assert choice["disaggregated_step_s"] == choice["disaggregated"]["async_step_s"]
    _agrees(choice)
    assert main([*argv, "--mode", "stream"]) == 0
    assert "Colocated cannot run stream mode" in capsys.readouterr().out


def test_cli_sweep_says_where_the_winner_flips(capsys, tmp_path):
    assert main(["plan", "--sweep", "gpus=4,8,16", "--train-unit", "2", "--json", *SMALL]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"] == "gpus" and [p["gpus"] for p in out["points"]] == [4, 8, 16]
    winners = []
    for p in out["points"]:
        _agrees(p["placement_choice"])
        winners.append(p["placement_choice"]["winner"])
    gpus = [4, 8, 16]
    assert out["flips"] == [{"between": [a, b], "from": wa, "to": wb}
                            for a, b, wa, wb in zip(gpus, gpus[1:], winners, winners[1:])
                            if wa != wb]
    assert main(["plan", "--sweep", "gpus=4,8,16", "--train-unit", "2", *SMALL]) == 0
    text = capsys.readouterr().out
    assert "| gpus | best split (gen + train) |" in text
    assert ("Flips between" in text) == bool(out["flips"])


@pytest.mark.parametrize("argv, message", [
    (["--placement", "colocated", "--gen-budget", "4", "--train-budget", "4"],
     "--placement colocated needs --gpus"),
    (["--placement", "colocated", "--gpus", "3", "--profile", "h100-qwen3-4b-tp2-april"],
     "3 GPUs are not whole engines of 2 GPUs"),
    (["--sweep", "cap=1024", "--placement", "colocated"],
     "give --gpus N"),
])
def test_cli_placement_errors(argv, message):
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert message in str(e.value)


def test_lora_prices_a_cheaper_trainer_and_an_adapter_sync(capsys):
    """--lora-params: the same plan with the trainer's base frozen (no weight gradients) and
    each sync the adapters alone: P_train falls (train and sync), the plan says so."""
    plans = []
    for extra in ([], ["--lora-params", "4e7"]):
        assert main(["plan", "--gpus", "8", "--mode", "async", "--json", *SMALL, *extra]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    full, lora = ({(r["gen_gpus"], r["train_gpus"]): r for r in p["candidates"]} for p in plans)
    common = full.keys() & lora.keys()  # the search may visit other sizes
    assert common
    for split in common:
        f, x = full[split], lora[split]
        assert x["train_s"] < f["train_s"] and x["sync_s"] < 0.1 * f["sync_s"]
    assert plans[1]["lora_params"] == 4e7
    assert main(["plan", "--gpus", "8", "--mode", "async", *SMALL, "--lora-params", "4e7"]) == 0
    assert "LoRA: 40.0M adapter params, adapter sync" in capsys.readouterr().out


# -- frozen engine groups: GPUs of their own; a teacher scoring every sample ------------------

def test_teacher_scoring_seconds_known_answer():
    # 1M tokens x 2 x 7e9 FLOPs = 1.4e16 FLOPs over 2 GPUs x 1e15 x 0.5 = 1e15 FLOP/s: 14 s
    assert P.teacher_score_s(1e6, 7e9, 2, 1e15, 0.5) == pytest.approx(14.0)
    assert P.teacher_score_s(1e6, 0.0, 2, 1e15, 0.5) == 0.0
    t = P.Teacher.of([[1000, 3000], [500] * 8], 1e9, 1, 1e12, 0.5)  # 4 us a token
    assert t.tokens == (4000, 4000) and t.samples == (2, 8)
    assert t.steps_s == pytest.approx((16.0, 16.0)) and t.mean_s == pytest.approx(16.0)
    for bad in [(1e6, 7e9, 0, 1e15, 0.5), (1e6, 7e9, 1, 1e15, 0.0), (-1, 7e9, 1, 1e15, 0.5)]:
        with pytest.raises(P.PlanError):
            P.teacher_score_s(*bad)


def test_a_teacher_lengthens_a_generation_bound_step_only_when_slower_plus_its_tail():
    # scoring overlaps generation: a faster teacher adds only its last sample's scoring
    assert P.rollout_with_teacher(100.0, 50.0, 10) == pytest.approx(105.0)
    assert P.rollout_with_teacher(100.0, 0.0, 10) == 100.0
    # a slower one bounds the rollout: its own time, plus the tail
    assert P.rollout_with_teacher(100.0, 200.0, 10) == pytest.approx(220.0)
    cost = P.TrainCost(train_s=30.0, sync_s=5.0)  # P_train 35 s: async is generation-bound
    for t, want in [(20.0, 100.0 + 2.0), (80.0, 100.0 + 8.0), (150.0, 150.0 + 15.0)]:
        teacher = P.Teacher((t,), (10,))
        (g,) = teacher.rollout(100.0)
        assert g == pytest.approx(want)
        assert P.step_time("async", g, cost) - P.step_time("async", 100.0, cost) == \
            pytest.approx(want - 100.0)
        assert (g - t / 10 > 100.0) == (t > 100.0)  # longer than the tail only when slower
    # per measured step: each step's generation against its own scoring
    assert P.Teacher((50.0, 150.0), (10, 10)).rollout([100.0, 100.0]) == \
        pytest.approx((105.0, 165.0))
    with pytest.raises(P.PlanError, match="3 measured generation steps against the teacher's 2"):
        P.Teacher((50.0, 150.0), (10, 10)).rollout([1.0, 2.0, 3.0])
    # in a plan: a teacher slower than every split's generation makes more engines useless
    gen = gen_model(480.0, 10.0)
    train = train_model(160.0, 0.0, sync=0.0)
    slow = P.Teacher((200.0,), (100,))
    plan = P.plan_single(16, lambda x: slow.rollout(gen(x)), train, P.Units(), "async")
    # 10 + 480 / x < 200 from x = 3: the fewest engines that keep up with the teacher
    assert plan.chosen.step("async") == pytest.approx(202.0) and plan.chosen.x == 3
    assert plan.chosen.y == 1  # 160 s of training hides under the 202 s rollout


def test_frozen_gpus_leave_the_rest_of_the_budget():
    assert P.after_frozen(10, 2, "--gpus") == 8 and P.after_frozen(10, 0) == 10
    with pytest.raises(P.PlanError, match="--gpus of 8 GPUs leaves none .* frozen engine "
                                          r"groups' 8 \(.*must exceed 8\)"):
        P.after_frozen(8, 8, "--gpus")


def test_cli_frozen_gpus_come_out_of_the_budget(capsys, tmp_path):
    """--gpus 10 --frozen-gpus 2 is --gpus 8's plan: the split never uses the frozen GPUs."""
    cache = ["--cache", str(tmp_path / "cache.json")]
    assert main(["plan", "--gpus", "8", "--mode", "async", "--json", *cache, *SMALL]) == 0
    eight = json.loads(capsys.readouterr().out)
    assert main(["plan", "--gpus", "10", "--frozen-gpus", "2", "--mode", "async", "--json",
                 *cache, *SMALL]) == 0
    frozen = json.loads(capsys.readouterr().out)
    assert frozen["simulations"] == 0  # the same sizes: the cache had them
    assert frozen["budgets"] == {"gpus": 8} and frozen["frozen_gpus"] == 2
    assert frozen["budget_with_frozen"] == {"gpus": 10} and frozen["teacher_s"] is None
    assert all(r["gen_gpus"] + r["train_gpus"] <= 8 for r in frozen["candidates"])
    assert frozen["chosen"] == eight["chosen"] and frozen["even"] == eight["even"]
    assert main(["plan", "--gpus", "10", "--frozen-gpus", "2", "--mode", "async", *cache,
                 *SMALL]) == 0
    out = capsys.readouterr().out
    assert "Budget: 8 GPUs (after the frozen engine groups' 2)" in out
    assert "Frozen engine groups: 2 GPUs of their own, out of --gpus 10" in out


def test_cli_teacher_prices_the_rollout_stage(capsys, tmp_path):
    """Each row's P_gen is the teacher-free simulation's max(G_k, T_k) + T_k / samples."""
    cache = ["--cache", str(tmp_path / "cache.json")]
    base = ["plan", "--gpus", "10", "--frozen-gpus", "2", "--mode", "async", "--json", *cache,
            *SMALL]
    assert main(base) == 0
    raw = {r["gen_gpus"]: r["gen_steps_s"] for r in json.loads(capsys.readouterr().out)[
        "candidates"]}
    for params, bound in [("7.6e9", False), ("2e11", True)]:
        assert main([*base, "--teacher-params", params]) == 0
        plan = json.loads(capsys.readouterr().out)
        t, samples = plan["teacher_steps_s"], plan["teacher_samples_per_step"]
        assert samples == 32 * 8 and plan["teacher_bound"] is bound
        tokens = plan["teacher_tokens_per_step"]
        assert tokens == pytest.approx(plan["trained_tokens_per_step"])  # prompt + response
        assert plan["teacher_s"] == pytest.approx(
            tokens * 2 * float(params) / (2 * 989e12 * 0.4))
        for r in plan["candidates"]:
            assert r["gen_steps_s"] == pytest.approx(
                [max(g, tk) + tk / samples for g, tk in zip(raw[r["gen_gpus"]], t)])
        c = plan["chosen"]
        assert plan["teacher_share_of_step"] == pytest.approx(
            plan["teacher_s"] / c["async_step_s"])
        assert plan["teacher_added_s"] == pytest.approx(
            c["gen_s"] - sum(raw[c["gen_gpus"]]) / len(raw[c["gen_gpus"]]))
    text = [a for a in base if a != "--json"]
    assert main([*text, "--teacher-params", "7.6e9"]) == 0
    out = capsys.readouterr().out
    assert "Teacher: 7.60B params scoring" in out and "of the chosen step" in out


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "8", "--frozen-gpus", "8"],
     "--frozen-gpus 8: --gpus of 8 GPUs leaves none to the policy's engines and the trainer "
     "beside the frozen engine groups' 8"),
    (["--gpus", "8", "--frozen-gpus", "12"], "must exceed 12"),
    (["--gpus", "4", "--frozen-gpus", "2", "--profile", "h100-qwen3-4b-tp2-april"],
     "--gpus 4 less --frozen-gpus 2, a budget of 2 GPUs is too small for one engine (2 GPUs) "
     "plus the smallest trainer (1 GPU)"),
    (["--gen-budget", "4", "--train-budget", "4", "--frozen-gpus", "4"],
     "--gen-budget of 4 GPUs leaves none"),
    (["--gen-budget", "3", "--train-budget", "4", "--frozen-gpus", "2", "--profile",
      "h100-qwen3-4b-tp2-april"], "--gen-budget 3 less --frozen-gpus 2 (1 GPUs) is too small"),
    (["--gpus", "8", "--teacher-params", "7e9"], "--teacher-params needs --frozen-gpus >= 1"),
    (["--gpus", "8", "--frozen-gpus", "1", "--teacher-params", "7e9", "--teacher-mfu", "0"],
     "--teacher-mfu in (0, 1]"),
])
def test_cli_frozen_errors_name_the_numbers(argv, message):
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    assert message in str(e.value)

"""`rlkit bench peer`: the pure parts with known numbers (TRL's batch layout, the per-step rows of
both sides, medians and rates over steps 2..N, the table and its ratio rows, pass@1's standard
error), the process-tree memory sum against real processes, TRL's feed in rlkit's own prompt
order, and (slow) the command's defaults scaled down to the tiny model: TRL and rlkit sync, two
steps each, evaluated on 4 held-out problems."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time

import pytest

from rlkit.bench import peer
from rlkit.bench.peer_trl import reward_function, trl_batch_layout
from rlkit.cli import main


# -- TRL's side ---------------------------------------------------------------------------------
def test_one_generation_batch_is_one_optimizer_step_in_micro_batches_of_8():
    # the real job: 8 prompts x 4 completions, micro-batch 8 as rlkit's recipe
    assert trl_batch_layout(32, 8) == {"per_device_train_batch_size": 8,
                                       "gradient_accumulation_steps": 4, "steps_per_generation": 4}
    assert trl_batch_layout(4, 8) == {"per_device_train_batch_size": 4,
                                      "gradient_accumulation_steps": 1, "steps_per_generation": 1}
    # no ragged micro-batch: the largest divisor that fits
    assert trl_batch_layout(12, 8)["per_device_train_batch_size"] == 6
    assert trl_batch_layout(14, 8)["gradient_accumulation_steps"] == 2


def test_trl_reward_is_rlkits_math_reward():
    fn = reward_function("math", {})
    completions = [[{"role": "assistant", "content": "so \\boxed{22}"}],
                   [{"role": "assistant", "content": "\\boxed{21}"}], "22"]
    prompts = [[{"role": "user", "content": "What is 8 + 14?"}]] * 3
    assert fn(prompts=prompts, completions=completions, label=["22", "22", "22"]) == [1.0, 0.0, 1.0]
    assert fn.__name__ == "math"


def test_trl_that_cannot_be_installed_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))

    class Failed:
        returncode, stdout = 1, ""
        stderr = "ERROR: No matching distribution found for trl==9.9.9\n"

    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: Failed())
    site, why = peer.ensure_trl("9.9.9")
    assert site is None and why == ("pip install trl==9.9.9 failed: ERROR: No matching "
                                    "distribution found for trl==9.9.9")
    assert not any((tmp_path / "peer").iterdir())  # no half-installed folder left to reuse
    # an installed one is reused without pip
    target = peer.trl_folder("1.2.3")
    assert target == tmp_path / "peer" / "trl-1.2.3"
    (target / "trl").mkdir(parents=True)
    (target / "trl-1.2.3.dist-info").mkdir()
    monkeypatch.setattr(peer.subprocess, "run", None)
    assert peer.ensure_trl("1.2.3") == (target, None)


def test_the_worker_without_trl_says_which_module_is_missing(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"out": str(tmp_path / "trl"), "threads": 1}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-c", "import sys; sys.modules['trl'] = None; "
                        "from rlkit.bench.peer_trl import main; sys.exit(main(sys.argv[1:]))",
                        str(config)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    report = json.loads((tmp_path / "trl" / "steps.json").read_text())
    assert report["skipped"].startswith("trl cannot be imported (") and "trl" in report["skipped"]


# -- per-step rows and their figures ----------------------------------------------------------------
def test_both_sides_become_the_same_per_step_rows():
    (r,) = peer.rlkit_steps([{"step": 1, "step/seconds": 10.0, "rollout/seconds": 3.0,
                              "train/seconds": 6.0, "sync/seconds": 0.5, "batch/reward_mean": 0.25,
                              "rollout/tokens_generated": 640, "train/samples": 32.0}], 32)
    assert (r["seconds"], r["rollout_seconds"], r["train_seconds"], r["sync_seconds"]) == (10, 3, 6, 0.5)
    assert (r["reward"], r["tokens"], r["samples"]) == (0.25, 640, 32)
    (t,) = peer.trl_steps([{"step": 1, "seconds": 10.0, "rollout_seconds": 4.0,
                            "generate_seconds": 3.5, "reward": 0.5, "tokens_generated": 320.0,
                            "completions": 32}])
    assert t["train_seconds"] == 6.0 and t["sync_seconds"] is None  # train = step - rollout
    assert (t["generate_seconds"], t["tokens"], t["samples"]) == (3.5, 320.0, 32)


def steps(seconds, rewards, samples=32, tokens=640):
    return [{"step": i + 1, "seconds": s, "rollout_seconds": s / 4, "train_seconds": s / 2,
             "sync_seconds": None, "generate_seconds": s / 4, "reward": r, "tokens": tokens,
             "samples": samples} for i, (s, r) in enumerate(zip(seconds, rewards))]


def test_medians_and_rates_leave_out_the_first_step():
    s = peer.summarize(steps([100, 10, 30, 20, 40], [0.1, 0.2, 0.3, 0.4, 0.5]), window=2)
    assert s["step_s"] == 25.0  # median of 10, 30, 20, 40: step 1's 100 s is warm-up
    assert s["rollout_s"] == 6.25 and s["train_s"] == 12.5
    assert s["completions_per_s"] == pytest.approx(4 * 32 / 100)
    assert s["tokens_per_s"] == pytest.approx(4 * 640 / 100)
    assert s["tokens_per_rollout_s"] == pytest.approx(4 * 640 / 25)
    assert s["reward_first"] == pytest.approx(0.15) and s["reward_last"] == pytest.approx(0.45)
    assert s["sync_s"] is None and s["steady_steps"] == [2, 3, 4, 5]
    one = peer.summarize(steps([7.0], [0.5]))  # one step: it is all there is
    assert one["step_s"] == 7.0 and one["completions_per_s"] == pytest.approx(32 / 7)


def test_pass_at_1_standard_error():
    assert peer.pass_at_1_se(0.59, 61) == pytest.approx(math.sqrt(0.59 * 0.41 / 61))
    assert peer.pass_at_1_se(0.0, 4) == 0.0
    assert math.isnan(peer.pass_at_1_se(0.5, 0))


def fake_result(trl_state="ok"):
    mem = {"peak_rss_bytes": 2 * 2**30, "peak_pss_bytes": 2**30, "peak_processes": 1, "samples": 5}
    trl = {"label": "TRL GRPOTrainer", "state": trl_state, "wall_s": 60.0, "memory": mem,
           "reason": None if trl_state == "ok" else "pip install trl==1.16.0 failed: no | network",
           "eval": {"pass@1": 0.5, "correct": 2, "n": 4}}
    if trl_state == "ok":
        trl["summary"] = peer.summarize(steps([9, 10, 10, 10], [0.1, 0.2, 0.3, 0.4]))
    sync = {"label": "rlkit sync", "state": "ok", "wall_s": 90.0, "same_prompts_as_trl": [True] * 4,
            "memory": {"peak_rss_bytes": 6 * 2**30, "peak_pss_bytes": 3 * 2**30,
                       "peak_processes": 26, "samples": 9},
            "summary": peer.summarize(steps([19, 20, 20, 20], [0.2, 0.2, 0.3, 0.3])),
            "eval": {"pass@1": 0.75, "correct": 3, "n": 4}}
    return {"settings": {"model": "tiny", "steps": 4, "prompts": 8, "samples": 4,
                         "max_new_tokens": 64, "seed": 1234, "trl_version": "1.16.0", "threads": 2},
            "eval_rows": 4, "runs": {"trl": trl, "sync": sync},
            "base_eval": {"pass@1": 0.25, "correct": 1, "n": 4},
            "unmatched": [list(u) for u in peer.UNMATCHED]}


def cells(table: str, label: str) -> list[str]:
    (line,) = [x for x in table.splitlines() if x.startswith(f"| {label}")]
    return [c.strip() for c in line.strip("|").split("|")][1:]


def test_the_table_has_a_column_per_run_and_ratios_against_trl():
    table = peer.format_table(fake_result())
    assert cells(table, "seconds per step, median") == ["10.0", "20.0"]
    assert cells(table, "completions trained per second") == ["3.20", "1.60"]
    assert cells(table, "completions/s vs TRL") == ["1.00x", "0.50x"]
    assert cells(table, "memory (PSS) vs TRL") == ["1.00x", "3.00x"]
    assert cells(table, "peak memory") == ["1.00 GiB PSS / 2.00 GiB RSS (1 process)",
                                           "3.00 GiB PSS / 6.00 GiB RSS (26 processes)"]
    assert cells(table, "mean reward") == ["0.250 -> 0.250", "0.250 -> 0.250"]
    assert cells(table, "held-out greedy pass@1 (base model 0.250 (1/4))") == ["0.500 (2/4)", "0.750 (3/4)"]
    assert cells(table, "steps on the same prompts") == ["(the feed)", "4/4 steps"]
    assert "TRL GRPOTrainer ±0.250, rlkit sync ±0.217, base ±0.217" in table
    for name, _ in peer.UNMATCHED:  # the settings that could not be matched, always
        assert f"- {name}: " in table


def test_a_skipped_trl_says_why_and_leaves_the_ratios_empty():
    table = peer.format_table(fake_result("skipped"))
    first = cells(table, "seconds per step, median")
    assert first == ["skipped: pip install trl==1.16.0 failed: no / network", "20.0"]
    assert cells(table, "completions/s vs TRL") == ["-", "-"]
    assert "- TRL skipped: pip install" in table


def test_runs_are_named_once_and_each_run_is_a_valid_recipe(tmp_path):
    from rlkit.config import load_recipe

    with pytest.raises(SystemExit, match="unknown nope"):
        peer.parse_runs("trl,nope")
    with pytest.raises(SystemExit, match="each run once"):
        peer.parse_runs("sync,sync")
    args = peer_args(["--steps", "3", "train.optimizer.lr=2e-5"])
    for name in ("sync", "default", "async"):
        r = load_recipe(peer.RECIPES / peer.RUNS[name][1],
                        peer.recipe_overrides(name, args, "tiny", tmp_path))
        assert (r.run.num_steps, r.rollout.batch_size, r.rollout.n_samples_per_prompt) == (3, 8, 4)
        assert r.train.optimizer.lr == 2e-5 and r.run.output_dir == str(tmp_path)
        assert r.checkpoint.every_steps == 0  # one checkpoint, at the end: the model evaluated
    async_ = load_recipe(peer.RECIPES / peer.RUNS["async"][1],
                         peer.recipe_overrides("async", args, "tiny", tmp_path))
    assert async_.mode == "async" and async_.rollout.max_staleness == 1  # it overlaps
    assert load_recipe(peer.RECIPES / "grpo_smollm2_cpu.yaml", []).rollout.policy == "partial"


def peer_args(argv):
    import argparse

    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    return parser.parse_args(argv)


# -- TRL's feed: rlkit's prompts in rlkit's order ----------------------------------------------------
def test_trls_feed_is_rlkits_epoch_order_with_rlkits_chat_template(tmp_path):
    from transformers import AutoTokenizer

    from rlkit.config import load_recipe
    from rlkit.data.builtin import builtin_rows
    from rlkit.rollout.demo_models import resolve_model_path

    model = resolve_model_path("tiny")
    recipe = load_recipe(peer.RECIPES / "grpo_smollm2_sync.yaml", [f"model.path={model}"])
    tok = AutoTokenizer.from_pretrained(model)
    feed = peer.rlkit_prompt_rows(recipe, 24, tok)
    data = list(builtin_rows("arithmetic?split=train"))
    order = list(range(len(data)))
    random.Random(f"{recipe.run.seed}:0").shuffle(order)  # rlkit's epoch 0 (EpochOrder)
    assert [r["source_index"] for r in feed] == order[:24]
    assert [r["label"] for r in feed] == [data[i]["label"] for i in order[:24]]
    assert feed[0]["prompt"] == [{"role": "user", "content": data[order[0]]["prompt"]}]
    # the text TRL renders is the text rlkit's loader renders
    from rlkit.data.prompts import load_prompts

    ds = load_prompts(recipe.data, tok)
    assert tok.apply_chat_template(feed[0]["prompt"], add_generation_prompt=True,
                                   tokenize=False) == ds.record(order[0]).text
    # past the end of an epoch the next one is reshuffled as rlkit does
    short = load_recipe(peer.RECIPES / "grpo_smollm2_sync.yaml",
                        [f"model.path={model}", "data.path=builtin:arithmetic?split=train&rows=5"])
    rows = peer.rlkit_prompt_rows(short, 7, tok)
    epoch1 = list(range(5))
    random.Random(f"{short.run.seed}:1").shuffle(epoch1)
    assert len({r["source_index"] for r in rows[:5]}) == 5
    assert [r["source_index"] for r in rows[5:]] == epoch1[:2]


def test_same_prompts_compares_each_step_with_the_feed(tmp_path):
    groups = tmp_path / "groups.jsonl"
    groups.write_text("".join(json.dumps({"step": s, "source_index": i}) + "\n"
                              for s, i in [(1, 5), (1, 3), (2, 9), (2, 7), (3, 1), (3, 8)]))
    trained = peer.trained_prompts(groups)
    assert trained == [[3, 5], [7, 9], [1, 8]]
    assert peer.same_prompts(trained, [3, 5, 9, 7, 2, 1], 2) == [True, True, False]
    assert peer.trained_prompts(tmp_path / "missing.jsonl") == []


# -- memory of a process tree ---------------------------------------------------------------------
def test_tree_memory_of_this_process_matches_its_own_rss():
    with open(f"/proc/{os.getpid()}/status") as f:
        vm_rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
    rss, pss, n = peer.tree_memory(os.getpid())
    assert n >= 1 and rss > 0 and 0 < pss <= rss
    assert abs(rss - vm_rss) < 0.2 * vm_rss + 64 * 2**20  # other child processes of pytest aside


def test_the_tree_holds_every_descendant_and_the_sampler_keeps_peaks(tmp_path):
    # a child that starts a grandchild holding 200 MB: both are in the tree, the peak sees it
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', "
            "'import time; x = bytearray(200 * 2**20); x[::4096] = b\"1\" * len(x[::4096]); "
            "time.sleep(3)']); time.sleep(3.5); p.wait()")
    m = peer.run_measured([sys.executable, "-c", code], tmp_path / "log", interval=0.2)
    assert m["rc"] == 0 and m["wall_s"] >= 3
    assert m["memory"]["peak_processes"] == 2
    assert m["memory"]["peak_rss_bytes"] > 200 * 2**20
    assert m["memory"]["peak_pss_bytes"] > 150 * 2**20 and m["memory"]["samples"] >= 5


def test_a_gone_process_is_an_empty_tree():
    p = subprocess.Popen(["true"])
    p.wait()
    time.sleep(0.05)
    assert peer.process_tree(p.pid) == [] and peer.tree_memory(p.pid) == (0, 0, 0)


# -- the command, scaled down ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.integration
def test_trl_on_the_tiny_model_trains_and_it_and_the_base_model_are_evaluated(tmp_path, capsys):
    """TRL's side, with the evaluations: per-step rows, memory, the TRL model and the base model
    scored; or TRL says why it was skipped. TRL comes from the cache (installed there once,
    reused). rlkit's side, one sync step, is the CLI smoke row (tests/commands/test_cli_smoke.py):
    both together took 126-158 s of CI, each alone under 40 s."""
    out = tmp_path / "peer"
    rc = main(["bench", "peer", "--model", "tiny", "--steps", "2", "--prompts", "2", "--samples",
               "2", "--max-new-tokens", "8", "--runs", "trl", "--eval-rows", "2",
               "--eval-engines", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads((out / "peer.json").read_text())
    assert (out / "peer.md").read_text().strip() == printed.strip()
    trl = report["runs"]["trl"]
    assert report["base_eval"]["n"] == 2
    if trl["state"] == "skipped":
        assert trl["reason"] and f"skipped: {trl['reason']}"[:40] in printed
    else:
        assert trl["state"] == "ok", trl
        assert [s["step"] for s in trl["steps"]] == [1, 2]
        assert all(s["seconds"] > 0 and s["rollout_seconds"] > 0 for s in trl["steps"])
        assert trl["memory"]["peak_rss_bytes"] > 0 and trl["memory"]["peak_processes"] == 1
        assert trl["trl"]["settings"]["per_device_train_batch_size"] == 4
        assert trl["eval"]["n"] == 2 and 0 <= trl["eval"]["pass@1"] <= 1
        assert "| completions/s vs TRL | 1.00x |" in printed
    assert "**Settings that could not be matched.**" in printed

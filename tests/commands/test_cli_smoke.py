"""Every `rlkit` command runs as documented: one row per command of rlkit/cli.py COMMANDS, run
through the real entry point (`rlkit.cli.main`, in this process) with its defaults, scaled down
by arguments where they are slow, asserting what it produced (exit code, report files that
parse, a figure in them). `test_the_table_covers_every_command` fails for a command without a
row.

Rows that start engines, Ray or megatron-core are marked slow and integration. `train`,
`export` and `eval` share one run: the session's `tiny_run` is `rlkit train` on the CI recipe
(one step, one checkpoint), which `export` then writes as an HF folder and `eval` evaluates.
Demo models are built once per session into a temporary RLKIT_CACHE.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from rlkit.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
TINY_RECIPE = ROOT / "recipes" / "grpo_tiny_ci.yaml"
SIM_PROFILE = "h100-qwen3-4b-tp1"
HEAVY = (pytest.mark.slow, pytest.mark.integration)


@dataclass
class Ctx:
    tmp: Path
    capsys: pytest.CaptureFixture
    request: pytest.FixtureRequest

    def run(self, *argv: str) -> str:
        """`rlkit ARGV` through the CLI entry point; asserts exit 0; returns its stdout."""
        self.capsys.readouterr()
        rc = main(list(argv))
        out, err = self.capsys.readouterr()
        assert rc == 0, f"rlkit {' '.join(argv)} exited {rc}\n{out[-2000:]}\n{err[-2000:]}"
        return out

    def report(self, folder: Path, name: str) -> dict | list:
        """A bench's report: NAME.md (its table) and NAME.json (parsed) in its --out folder."""
        assert (folder / f"{name}.md").read_text().strip()
        return json.loads((folder / f"{name}.json").read_text())


def png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path


# -- the rows --------------------------------------------------------------------------------
def config_show(c: Ctx) -> None:
    out = c.run("config", "show", str(TINY_RECIPE), "run.num_steps=2")
    assert "num_steps: 2" in out and "name: grpo-tiny" in out


def config_docs(c: Ctx) -> None:
    c.run("config", "docs", "--out", str(c.tmp / "reference.md"))
    assert (c.tmp / "reference.md").read_text() == (ROOT / "docs" / "recipe-reference.md").read_text()


def prepare_model(c: Ctx) -> None:
    out = c.run("prepare-model", "tiny")
    folder = Path(out.strip().splitlines()[-1])
    assert folder == Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny"
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] >= 1
    assert list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()


def check_reward(c: Ctx) -> None:
    out = c.run("check-reward", "math")  # the default recipe's reward
    assert "FAIL" not in out


def plot_metrics(c: Ctx) -> None:
    # the default run's rows, committed beside the README's chart
    c.run("plot", "metrics", str(ROOT / "docs" / "default-run" / "grpo_smollm2_cpu_metrics.jsonl"),
          "--out", str(c.tmp / "metrics.png"))
    png(c.tmp / "metrics.png")


def plot_timeline(c: Ctx) -> None:
    from rlkit.rollout.engines.profile import constant_profile
    from rlkit.rollout.policies import PartialPolicy
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation
    from rlkit.sim.trace import TraceSpec, generate_trace

    trace = generate_trace(TraceSpec(rows=32, epochs=2, cap=256, group_size=2, batch_size=4))
    cluster = SimConfig(2, constant_profile([0.005, 0.01], [1, 32], prefill_s_per_token=1e-5))
    run_simulation(cluster, trace, PartialPolicy(2.0), steps=2, batch_size=4,
                   timeline_path=c.tmp / "timeline.jsonl")
    out = c.run("plot", "timeline", str(c.tmp))  # --step last
    assert f"wrote {c.tmp / 'timeline_step1.png'}" in out
    png(c.tmp / "timeline_step1.png")


def plan(c: Ctx) -> None:
    out = c.run("plan", "--gpus", "8", "--json", "--profile", "h100-qwen2.5-7b-tp1", "--cap", "2048",
                "--prompts", "128", "--params", "7.6e9", "--warmup", "1", "--steps", "2")
    p = json.loads(out)
    assert p["chosen"]["gen_gpus"] + p["chosen"]["train_gpus"] <= 8 and p["chosen"]["gen_gpus"] >= 1


def bench_buffer(c: Ctx) -> None:
    out = c.tmp / "buffer"
    c.run("bench", "buffer", "--groups", "300", "--tokens", "256", "--rounds", "1", "--out", str(out))
    r = c.report(out, "buffer")
    assert r["groups"] == 300 and min(r["ops_per_s"].values()) > 0


def bench_suite(c: Ctx) -> None:
    out = c.tmp / "suite"
    c.run("bench", "suite", "--caps", "1024", "--policies", "sync,partial@1.5", "--batch-size", "4",
          "--group-size", "4", "--prompts", "64", "--engines", "2", "--profile", SIM_PROFILE,
          "--warmup", "1", "--steps", "2", "--out", str(out))
    rows = c.report(out, "suite")
    assert [r["policy"] for r in rows] == ["sync", "partial@1.5"]
    assert all(len(r["steps"]) == 2 for r in rows)
    png(out / "suite.png")


def bench_faults(c: Ctx) -> None:
    out = c.tmp / "faults"
    c.run("bench", "faults", "--cap", "1024", "--prompts", "64", "--batch-size", "4",
          "--group-size", "4", "--engines", "2", "--profile", SIM_PROFILE, "--steps", "2",
          "--train-gpus", "1", "--policies", "sync", "--scenarios", "baseline,kill", "--out", str(out))
    rows = c.report(out, "faults")["rows"]
    assert [r["scenario"] for r in rows] == ["baseline", "kill"]
    assert all(r["groups_lost"] == 0 and r["problems"] == [] for r in rows)


def bench_ranker(c: Ctx) -> None:
    out = c.tmp / "ranker"
    c.run("bench", "ranker", "--rows", "16", "--epochs", "2", "--batch-size", "8", "--warmup", "1",
          "--out", str(out))
    r = c.report(out, "ranker")
    assert set(r["rankers"]) == {"history", "learned", "prompt_length", "oracle"}
    assert "oracle" in (out / "ranker.md").read_text()


def bench_engine(c: Ctx) -> None:
    """Also the bench's own test: it writes a profile the simulator loads."""
    from rlkit.rollout.engines.profile import load_profile

    out = c.tmp / "engine"
    stdout = c.run("bench", "engine", "--models", "tiny", "--concurrency", "1,4", "--new-tokens",
                   "12", "--rounds", "1", "--profile-batch-sizes", "1,2,4", "--out", str(out))
    r = c.report(out, "engine")
    assert [m["concurrency"] for m in r["results"]] == [1, 4]
    assert all(m["generate_tok_s"][0] > 0 and m["engine_tok_s"][0] > 0 and m["ratio"] > 0
               for m in r["results"])
    assert r["conditions"]["stream_interval"] == 8
    (path,) = r["profiles"]
    profile = load_profile(path)
    assert Path(path).parent == out and profile.batch_sizes == (1, 2, 4)
    assert all(p > 0 for p in profile.ptl_s) and profile.prefill_s_per_token > 0
    assert "| engine / generate |" in stdout


def bench_train(c: Ctx) -> None:
    """Also the bench's own test: training, packing layouts and both weight-sync methods to a
    loopback receiver and to a real engine."""
    out = c.tmp / "train"
    stdout = c.run("bench", "train", "--models", "tiny", "--tp", "1", "--steps", "1", "--cpus", "2",
                   "--packing-rounds", "2", "--sync-model", "tiny", "--sync-rounds", "2",
                   "--sync-receivers", "loopback,engine", "--out", str(out))
    r = c.report(out, "train")
    (t,) = r["training"]
    assert t["model"] == "tiny" and t["train_tokens_per_s"] > 0 and 0.0 <= t["padding_fraction"] < 0.3
    (packing,) = r["packing"]
    layouts = packing["layouts"]
    assert layouts["padded"]["padding_fraction"] > 0.3
    assert layouts["packed-longest"]["padding_fraction"] < layouts["padded"]["padding_fraction"]
    assert layouts["packed-2048"]["padding_fraction"] < 0.05
    assert {(w["method"], w["receivers"]) for w in r["weight_sync"]} == {
        (m, rc) for m in ("distributed", "disk") for rc in ("loopback", "engine")} | {("tensor", "engine")}
    assert all(w["gb"] > 0 and w["seconds_per_gb"] > 0 for w in r["weight_sync"])
    assert "train tok/s" in stdout


def bench_rollout(c: Ctx) -> None:
    """Also the bench's own test: a trace file replayed on the real engines, exactly."""
    from rlkit.sim.trace import TraceSpec, generate_trace

    trace = generate_trace(TraceSpec(rows=32, epochs=2, group_size=2, cap=48, batch_size=2,
                                     prompt_median=8, prompt_min=4, prompt_max=16, vocab_size=500))
    path = trace.save(c.tmp / "t.jsonl")
    out = c.tmp / "rollout"
    stdout = c.run("bench", "rollout", "--trace", str(path), "--model", "tiny", "--engines", "1",
                   "--batch-size", "2", "--policy", "sync,tail_batching@1.5", "--steps", "3",
                   "--warmup-steps", "0", "--out", str(out))
    r = c.report(out, "rollout")
    assert r["trace"] == trace.name and r["config"]["cap"] == 48
    sync, tail = r["policies"]["sync"], r["policies"]["tail_batching@1.5"]
    assert sync["groups"] == tail["groups"] == 6
    # every sync response is exactly as long as the trace says: the replay is exact
    assert sync["tokens"] == sum(row["trained_tokens"] for row in sync["per_step"])
    assert {x["round"] for x in tail["per_step"]} <= {"short", "long", "sync"}
    assert "| tail_batching@1.5 |" in stdout


def bench_e2e(c: Ctx) -> None:
    out = c.tmp / "e2e"
    c.run("bench", "e2e", "--recipe", str(TINY_RECIPE), "--mode", "sync", "--steps", "1",
          "--out", str(out), "rollout.engine.num_engines=1")
    r = c.report(out, "e2e")
    (sync,) = r["sync"]
    assert sync["wall_s"] > 0 and sync["step_s"] > 0
    assert (out / "sync-0" / "metrics.jsonl").is_file()


def bench_learn(c: Ctx) -> None:
    """One configuration, one seed, two steps of the tiny model, 8 held-out problems: the
    report's structure, and every figure finite (one run: each costs a cluster's start-up;
    the table's comparison against the reference is tests/bench/test_bench_learn.py's)."""
    out = c.tmp / "learn"
    printed = c.run("bench", "learn", "--recipe", str(TINY_RECIPE), "--configs", "partial+tis",
                    "--seeds", "1", "--steps", "2", "--eval-every", "1", "--eval-rows", "8",
                    "--no-scale", "--out", str(out))
    report = c.report(out, "learn")
    assert report["settings"]["reference"] == "partial+tis"  # no sync: the first configuration
    assert report["settings"]["order"] == ["partial+tis/seed1"]
    assert math.isfinite(report["settings"]["initial_accuracy"])
    s = report["summary"]["partial+tis"]
    (run,) = report["runs"]["partial+tis"]
    assert "error" not in run and s["failed"] == 0
    assert [p["step"] for p in s["curve"]] == [0, 1, 2]
    assert [p["samples"] for p in s["curve"]] == [0, 8, 16]  # 4 groups of 2 a step
    for p in s["curve"]:
        assert all(math.isfinite(p[k]) for k in ("samples", "seconds", "accuracy"))
    assert 0 <= s["final_accuracy"] <= 1 and s["final_seconds"] > 0
    assert math.isfinite(s["step_seconds"]) and s["final_se"] is None  # one seed
    assert s["diff_vs_reference"] == 0
    assert "| partial+tis | 1 |" in printed


def bench_peer(c: Ctx) -> None:
    """rlkit's side only, one step, no evaluation: TRL (installed on demand from PyPI) and the
    evaluations are the bench's own slow test, tests/bench/test_bench_peer.py. The sync run
    trains on the prompts fed to TRL, in the same order."""
    out = c.tmp / "peer"
    printed = c.run("bench", "peer", "--model", "tiny", "--steps", "1", "--prompts", "2",
                    "--samples", "2", "--max-new-tokens", "8", "--runs", "sync", "--no-eval",
                    "--out", str(out), "rollout.engine.num_engines=1")
    r = c.report(out, "peer")
    sync = r["runs"]["sync"]
    assert sync["state"] == "ok" and [s["step"] for s in sync["steps"]] == [1]
    assert sync["memory"]["peak_pss_bytes"] > 0 and sync["same_prompts_as_trl"] == [True]
    assert "| seconds per step, median |" in printed


def bench_lora(c: Ctx) -> None:
    """One rank, one sync of each way: the adapter alone is a small share of the full weights,
    and the engine serves the trainer's policy after each (the weight-sync check)."""
    out = c.tmp / "lora"
    printed = c.run("bench", "lora", "--model", "tiny", "--ranks", "4", "--rounds", "1",
                    "--out", str(out))
    r = c.report(out, "lora")
    by = {(s["trainer"], s["sync"], s["method"]): s for s in r["syncs"]}
    assert set(by) == {("full", "full", "tensor"), ("LoRA r4", "adapter", "tensor"),
                       ("LoRA r4", "adapter", "disk"), ("LoRA r4", "merged", "tensor")}
    assert by[("LoRA r4", "adapter", "tensor")]["bytes_vs_full"] < 0.2
    assert by[("LoRA r4", "merged", "tensor")]["bytes_vs_full"] == 1.0
    assert all(s["check_abs_diff"] < 1e-4 for s in r["syncs"])
    lora = next(t for t in r["trainers"] if t["rank"] == 4)
    assert lora["trained_params_bytes"] < 0.2 * lora["params_bytes"] and lora["total_vs_full"] < 1
    assert "| LoRA r4 | adapter | tensor |" in printed


@dataclass
class TinyRun:
    path: Path  # the run folder
    seconds: float


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, smoke_cache) -> TinyRun:
    """`rlkit train` on the CI recipe, scaled down: one step, one engine, a checkpoint."""
    out = tmp_path_factory.mktemp("smoke-train")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLKIT_CACHE", str(smoke_cache))
        t0 = time.perf_counter()
        rc = main(["train", str(TINY_RECIPE), f"run.output_dir={out}", "run.num_steps=1",
                   "rollout.engine.num_engines=1", "checkpoint.every_steps=1",
                   "tracking.progress=false"])
        seconds = time.perf_counter() - t0
    assert rc == 0
    return TinyRun(out / "grpo-tiny", seconds)


def train(c: Ctx) -> None:
    run = c.request.getfixturevalue("tiny_run")
    rows = [json.loads(x) for x in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and rows[0]["version"] == 1
    assert rows[0]["batch/groups"] == 4 and rows[0]["buffer/balanced"]
    assert (run.path / "checkpoints").is_dir() and (run.path / "timeline.jsonl").stat().st_size


def export(c: Ctx) -> None:
    from safetensors.torch import load_file

    run = c.request.getfixturevalue("tiny_run")
    (ckpt,) = sorted((run.path / "checkpoints").iterdir())
    out = c.tmp / "exported"
    c.run("export", str(ckpt), str(out))
    assert json.loads((out / "config.json").read_text())["model_type"]
    (weights,) = out.glob("*.safetensors")
    assert len(load_file(str(weights))) > 0 and (out / "tokenizer.json").is_file()


def evaluate(c: Ctx) -> None:
    run = c.request.getfixturevalue("tiny_run")
    out = c.tmp / "eval.json"
    c.run("eval", str(run.path), "builtin:arithmetic?split=test&rows=4", "--engines", "1",
          "--set", "rollout.sampling.max_new_tokens=8", "--out", str(out))
    report = json.loads(out.read_text())
    assert report["version"] == 1  # the run's latest checkpoint, after its one step
    (greedy,) = report["results"]
    assert greedy["prompts"] == 4 and greedy["failures"] == 0 and 0 <= greedy["pass@1"] <= 1


def view(c: Ctx) -> None:
    """`rlkit view RUN` serves until Ctrl-C: started as a process, its printed URL answers with
    the page and the run's data, SIGINT stops it cleanly; --export-trace writes a valid trace."""
    import signal
    import subprocess
    import sys
    import urllib.request

    from rlkit.view.trace_export import validate_trace

    run = c.request.getfixturevalue("tiny_run")
    # SIGINT as a terminal's Ctrl-C: a child of a background job (CI) starts with it ignored
    proc = subprocess.Popen([sys.executable, "-m", "rlkit.cli", "view", str(run.path)],
                            stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        line = proc.stdout.readline()
        url = line.split()[2]
        assert url.startswith("http://127.0.0.1:") and "token=" in url, line
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b"rlkit view" in r.read()
        base, token = url.split("/?")
        with urllib.request.urlopen(f"{base}/api/overview?{token}", timeout=30) as r:
            overview = json.loads(r.read())
        assert overview["name"] == "grpo-tiny" and overview["steps"] == 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
    out = c.tmp / "trace.json"
    c.run("view", "--export-trace", str(run.path), str(out))
    trace = json.loads(out.read_text())
    assert validate_trace(trace) == [] and any(e.get("cat") == "request" for e in trace["traceEvents"])


def bench_view(c: Ctx) -> None:
    out = c.tmp / "bench-view"
    c.run("bench", "view", "--requests", "200", "--repeats", "1", "--out", str(out))
    r = c.report(out, "view")
    assert r["requests"] >= 200 and r["engines"] == 8
    assert set(r["page_load_s"]) == {"steps", "engines", "groups", "advice"}
    assert all(s > 0 for s in r["page_load_s"].values()) and r["timeline_redraw_s"] > 0
    assert r["page_errors"] == []  # a simulator run's pages load clean (a real run's: tests/e2e)


# command words -> (row, marks); fast rows first, the heavy ones share one tiny run
SMOKE: dict[tuple[str, ...], tuple[Callable[[Ctx], None], tuple]] = {
    ("config", "show"): (config_show, ()),
    ("config", "docs"): (config_docs, ()),
    ("check-reward",): (check_reward, ()),
    ("plot", "metrics"): (plot_metrics, ()),
    ("plot", "timeline"): (plot_timeline, ()),
    ("plan",): (plan, ()),
    ("bench", "buffer"): (bench_buffer, ()),
    ("bench", "suite"): (bench_suite, ()),
    ("bench", "faults"): (bench_faults, ()),
    ("bench", "ranker"): (bench_ranker, ()),
    ("prepare-model",): (prepare_model, ()),
    ("bench", "engine"): (bench_engine, HEAVY),
    ("bench", "rollout"): (bench_rollout, HEAVY),
    ("bench", "train"): (bench_train, HEAVY),
    ("train",): (train, HEAVY),
    ("export",): (export, HEAVY),
    ("eval",): (evaluate, HEAVY),
    ("bench", "e2e"): (bench_e2e, HEAVY),
    ("bench", "learn"): (bench_learn, HEAVY),
    ("bench", "peer"): (bench_peer, HEAVY),
    ("bench", "lora"): (bench_lora, HEAVY),
    ("view",): (view, HEAVY),
    ("bench", "view"): (bench_view, (pytest.mark.integration,)),
}


def test_the_table_covers_every_command():
    commands = [words for words, _, _ in COMMANDS]
    assert sorted(SMOKE) == sorted(commands), (
        f"without a smoke row: {sorted(set(commands) - set(SMOKE))}; "
        f"rows of no command: {sorted(set(SMOKE) - set(commands))}")


@pytest.fixture(scope="session")
def smoke_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("rlkit-cache")


@pytest.mark.parametrize("words", [
    pytest.param(words, marks=marks, id=" ".join(words)) for words, (_, marks) in SMOKE.items()
])
def test_command_runs_as_documented(words, smoke_cache, tmp_path, monkeypatch, capsys, request):
    import torch

    threads = torch.get_num_threads()  # `bench engine` sets this process's torch threads
    monkeypatch.setenv("RLKIT_CACHE", str(smoke_cache))
    monkeypatch.chdir(tmp_path)  # any default output lands here, not in the repository
    try:
        SMOKE[words][0](Ctx(tmp_path, capsys, request))
    finally:
        torch.set_num_threads(threads)

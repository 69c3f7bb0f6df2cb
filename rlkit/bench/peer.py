"""`rlkit bench peer`: the same GRPO job in Hugging Face TRL's GRPOTrainer and in rlkit, side by
side on this machine (docs/bench/peer.md).

Every run is its own process, one after the other: TRL (`python -m rlkit.bench.peer_trl`, with
TRL installed on demand into `<cache>/peer/trl-<version>`, never into the venv) and each rlkit
run (`rlkit train <recipe> ...`: `sync` is recipes/grpo_smollm2_sync.yaml, `default` the default
recipe recipes/grpo_smollm2_cpu.yaml (partial rollouts), `async` the sync recipe in mode=async
with rollout.max_staleness=1). All train the same model on the same prompts in the same order
(rlkit's epoch order, which TRL is fed row by row), the same reward and batch, with the
optimizer and clip settings of the resolved sync recipe.

Figures: per-step times, rewards and generated tokens from each run's own per-step record (TRL:
a callback and its logs, rlkit: metrics.jsonl); peak memory of the whole process tree (Ray,
engines, trainer, reward workers) sampled from /proc every 0.5 s; held-out greedy pass@1 of
every trained model and of the base model by `rlkit eval` (one evaluation harness for all).
What could not be matched between the two is listed in `UNMATCHED` and printed under the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from rlkit.bench.report import add_out_argument, out_folder, write_report
from rlkit.rollout.engines.process import log_tail, spawn

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
HELD_OUT = "builtin:arithmetic?split=test"

# run name -> (column label, recipe, recipe overrides); "trl" is TRL's GRPOTrainer.
RUNS: dict[str, tuple[str, str | None, list[str]]] = {
    "trl": ("TRL GRPOTrainer", None, []),
    "sync": ("rlkit sync", "grpo_smollm2_sync.yaml", []),
    "default": ("rlkit partial (default)", "grpo_smollm2_cpu.yaml", []),
    # async overlaps generation of step k+1 with training on step k only with max_staleness >= 1
    "async": ("rlkit async", "grpo_smollm2_sync.yaml", ["mode=async", "rollout.max_staleness=1"]),
}
# The recipe whose resolved settings (seed, data, optimizer, clip, sampling, reward) TRL runs with.
REFERENCE_RECIPE = "grpo_smollm2_sync.yaml"

# Settings that could not be matched between TRL and rlkit: printed under every table.
UNMATCHED: list[tuple[str, str]] = [
    ("sampling randomness", "TRL and rlkit draw samples from different random streams: the "
     "completions (and rewards) differ even where the prompts are the same."),
    ("prompts per step", "TRL and rlkit sync (and async) train on the same P prompts a step, in "
     "rlkit's epoch order. rlkit partial (the default recipe) launches over_provision x P groups "
     "a step, trains on the first P to complete and carries the rest over: another prompt "
     "sequence, by design."),
    ("threads and processes", "TRL is one process with --threads torch threads. rlkit runs its "
     "own layout on the same cores: the recipe's engine (one process with the cores' torch "
     "threads), a megatron-core trainer actor under Ray, reward workers. Each framework keeps "
     "its own layout."),
    ("gradient checkpointing", "TRL's GRPOConfig defaults it on; it is off here because rlkit's "
     "trainer does no activation recompute. A TRL user on defaults gets a slower train phase."),
    ("off-policy correction", "the rlkit recipes set off_policy_correction tis; TRL corrects only "
     "vLLM rollouts, and with its own generate (num_iterations=1) it is exactly on-policy. In "
     "rlkit sync the TIS weight stays about 1; rlkit async trains on samples one version old."),
    ("advantage eps", "the same formula, (r - mean) / (std + eps) with Bessel-corrected std per "
     "group; eps is 1e-4 in TRL, 1e-6 in rlkit (negligible)."),
    ("loss", "rlkit's token_mean is TRL's loss_type='dapo'; both: clip 0.2/0.28, KL weight 0, "
     "Adam (0.9, 0.98) eps 1e-8, no weight decay, grad-norm clip 1, constant lr."),
    ("generation", "TRL runs one padded batch through transformers' generate until the longest "
     "completion ends; rlkit's engines batch continuously. TRL's tokens are its logged "
     "completions/mean_length x completions (kept up to EOS); rlkit's are "
     "rollout/tokens_generated (partial: tokens generated in the step, carried-over groups "
     "included)."),
    ("step-time accounting", "TRL's step is the time between on_step_end callbacks (its "
     "per-step logging included); its train time is step minus rollout. rlkit's step is "
     "step/seconds (weight sync and Ray scheduling included), its train time the trainer's own "
     "train/seconds."),
    ("tracking", "rlkit runs with tracking.wandb=disabled and TRL with report_to='none': neither "
     "writes a tracker's files or runs its service process."),
    ("scale", "one run of each: no repeats. Rewards and pass@1 carry the noise given above."),
]

METRIC_KEYS = ("step/seconds", "rollout/seconds", "train/seconds", "sync/seconds",
               "batch/reward_mean", "rollout/tokens_generated", "train/samples")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="demo model name (tiny, smollm2) or HF model folder (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=12, help="training steps of every run")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="completion length cap")
    parser.add_argument("--runs", default="trl,sync,default,async",
                        help=f"runs, comma-separated, in order ({', '.join(RUNS)})")
    parser.add_argument("--eval-rows", type=int, default=0,
                        help=f"held-out problems evaluated ({HELD_OUT}, greedy pass@1) for every "
                        "trained model and the base model; 0: all of them; -1: no evaluation")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    parser.add_argument("--eval-engines", type=int, default=None, metavar="N",
                        help="engines of each `rlkit eval` (default: its recipe's); greedy "
                        "decoding gives the same answers on any number")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of TRL's process (default: this machine's cores)")
    parser.add_argument("--trl-version", default="1.16.0", help="TRL release installed and run")
    add_out_argument(parser, "peer")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value) of every rlkit run")


# -- the process tree's memory ------------------------------------------------------------------
def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process visible in /proc."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        out[int(entry.name)] = int(fields[1])
    return out


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (by ppid links), root first; empty if root is gone."""
    ppids = _ppids()
    if root not in ppids:
        return []
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def process_memory(pid: int) -> tuple[int, int] | None:
    """(RSS, PSS) of one process in bytes from /proc/PID/smaps_rollup (RSS from statm, PSS =
    RSS where smaps_rollup cannot be read); None when the process is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            values = {}
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Pss"):
                    values[key] = int(rest.split()[0]) * 1024
            if "Rss" in values:
                return values["Rss"], values.get("Pss", values["Rss"])
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return rss, rss
    except (OSError, ValueError, IndexError):
        return None


def tree_memory(root: int) -> tuple[int, int, int]:
    """(summed RSS, summed PSS, processes) of `root`'s process tree now. Summed RSS counts a
    page shared by several processes once per process; summed PSS shares it out."""
    rss = pss = n = 0
    for pid in process_tree(root):
        m = process_memory(pid)
        if m is not None:
            rss, pss, n = rss + m[0], pss + m[1], n + 1
    return rss, pss, n


class MemorySampler:
    """Samples a process tree's memory every `interval` seconds on a thread; keeps the peak of
    each sum and the peak process count."""

    def __init__(self, root: int, interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self.peak_rss = self.peak_pss = self.peak_processes = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peer-memory", daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        rss, pss, n = tree_memory(self.root)
        if n:
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self.peak_processes = max(self.peak_processes, n)
            self.samples += 1

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval):
                return

    def result(self) -> dict[str, int]:
        return {"peak_rss_bytes": self.peak_rss, "peak_pss_bytes": self.peak_pss,
                "peak_processes": self.peak_processes, "samples": self.samples}


def run_measured(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None,
                 interval: float = 0.5) -> dict[str, Any]:
    """Run `cmd` (output to `log`, a fresh one), sampling its process tree's memory: rc, wall_s,
    memory. In its own process group, stopped as the engines are (rollout/engines/process.py)."""

    log.unlink(missing_ok=True)  # spawn appends
    t0 = time.perf_counter()
    proc = spawn(Path(cmd[0]).name, cmd, log_path=log, env=env)
    try:
        with MemorySampler(proc.pid, interval) as sampler:
            rc = proc.process.wait()
        wall = time.perf_counter() - t0
    finally:  # Ctrl-C: the run's whole group goes down with it; at the end, what outlived it
        proc.stop(30)
    return {"rc": rc, "wall_s": wall, "memory": sampler.result()}


# -- TRL: installed on demand ---------------------------------------------------------------------
def trl_folder(version: str) -> Path:
    """`<cache>/peer/trl-<version>`, beside the demo models' cache (`$RLKIT_CACHE` or
    ~/.cache/rlkit)."""
    from rlkit.rollout.demo_models import cache_root

    return cache_root().parent / "peer" / f"trl-{version}"


def ensure_trl(version: str) -> tuple[Path | None, str | None]:
    """(the TRL folder, None), installing it there (`pip install --no-deps --target`, into a
    staging folder renamed into place) unless already there; (None, why) when it cannot be."""
    target = trl_folder(version)
    if (target / f"trl-{version}.dist-info").is_dir() and (target / "trl").is_dir():
        return target, None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    print(f"rlkit bench peer: installing trl=={version} into {target}", file=sys.stderr)
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet",
                            "--disable-pip-version-check", "--target", str(staging),
                            f"trl=={version}"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(staging, ignore_errors=True)
        return None, f"pip install trl=={version} failed ({e})"
    if p.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        last = (p.stderr or p.stdout).strip().splitlines()
        return None, f"pip install trl=={version} failed: {last[-1] if last else f'rc {p.returncode}'}"
    if target.exists():
        shutil.rmtree(target)
    staging.rename(target)
    return target, None


# -- the prompts, in rlkit's order -----------------------------------------------------------------
def rlkit_prompt_rows(recipe: Any, count: int, tokenizer: Any) -> list[dict[str, Any]]:
    """The first `count` prompts rlkit's prompt source gives for `recipe` (its data section and
    seed: the same loader, skipped rows and epoch order, rlkit.buffers.source.EpochOrder), as
    TRL rows `{"prompt": [messages], "label": ..., "source_index": row in the data}`."""
    from rlkit.buffers.source import EpochOrder
    from rlkit.data.prompts import _read_rows, load_prompts

    dataset = load_prompts(recipe.data, tokenizer)
    raw = dict(_read_rows(recipe.data.path)[1])
    order = EpochOrder(len(dataset), recipe.run.seed, recipe.data.shuffle)
    rows = []
    for _ in range(count):
        position, _epoch = order.next()
        record = dataset.record(position)
        prompt = raw[record.source_index][recipe.data.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if recipe.data.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": recipe.data.system_prompt})
        rows.append({"prompt": messages, "label": record.label,
                     "source_index": record.source_index})
    return rows


def trl_config(recipe: Any, model: str, out: Path, prompts: Path, threads: int) -> dict[str, Any]:
    """The TRL worker's settings, from the resolved sync recipe (docs/bench/peer.md)."""
    r, opt, algo, s = recipe.rollout, recipe.train.optimizer, recipe.train.algorithm, recipe.rollout.sampling
    return {
        "out": str(out), "model": model, "prompts": str(prompts), "threads": threads,
        "steps": recipe.run.num_steps, "seed": recipe.run.seed,
        "prompts_per_step": r.batch_size, "samples": r.n_samples_per_prompt,
        "micro_batch": recipe.train.micro_batch_size, "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature, "top_p": s.top_p, "top_k": max(s.top_k, 0),
        "lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip, "clip_low": algo.clip_low, "clip_high": algo.clip_high,
        "reward": r.reward.name, "reward_kwargs": dict(r.reward.kwargs or {}),
    }


# -- per-step rows, one shape for both -------------------------------------------------------------
def rlkit_steps(rows: Sequence[dict[str, Any]], completions: int) -> list[dict[str, Any]]:
    """rlkit's metrics.jsonl rows as the bench's per-step rows."""
    out = []
    for row in rows:
        out.append({
            "step": row.get("step"), "seconds": row.get("step/seconds"),
            "rollout_seconds": row.get("rollout/seconds"), "train_seconds": row.get("train/seconds"),
            "sync_seconds": row.get("sync/seconds"), "generate_seconds": row.get("rollout/seconds"),
            "reward": row.get("batch/reward_mean"), "tokens": row.get("rollout/tokens_generated"),
            "samples": row.get("train/samples", completions),
        })
    return out


def trl_steps(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The TRL worker's steps.json rows as the bench's per-step rows (train = step - rollout)."""
    out = []
    for row in rows:
        sec, roll = row.get("seconds"), row.get("rollout_seconds")
        out.append({
            "step": row.get("step"), "seconds": sec, "rollout_seconds": roll,
            "train_seconds": None if sec is None or roll is None else sec - roll,
            "sync_seconds": None, "generate_seconds": row.get("generate_seconds"),
            "reward": row.get("reward"), "tokens": row.get("tokens_generated"),
            "samples": row.get("completions"),
        })
    return out


def _values(steps: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(s[key]) for s in steps if s.get(key) is not None]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(steps: Sequence[dict[str, Any]], window: int = 4) -> dict[str, Any]:
    """A run's figures: medians over steps 2..N (step 1 pays the warm-up; all steps when there
    is one), rates over the same steps, reward windows of `window` steps at both ends."""
    steady = list(steps[1:]) or list(steps)
    seconds = _values(steady, "seconds")
    total_s = sum(seconds)
    rewards = [s.get("reward") for s in steps]
    known = [float(x) for x in rewards if x is not None]
    gen = _values(steady, "generate_seconds")
    return {
        "steps": len(steps), "steady_steps": [s.get("step") for s in steady],
        "step_s": _median(seconds),
        "rollout_s": _median(_values(steady, "rollout_seconds")),
        "train_s": _median(_values(steady, "train_seconds")),
        "sync_s": _median(_values(steady, "sync_seconds")),
        "completions_per_s": sum(_values(steady, "samples")) / total_s if total_s else None,
        "tokens_per_s": sum(_values(steady, "tokens")) / total_s if total_s else None,
        "tokens_per_rollout_s": (sum(_values(steady, "tokens")) / sum(gen)
                                 if gen and sum(gen) else None),
        "reward_first": _mean(known[:window]), "reward_last": _mean(known[-window:]),
        "rewards": rewards,
    }


def eval_figures(report: dict[str, Any]) -> dict[str, Any]:
    """pass@1, correct and n of an `rlkit eval` report's (first, greedy) pass."""
    r = report["results"][0]
    correct = sum(r.get("correct") or [])
    return {"pass@1": r["pass@1"], "correct": correct, "n": r["prompts"],
            "failures": r.get("failures", 0)}


def pass_at_1_se(p: float, n: int) -> float:
    """Standard error of a pass@1 measured on n problems: sqrt(p(1-p)/n)."""
    return math.sqrt(p * (1 - p) / n) if n > 0 else math.nan


# -- the table ---------------------------------------------------------------------------------
def _gib(b: float | None) -> str:
    return "-" if not b else f"{b / 2**30:.2f} GiB"


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _s(x: float | None) -> str:
    """Seconds: one decimal, two below 10 s."""
    return _f(x, 2 if x is not None and abs(x) < 10 else 1)


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def format_table(result: dict[str, Any]) -> str:
    runs: dict[str, dict[str, Any]] = result["runs"]
    st = result["settings"]
    names = list(runs)
    trl = runs.get("trl")
    trl_ok = trl is not None and trl["state"] == "ok"
    per_step = st["prompts"] * st["samples"]
    over = (f"medians and rates over steps 2-{st['steps']} (step 1 pays the warm-up)"
            if st["steps"] > 1 else "figures of the one step (warm-up included)")
    lines = [
        f"`{st['model']}`, {st['steps']} step(s) of {st['prompts']} prompts x {st['samples']} "
        f"completions (<= {st['max_new_tokens']} tokens), seed {st['seed']}, TRL {st['trl_version']} "
        f"with {st['threads']} torch thread(s); {over}.", "",
        "| | " + " | ".join(runs[n]["label"] for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]

    def row(label: str, cell) -> None:
        cells = []
        for n in names:
            r = runs[n]
            if r["state"] != "ok":
                cells.append(f"{r['state']}: {r['reason']}" if label == "seconds per step, median"
                             else "-")
            else:
                cells.append(cell(n, r, r["summary"]))
        lines.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " |")

    row("seconds per step, median", lambda n, r, s: _s(s["step_s"]))

    def rollout_train(n: str, r: dict, s: dict) -> str:
        text = f"{_s(s['rollout_s'])} / {_s(s['train_s'])}"
        return text + (f" (+{_f(s['sync_s'], 2)} weight sync)" if s.get("sync_s") is not None else "")

    row("rollout / train seconds per step, median", rollout_train)
    row("completions trained per second", lambda n, r, s: _f(s["completions_per_s"], 2))
    row("generated tokens per second, end to end", lambda n, r, s: _f(s["tokens_per_s"]))
    row("generated tokens per second, during rollout", lambda n, r, s: _f(s["tokens_per_rollout_s"]))
    row("process wall time, start to exit", lambda n, r, s: f"{r['wall_s']:.0f} s")

    def same_prompts(n: str, r: dict, s: dict) -> str:
        same = r.get("same_prompts_as_trl")
        if n == "trl":
            return "(the feed)"
        if same is None:
            return "-"
        return f"{sum(same)}/{len(same)} steps" + ("" if all(same) else " (different sequence)")

    row("steps on the same prompts as TRL's feed", same_prompts)

    def memory(n: str, r: dict, s: dict) -> str:
        m = r["memory"]
        return (f"{_gib(m['peak_pss_bytes'])} PSS / {_gib(m['peak_rss_bytes'])} RSS "
                f"({m['peak_processes']} process{'es' if m['peak_processes'] != 1 else ''})")

    row("peak memory, summed over the process tree", memory)
    w = min(4, st["steps"])
    row(f"mean reward, first {w} steps -> last {w}",
        lambda n, r, s: f"{_f(s['reward_first'], 3)} -> {_f(s['reward_last'], 3)}")
    row("reward per step", lambda n, r, s: " ".join(_f(x, 3) for x in s["rewards"]))

    base = result.get("base_eval")
    if result.get("eval_rows") is not None:
        base_text = (f"base model {base['pass@1']:.3f} ({base['correct']}/{base['n']})"
                     if base and "pass@1" in base else
                     f"base model {base['error']}" if base else "base model not evaluated")

        def held_out(n: str, r: dict, s: dict) -> str:
            e = r.get("eval")
            if not e:
                return "-"
            if "error" in e:
                return e["error"]
            return f"{e['pass@1']:.3f} ({e['correct']}/{e['n']})"

        row(f"held-out greedy pass@1 ({base_text})", held_out)

    trl_s = trl["summary"] if trl_ok else None

    def vs_trl(key: str, get) -> None:
        def cell(n: str, r: dict, s: dict) -> str:
            if not trl_ok:
                return "-"
            return f"{_f(_ratio(get(r), get(trl)), 2)}x"
        row(key, cell)

    vs_trl("completions/s vs TRL", lambda r: r["summary"]["completions_per_s"])
    vs_trl("memory (PSS) vs TRL", lambda r: r["memory"]["peak_pss_bytes"])

    notes = ["", "**Noise.**"]
    if trl_s is None and trl is not None:
        notes.append(f"- TRL {trl['state']}: {trl['reason']}")
    n_eval = next((r["eval"]["n"] for r in runs.values() if r.get("eval") and "n" in r["eval"]),
                  base["n"] if base and "n" in base else None)
    if n_eval:
        parts = [f"{runs[n]['label']} ±{pass_at_1_se(runs[n]['eval']['pass@1'], n_eval):.3f}"
                 for n in names if runs[n].get("eval") and "pass@1" in runs[n]["eval"]]
        if base and "pass@1" in base:
            parts.append(f"base ±{pass_at_1_se(base['pass@1'], n_eval):.3f}")
        notes.append(f"- pass@1 on {n_eval} problems: standard error sqrt(p(1-p)/n) = "
                     + ", ".join(parts) + f"; one problem is {1 / n_eval:.3f}.")
    window = w * per_step
    notes.append(f"- a {w}-step reward mean holds {window} completions: standard error about "
                 f"sqrt(p(1-p)/{window}), {pass_at_1_se(0.2, window):.3f} at p = 0.2 (more: the "
                 "completions of a prompt are correlated).")
    notes += ["", "**Settings that could not be matched.**"]
    notes += [f"- {name}: {text}" for name, text in result["unmatched"]]
    return "\n".join(lines + notes)


# -- running ------------------------------------------------------------------------------------
def parse_runs(text: str) -> list[str]:
    runs = [r.strip() for r in text.split(",") if r.strip()]
    if bad := [r for r in runs if r not in RUNS]:
        raise SystemExit(f"--runs: unknown {', '.join(bad)} (runs: {', '.join(RUNS)})")
    if len(set(runs)) != len(runs) or not runs:
        raise SystemExit(f"--runs: each run once, at least one (got {text!r})")
    return runs


def bench_overrides(args: argparse.Namespace, model: str, out: Path, name: str) -> list[str]:
    """The keys every rlkit run gets (the user's overrides come last and win)."""
    return [
        f"run.num_steps={args.steps}", f"run.output_dir={out}", f"run.name={name}",
        "run.resume=never", f"model.path={model}", f"rollout.batch_size={args.prompts}",
        f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        "eval.every_steps=0", "eval.before_first_step=false", "tracking.progress=false",
        "tracking.wandb=disabled",
        # one checkpoint, at the end (every_steps 0): the trained model `rlkit eval` scores
        "checkpoint.every_steps=0", "checkpoint.keep_last=1", "checkpoint.save_buffer=false",
    ]


def recipe_overrides(name: str, args: argparse.Namespace, model: str, out: Path) -> list[str]:
    return [*RUNS[name][2], *bench_overrides(args, model, out, name), *args.overrides]


def run_rlkit(name: str, args: argparse.Namespace, model: str, out: Path) -> dict[str, Any]:
    label, recipe, _ = RUNS[name]
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)  # this bench's own run folder of an earlier run
    cmd = [sys.executable, "-m", "rlkit.cli", "train", str(RECIPES / recipe),
           *recipe_overrides(name, args, model, out)]
    log = out / f"{name}.log"
    print(f"rlkit bench peer: {label}: rlkit train {recipe} ({log})", file=sys.stderr)
    m = run_measured(cmd, log)
    entry: dict[str, Any] = {"label": label, "command": cmd, "log": str(log), "folder": str(folder),
                             "wall_s": m["wall_s"], "memory": m["memory"], "rc": m["rc"]}
    metrics = folder / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] \
        if metrics.is_file() else []
    if m["rc"] != 0 or not rows:
        return {**entry, "state": "failed",
                "reason": f"rc {m['rc']}, {len(rows)} step(s) ({log_tail(log, 1)})"}
    steps = rlkit_steps(rows, args.prompts * args.samples)
    return {**entry, "state": "ok", "reason": None, "steps": steps, "summary": summarize(steps),
            "eval_model": str(folder), "prompts_per_step": trained_prompts(folder / "groups.jsonl")}


def trained_prompts(groups: Path) -> list[list[int]]:
    """The data rows (source_index) of the groups an rlkit run trained on, per step, sorted."""
    steps: dict[int, list[int]] = {}
    if groups.is_file():
        for line in groups.read_text().splitlines():
            if line.strip():
                g = json.loads(line)
                steps.setdefault(int(g["step"]), []).append(int(g["source_index"]))
    return [sorted(steps[s]) for s in sorted(steps)]


def same_prompts(trained: Sequence[Sequence[int]], feed: Sequence[int], per_step: int) -> list[bool]:
    """Per step: did the run train on exactly the prompts TRL is fed at that step (rows
    P(s-1)..Ps-1 of the feed)?"""
    return [sorted(feed[i * per_step:(i + 1) * per_step]) == list(t) for i, t in enumerate(trained)]


def run_trl(args: argparse.Namespace, recipe: Any, model: str, out: Path, threads: int,
            rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    label = RUNS["trl"][0]
    entry: dict[str, Any] = {"label": label, "wall_s": None, "memory": None}
    site, why = ensure_trl(args.trl_version)
    if site is None:
        return {**entry, "state": "skipped", "reason": why}
    folder = out / "trl"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "label": r["label"]}) + "\n"
                               for r in rows))
    config = folder / "config.json"
    config.write_text(json.dumps(trl_config(recipe, model, folder, prompts, threads), indent=1))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "rlkit.bench.peer_trl", str(config)]
    log = out / "trl.log"
    print(f"rlkit bench peer: {label}: trl {args.trl_version} from {site} ({log})", file=sys.stderr)
    m = run_measured(cmd, log, env)
    entry.update(command=cmd, log=str(log), folder=str(folder), wall_s=m["wall_s"],
                 memory=m["memory"], rc=m["rc"])
    report_file = folder / "steps.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    if "skipped" in report:
        return {**entry, "state": "skipped", "reason": report["skipped"]}
    if m["rc"] != 0 or not report.get("steps"):
        return {**entry, "state": "failed", "reason": f"rc {m['rc']} ({log_tail(log, 1)})"}
    steps = trl_steps(report["steps"])
    return {**entry, "state": "ok", "reason": None, "steps": steps, "summary": summarize(steps),
            "trl": {k: report.get(k) for k in ("trl_version", "torch_threads", "settings")},
            "eval_model": report["model"]}


def run_eval(model: str, out: Path, name: str, args: argparse.Namespace,
             eval_rows: int) -> dict[str, Any]:
    """`rlkit eval MODEL builtin:arithmetic?split=test` in a subprocess: greedy pass@1."""
    file = out / f"eval_{name}.json"
    file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "rlkit.cli", "eval", model, HELD_OUT, "--out", str(file),
           "--set", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
           "--set", "rollout.health.probe_timeout_s=30"]
    if eval_rows > 0:
        cmd += ["--limit", str(eval_rows)]
    if args.eval_engines:
        cmd += ["--engines", str(args.eval_engines)]
    log = out / f"eval_{name}.log"
    print(f"rlkit bench peer: evaluating {name} ({log})", file=sys.stderr)
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not file.is_file():
        return {"error": f"eval failed: rc {rc} ({log_tail(log, 1)})", "log": str(log)}
    return {**eval_figures(json.loads(file.read_text())), "file": str(file)}


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out).resolve()
    names = parse_runs(args.runs)
    for key in ("steps", "prompts", "samples", "max_new_tokens"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1")
    if args.samples < 2:
        raise SystemExit("--samples must be >= 2 (GRPO's advantage needs a group)")
    eval_rows = None if args.no_eval or args.eval_rows < 0 else args.eval_rows
    threads = args.threads or cores()

    from rlkit.config import load_recipe
    from rlkit.rollout.demo_models import resolve_model_path

    model = str(Path(resolve_model_path(args.model)).resolve())
    reference = load_recipe(RECIPES / REFERENCE_RECIPE,
                            [*bench_overrides(args, model, out, "trl"), *args.overrides])
    result: dict[str, Any] = {
        "settings": {"model": args.model, "model_path": model, "steps": args.steps,
                     "prompts": args.prompts, "samples": args.samples,
                     "max_new_tokens": args.max_new_tokens, "seed": reference.run.seed,
                     "threads": threads, "trl_version": args.trl_version, "cores": cores(),
                     "runs": names, "overrides": list(args.overrides),
                     "recipes": {n: RUNS[n][1] for n in names}},
        "eval_rows": eval_rows, "runs": {}, "base_eval": None,
        "unmatched": [list(u) for u in UNMATCHED],
    }
    from transformers import AutoTokenizer

    # TRL's feed: the prompts rlkit's own source gives, in its order, P per step
    feed = rlkit_prompt_rows(reference, args.steps * args.prompts,
                             AutoTokenizer.from_pretrained(reference.model.tokenizer or model))
    result["feed_source_index"] = [r["source_index"] for r in feed]
    for name in names:
        if name == "trl":
            entry = run_trl(args, reference, model, out, threads, feed)
        else:
            entry = run_rlkit(name, args, model, out)
            if entry["state"] == "ok":
                entry["same_prompts_as_trl"] = same_prompts(
                    entry["prompts_per_step"], result["feed_source_index"], args.prompts)
        result["runs"][name] = entry
        state = entry["state"] if entry["state"] == "ok" else f"{entry['state']}: {entry['reason']}"
        print(f"rlkit bench peer: {entry['label']}: {state}", file=sys.stderr)

    if eval_rows is not None:
        result["base_eval"] = run_eval(model, out, "base", args, eval_rows)
        for name, entry in result["runs"].items():
            if entry["state"] == "ok":
                entry["eval"] = run_eval(entry["eval_model"], out, name, args, eval_rows)

    table = format_table(result)
    print(table)
    write_report(out, "peer", result, table)
    return 1 if any(r["state"] == "failed" for r in result["runs"].values()) else 0

"""The table of process kind x phase -> outcome (docs/reliability.md, "Any process of a run"):
every case of tests/e2e/test_process_faults.py run once against a checkout, what the run did,
and whether the same command then finished it. It asserts nothing (the tests do): it measures,
so the same command describes a tree from before the fault handling as well as after it.

    python -m tests.e2e.process_fault_table [--root CHECKOUT] [--only SUBSTRING] [--out FILE]

`--root`: the checkout whose rlkit runs (default: this one); it must carry the test-only fault
switches (rlkit.common.fault_switch). Each case is one `rlkit train` of recipes/grpo_tiny_ci.yaml
(2 steps, a checkpoint each step, sync mode) with the case's switch armed, then the same command
again when the first did not finish.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlkit.common.fault_switch import RELEASE, read_fired
from tests.e2e.test_process_faults import CASES, STEPS, Case
from tests.netprobe import descendants

HERE = Path(__file__).resolve().parents[2]


def _cmd(root: Path, out: Path, case: Case) -> list[str]:
    return [sys.executable, "-m", "rlkit.cli", "train", str(root / "recipes" / "grpo_tiny_ci.yaml"),
            f"run.output_dir={out}", "checkpoint.every_steps=1", "checkpoint.keep_last=5",
            "tracking.progress=false", "mode=sync", "run.seed=7", f"run.num_steps={STEPS}",
            f"rollout.policy={case.policy}", *case.overrides]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# processes a run starts: its engine servers, its router, Ray's workers
RUN_PROCESSES = ("rlkit.rollout.engines.builtin.hf_server", "sglang_router", "ray::")


def _run_processes() -> set[int]:
    return {int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit()
            and any(p in _cmdline(int(d.name)) for p in RUN_PROCESSES)}


def _left_running(before: set[int], grace_s: float = 15.0) -> list[str]:
    """Processes of the run still alive once it ended (a watchdog gets `grace_s`); they are
    killed, so the next case starts clean."""
    deadline = time.monotonic() + grace_s
    while (left := _run_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    names = sorted({_cmdline(p).split(" --")[0][:60] for p in left})
    for pid in left:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except OSError:
            pass
    return names


def run_case(root: Path, case: Case, timeout_s: float = 300) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlkit-fault-") as tmp:
        tmp_path = Path(tmp)
        folder = tmp_path / "fault"
        env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(root), case.env: f"{case.spec},dir={folder}"}
        cmd = _cmd(root, tmp_path / "runs", case)
        already = _run_processes()
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = t0 + timeout_s
        while read_fired(folder) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if read_fired(folder) is not None and proc.poll() is None:  # release what holds there
            if case.kill_held:  # the armed one keeps holding: the victim dies meanwhile
                for pid in descendants(proc.pid):
                    if _cmdline(pid).startswith(case.kill_held):
                        os.kill(pid, signal.SIGKILL)
            else:
                (folder / RELEASE).touch()
        try:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            return {"case": case, "outcome": f"no end in {timeout_s:.0f} s", "s": timeout_s,
                    "left": _left_running(already)}
        seconds = time.monotonic() - t0
        left = _left_running(already)
        metrics = tmp_path / "runs" / "grpo-tiny" / "metrics.jsonl"
        steps = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        lines = err.strip().splitlines()
        if proc.returncode == 0:
            outcome = f"survived: {steps}/{STEPS} steps"
        elif "Traceback" in err:
            last = next((x for x in reversed(lines) if x.strip()), "")
            outcome = f"traceback ({len(lines)} lines): {last[:150]}"
        else:
            outcome = f"one line: {lines[-1][:400] if lines else ''}"
        resumed = ""
        if proc.returncode != 0:
            env2 = {k: v for k, v in env.items()}
            again = subprocess.run(cmd, cwd=root, env=env2, capture_output=True, text=True, timeout=timeout_s)
            steps2 = len(metrics.read_text().splitlines()) if metrics.exists() else 0
            resumed = f"rc {again.returncode}, {steps2}/{STEPS} steps"
        return {"case": case, "rc": proc.returncode, "outcome": outcome, "resumed": resumed,
                "s": seconds, "fired": read_fired(folder) is not None, "left": left}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=HERE)
    p.add_argument("--only", default="")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    rows = ["| process | phase | policy | rc | outcome | left running | same command again | s |",
            "|---|---|---|---:|---|---|---|---:|"]
    for case in CASES:
        if a.only and a.only not in case.id:
            continue
        r = run_case(a.root.resolve(), case)
        row = (f"| {case.process} | {case.phase} | {case.policy} | {r.get('rc', '-')} | "
               f"{r['outcome'].replace('|', '/')} | {', '.join(r['left']) or 'nothing'} | "
               f"{r.get('resumed') or '-'} | {r['s']:.0f} |")
        rows.append(row)
        print(row, flush=True)
        if a.out is not None:
            a.out.write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()

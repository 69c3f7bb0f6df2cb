"""Engine faults in a real run (Ray, the sglang-router, two built-in engines, megatron-core):
one engine is killed (SIGKILL) or hung (SIGSTOP) while it serves requests of step 2. The step
completes on the other engine, the lost requests go on there with their tokens, the engine is
restarted, given the current weights before the router lists it again, and serves in the
following steps; nothing is dropped and accounting balances; no process is left."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from rlkit.config import load_recipe
from rlkit.driver.run import train
from rlkit.rollout.protocol import total_requests
from tests.e2e.test_train_tiny import processes_with, rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]
STEPS = 30


def _get(url: str, timeout: float = 2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


class Injector(threading.Thread):
    """Waits for step `at_step` to run, then hits an engine serving requests; afterwards
    watches the restarted engine: its weight version when the router first lists it."""

    def __init__(self, model_dir: str, run_dir: Path, fault: str, at_step: int = 2) -> None:
        super().__init__(daemon=True)
        self.model_dir, self.run_dir, self.fault, self.at_step = model_dir, run_dir, fault, at_step
        self.victim: tuple[int, str] | None = None  # (pid, url)
        self.listed_version: str | None = None  # the restarted engine's, when first routed to
        self.version_at_fault: int | None = None
        self.error: str | None = None

    def engines(self) -> dict[int, str]:
        out = {}
        for pid in processes_with(self.model_dir):
            argv = _cmdline(pid)
            if "rlkit.rollout.engines.builtin.hf_server" not in argv:
                continue
            try:  # it binds a free port (--port 0): the one it listens on
                ports = [c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                continue
            if ports:
                out[pid] = f"http://{_arg(argv, '--host')}:{min(ports)}"
        return out

    def router(self) -> str | None:
        for pid in processes_with("sglang_router"):
            argv = _cmdline(pid)
            if _arg(argv, "--port"):
                return f"http://{_arg(argv, '--host')}:{_arg(argv, '--port')}"
        return None

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = f"{type(e).__name__}: {e}"

    def _run(self) -> None:
        deadline = time.monotonic() + 600
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:  # step at_step - 1 done: step at_step runs
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= self.at_step - 1:
                break
            time.sleep(0.05)
        self.version_at_fault = self.at_step - 1
        used_before: dict[str, int] = {}
        while time.monotonic() < deadline and self.victim is None:
            for pid, url in self.engines().items():
                try:
                    loads = _get(f"{url}/v1/loads")
                except Exception:  # noqa: BLE001
                    continue
                busy = total_requests(loads)
                used = sum(e.get("num_used_tokens", 0) for e in loads.get("loads", []))
                # More than a health probe (one one-token request at a time, also between
                # rollouts): the step's requests, which the fault must catch; and decoding
                # since the last look (its KV grew), so the running ones have streamed tokens:
                # a request killed before its first token is retried by the client unseen.
                decoding = used > used_before.get(url, used)
                used_before[url] = used
                if busy >= 2 and (decoding or self.fault == "kill_all"):
                    targets = self.engines() if self.fault == "kill_all" else {pid: url}
                    for p in targets:
                        os.kill(p, signal.SIGSTOP if self.fault == "hang" else signal.SIGKILL)
                    self.victim = (pid, url)
                    break
            time.sleep(0.02)
        assert self.victim is not None, "no engine ever had load"
        first = set(self.engines().values()) | {self.victim[1]}
        router = self.router()
        while time.monotonic() < deadline and router:
            new = [u for u in self.engines().values() if u != self.victim[1]]
            try:
                listed = {w["url"].rstrip("/") for w in _get(f"{router}/workers")["workers"]}
            except Exception:  # noqa: BLE001 - the router is gone: the run ended
                return
            for u in new:
                if u in listed and u not in first:
                    self.listed_version = str(_get(f"{u}/get_weight_version")["weight_version"])
                    return
            time.sleep(0.05)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_an_engine_lost_mid_step_is_survived_and_restarted(tmp_path, monkeypatch, fault):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    r = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [
        # sync: the step waits for every request, so the lost ones must go on elsewhere; steps
        # take ~1.5 s here and a restart ~10-30 s (model load on two busy cores): 30 steps
        f"run.output_dir={out}", "tracking.progress=false", f"run.num_steps={STEPS}",
        "rollout.policy=sync", "rollout.sampling.max_new_tokens=48",
        "rlkit.rollout.health.interval_s=1", "rlkit.rollout.health.probe_timeout_s=4",
        "rlkit.rollout.health.hung_after_timeouts=2", "rlkit.rollout.health.restart_backoff_s=0.5",
        # the router would itself retry, from scratch, a killed request that had streamed
        # nothing yet (most of them, early in a step), and rlkit would never see it lost
        "rollout.router.max_retries=0", "rollout.engine.stream_interval=1",
    ])
    run_dir = out / r.run.name
    model_dir = str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")
    injector = Injector(model_dir, run_dir, fault)
    injector.start()
    state = train(r)
    injector.join(timeout=30)
    assert injector.error is None, injector.error
    assert injector.victim is not None
    victim_url = injector.victim[1]
    assert (state.step, state.version) == (STEPS, STEPS)
    m = rows(run_dir)
    assert all(x["buffer/balanced"] for x in m) and not any(
        k.startswith("rollout/dropped/") for x in m for k in x)
    assert all(x["batch/groups"] == r.rollout.batch_size for x in m)
    # The lost engine's unfinished requests went on elsewhere, in the step it was lost in: the
    # injector waits for step at_step, but the engine it finds busy may already serve the next
    relaunched = [x["step"] for x in m if x["rollout/requests_relaunched"] > 0]
    assert relaunched and relaunched[0] >= injector.at_step
    step = m[relaunched[0] - 1]
    assert step["rollout/requests_relaunched"] > 0 and step["rollout/engine_failures"] == 0
    timeline = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]
    spans = [s for s in timeline if s.get("step") == relaunched[0] and s.get("kind") != "step"]
    lost = [s for s in spans if s.get("outcome") == "lost"]
    assert lost and {s["worker"] for s in lost} <= {victim_url, None}
    with_tokens = [s for s in lost if s["response_before"] + s["tokens"] > 0]
    for s in with_tokens:  # resumed on the other engine from where it stopped
        after = [x for x in spans if (x["group_id"], x["sample_index"]) == (s["group_id"], s["sample_index"])
                 and x["start"] >= s["end"]]
        assert after and after[0]["response_before"] == s["response_before"] + s["tokens"]
        assert after[0]["worker"] != victim_url
    # Restarted, given the weights before it was routed to again, and serving at the end.
    last = m[-1]
    assert last["engines/lost"] >= 1 and last["engines/restarted"] >= 1
    assert last["engines/serving"] == 2
    if injector.listed_version is not None:
        assert int(injector.listed_version) >= injector.version_at_fault
    # No process of the run is left, the stopped one included.
    assert processes_with(model_dir) == []


def test_every_engine_down_parks_everything_and_resume_continues(tmp_path, monkeypatch):
    """Both engines killed in step 2 with no restart allowed: the run stops with a message
    naming the checkpoint it wrote (every unfinished group parked with its tokens); resumed
    with resume=auto it finishes, and no group is trained twice or lost."""
    from rlkit.rollout.health import EnginesDown

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    base = [f"run.output_dir={out}", "tracking.progress=false", "run.num_steps=4",
            "checkpoint.every_steps=1", "rlkit.rollout.health.interval_s=1"]
    r = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [*base, "rlkit.rollout.health.max_restarts=0"])
    run_dir = out / r.run.name
    model_dir = str(Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny")
    injector = Injector(model_dir, run_dir, "kill_all")
    injector.start()
    # the injector waits for step 2, but the kill may land in a later step (its rollout had
    # ended when the loads were polled): the checkpoint is of the steps done before it
    with pytest.raises(EnginesDown, match=r"parked .* checkpoint of step (\d+) .*resume=auto") as down:
        train(r)
    injector.join(timeout=30)
    assert processes_with(model_dir) == []
    done = int(re.search(r"checkpoint of step (\d+)", str(down.value)).group(1))
    assert 1 <= done < 4
    parked = json.loads((run_dir / "checkpoints" / f"step_{done:06d}" / "state.json").read_text())
    assert parked["step"] == done
    state = train(load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", base))  # resume: auto
    assert (state.step, state.version) == (4, 4)
    m = rows(run_dir)
    assert [x["step"] for x in m] == [1, 2, 3, 4] and all(x["buffer/balanced"] for x in m)
    ids = [json.loads(x)["group_id"] for x in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 4 * r.rollout.batch_size
    assert processes_with(model_dir) == []

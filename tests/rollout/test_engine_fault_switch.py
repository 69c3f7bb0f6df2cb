"""The test-only fault switches (rlkit.common.fault_switch): parsing and the once-per-folder
record, then the built-in engine's ($RLKIT_TEST_ENGINE_FAULT, rollout/engines/builtin/fault.py)
on real servers over the tiny model: it dies or stops right after its N-th streamed token of
the weight version it names, and an engine started again with the same switch (what
rollout.health's restart does) runs clean."""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlkit.common.fault_switch import (ENGINE_FAULT_ENV, FaultSwitch, FaultSwitchError,
                                        read_fired)
from rlkit.rollout.engines.config import EngineConfig
from rlkit.rollout.engines.process import ManagedProcess, start_hf_server

ENGINE = EngineConfig(num_engines=1, cpu_threads=1, startup_timeout_s=120)
# A request whose tokens a loaded machine cannot all coalesce into its final chunk (the engine
# sends what decoded since its last chunk; one chunk for all would mean the server never ran)
LONG = 400


# -- the switch itself (no process) ------------------------------------------------------------
def test_unset_is_off_and_a_bad_switch_is_refused(monkeypatch, tmp_path):
    monkeypatch.delenv(ENGINE_FAULT_ENV, raising=False)
    assert FaultSwitch.from_env(ENGINE_FAULT_ENV, ("kill",), ("tokens",)) is None
    for bad, says in [("action=explode,tokens=1,dir=x", "action must be one of"),
                      ("action=kill,tokens=1", "dir=FOLDER is required"),
                      ("action=kill,dir=x", "missing keys ['tokens']"),
                      ("action=kill,tokens=1,dir=x,when=now", "unknown keys ['when']"),
                      ("action=kill,tokens", "is not key=value")]:
        monkeypatch.setenv(ENGINE_FAULT_ENV, bad)
        with pytest.raises(FaultSwitchError, match=says.replace("[", r"\[").replace("]", r"\]")):
            FaultSwitch.from_env(ENGINE_FAULT_ENV, ("kill",), ("tokens",))


def test_only_the_first_claim_fires_and_a_later_process_runs_clean(monkeypatch, tmp_path):
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=kill,tokens=3,dir={tmp_path / 'f'}")
    first = FaultSwitch.from_env(ENGINE_FAULT_ENV, ("kill",), ("tokens",))
    second = FaultSwitch.from_env(ENGINE_FAULT_ENV, ("kill",), ("tokens",))
    assert first is not None and second is not None and first.number("tokens") == 3
    assert first.claim(url="u1") and not second.claim(url="u2")
    fired = read_fired(tmp_path / "f")
    assert fired["url"] == "u1" and fired["action"] == "kill" and fired["pid"] == os.getpid()
    assert FaultSwitch.from_env(ENGINE_FAULT_ENV, ("kill",), ("tokens",)) is None  # restarted


# -- the built-in engine -----------------------------------------------------------------------
def _post(url: str, path: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def stream(url: str, max_new_tokens: int, prompt: list[int] | None = None) -> tuple[int, bool]:
    """One streamed request: (tokens received, whether it finished)."""
    body = {"input_ids": prompt or [5, 9, 13, 17], "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    received, finished = 0, False
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            for line in r:
                if line.startswith(b"data: {"):
                    meta = json.loads(line[6:])["meta_info"]
                    received = meta["completion_tokens"]
                    finished = finished or meta["finish_reason"] is not None
    except (urllib.error.URLError, ConnectionError, OSError, ValueError):
        pass  # the stream broke: the engine is gone or stopped
    return received, finished


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def state(pid: int) -> str | None:
    """The process's state letter (R, S, T stopped, Z zombie), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def until(pid: int, states: tuple[str | None, ...], timeout_s: float = 30) -> bool:
    """Wait until the process is in one of `states` (signals are delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while state(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.05)
    return state(pid) in states


@pytest.fixture
def engines():
    started: list[ManagedProcess] = []
    yield started
    for p in started:
        p.kill()  # SIGKILL to the group: a stopped engine too


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill_after_n_tokens_of_a_version_and_a_restarted_engine_runs_clean(
        tiny_model_dir, tmp_path, monkeypatch, engines):
    folder = tmp_path / "fault"
    monkeypatch.delenv("RLKIT_CONTROL_TOKEN", raising=False)
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=kill,tokens=5,version=7,dir={folder}")
    engines.append(proc := start_hf_server(str(tiny_model_dir), ENGINE, log_path=tmp_path / "e0.log"))
    assert stream(proc.url, 12) == (12, True)  # version 0: does not count
    _post(proc.url, "/update_weight_version", {"new_version": "7"})
    received, finished = stream(proc.url, LONG)
    assert proc.process.wait(30) == -9  # killed, as by SIGKILL
    fired = read_fired(folder)
    assert fired["pid"] == proc.pid and fired["url"] == proc.url
    assert fired["weight_version"] == "7" and fired["action"] == "kill"
    # right after the chunk with its 5th token of version 7: the client has those tokens
    assert not finished and received == fired["streamed_tokens"] and 5 <= received < LONG
    assert until(fired["core_pid"], (None, "Z"))  # its engine core went with it (Z: dead)

    # Started again with the same environment, as EngineActor.restart does: it runs clean.
    engines.append(again := start_hf_server(str(tiny_model_dir), ENGINE, log_path=tmp_path / "e0.log"))
    _post(again.url, "/update_weight_version", {"new_version": "7"})
    assert stream(again.url, 12) == (12, True) and again.alive() and healthy(again.url)
    assert read_fired(folder) == fired


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_hang_at_an_unfinished_request_stops_streaming_and_health(tiny_model_dir, tmp_path,
                                                                   monkeypatch, engines):
    folder = tmp_path / "fault"
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=hang,tokens=12,unfinished=1,dir={folder}")
    engines.append(proc := start_hf_server(str(tiny_model_dir), ENGINE, log_path=tmp_path / "e0.log"))
    # its 12th token finishes its request: unfinished=1 waits for a chunk that does not
    assert stream(proc.url, 12) == (12, True) and read_fired(folder) is None
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stream, proc.url, LONG)
        deadline, fired = time.monotonic() + 120, None
        while fired is None and not pending.done() and time.monotonic() < deadline:
            fired = read_fired(folder)  # written whole before it stops
            time.sleep(0.05)
        assert fired is not None and fired["pid"] == proc.pid and fired["streamed_tokens"] > 12
        assert not healthy(proc.url)  # no answer: stopped, not dead
        assert until(proc.pid, ("T",)) and until(fired["core_pid"], ("T",))
        proc.kill()  # what rollout.health's restart does first; the stream then breaks
        received, finished = pending.result(60)
    assert not finished and received == fired["streamed_tokens"] - 12 >= 1


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill_all_takes_every_engine_of_the_folder_at_once(tiny_model_dir, tmp_path, monkeypatch,
                                                           engines):
    folder = tmp_path / "fault"
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=kill_all,tokens=2,dir={folder}")
    with ThreadPoolExecutor(2) as pool:
        engines.extend(pool.map(lambda i: start_hf_server(
            str(tiny_model_dir), ENGINE, log_path=tmp_path / f"e{i}.log"), range(2)))
    first, other = engines
    assert healthy(other.url)
    stream(first.url, 12)
    assert first.process.wait(30) == -9 and other.process.wait(30) == -9
    assert read_fired(folder)["pid"] == first.pid


def test_the_engine_switch_takes_tokens_or_a_control_call(monkeypatch, tmp_path):
    from rlkit.rollout.engines.builtin.fault import EngineFault

    for bad, says in [("action=kill,dir=x", "one of them"),
                      ("action=kill,tokens=3,at=/flush_cache,dir=x", "one of them"),
                      ("action=kill,at=flush_cache,dir=x", "endpoint path"),
                      ("action=kill,at=/flush_cache,calls=0,dir=x", "calls >= 1")]:
        monkeypatch.setenv(ENGINE_FAULT_ENV, bad)
        with pytest.raises(FaultSwitchError, match=says):
            EngineFault.from_env()
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=kill,at=/begin_weight_update,calls=2,dir={tmp_path}")
    fault = EngineFault.from_env()
    assert fault is not None and (fault.at, fault.calls, fault.tokens) == ("/begin_weight_update", 2, None)
    assert fault.streamed(100, "0", False)  # tokens do not count for it


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_kill_at_the_k_th_call_of_a_control_endpoint(tiny_model_dir, tmp_path, monkeypatch, engines):
    """An engine dying as a weight sync, a sleep or a wake reaches it: the K-th call of the
    endpoint finds the connection reset, and the process is gone."""
    folder = tmp_path / "fault"
    monkeypatch.delenv("RLKIT_CONTROL_TOKEN", raising=False)
    monkeypatch.setenv(ENGINE_FAULT_ENV, f"action=kill,at=/flush_cache,calls=2,dir={folder}")
    engines.append(proc := start_hf_server(str(tiny_model_dir), ENGINE, log_path=tmp_path / "e0.log"))
    assert stream(proc.url, 4) == (4, True)
    flush = urllib.request.Request(f"{proc.url}/flush_cache", data=b"{}", method="POST")
    with urllib.request.urlopen(flush, timeout=60) as r:  # the first call is handled
        assert r.status == 200
    with pytest.raises((ConnectionError, urllib.error.URLError, http.client.RemoteDisconnected)):
        urllib.request.urlopen(flush, timeout=60)
    assert proc.process.wait(30) == -9
    fired = read_fired(folder)
    assert (fired["pid"], fired["at"], fired["calls"]) == (proc.pid, "/flush_cache", 2)


def test_the_trainer_switch_can_hold_a_step_until_released(monkeypatch, tmp_path):
    """action=hold: rank 0 waits at step K's batch for the release, then trains on (alive)."""
    from rlkit.common.fault_switch import RELEASE, TRAINER_FAULT_ENV
    from rlkit.train.fault import TrainerFault

    folder = tmp_path / "hold"
    monkeypatch.setenv(TRAINER_FAULT_ENV, f"action=hold,step=2,dir={folder}")
    fault = TrainerFault.from_env(rank=0)
    assert fault is not None and TrainerFault.from_env(rank=1) is None
    fault.at("batch", 0)  # step 1: nothing
    assert read_fired(folder) is None
    folder.mkdir()
    (folder / RELEASE).write_text("")
    fault.at("batch", 1)  # step 2: claims, finds the release, goes on (this process lives)
    assert read_fired(folder)["step"] == 2

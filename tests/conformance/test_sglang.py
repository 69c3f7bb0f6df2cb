"""rlkit against the real SGLang package it is pinned to (SGLANG_VERSION), on CPU.

The wheel is installed with --no-deps into a folder of its own under the cache (never into the
test venv: `sglang_available()` must stay false here), and checked in a subprocess
(tests/conformance/sglang_contract.py) that reads the package's own code: routes, request
classes and auth levels, /generate's contract gate and response schema, the server's argument
parser. What rlkit sends is recorded from rlkit itself (EngineClient, HttpEngineControl,
sglang_server_argv) talking to a recording fake worker. docs/engines.md lists what this keeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.rollout.engines.sglang_launcher import sglang_auth_flag

SGLANG_VERSION = "0.5.23"
# what sglang's API and argument modules import beyond the venv, pinned as checked
SGLANG_IMPORT_DEPS = ("msgspec==0.22.0", "pybase64==1.5.1", "pyzmq==27.3.0")
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sglang"
# endpoints the sglang-router (or a probe) calls without rlkit's control token
OPEN_PATHS = ["/generate", "/model_info", "/server_info", "/v1/loads", "/health_generate", "/health"]


# -- the auth flag, on both layouts (no wheel needed) -------------------------------------------
@pytest.mark.parametrize("layout", ["srt/server_args.py", "srt/arg_groups/fields/serving.py", None])
def test_auth_flag_is_read_from_where_sglang_declares_its_arguments(tmp_path, layout):
    """Older SGLang declared every server argument in srt/server_args.py; 0.5.23 declares them
    per group under srt/arg_groups/fields/ (admin_api_key in serving.py). Either way the control
    token must go to --admin-api-key, which leaves /generate and the router's probes open."""
    root = tmp_path / "sglang"
    (root / "srt").mkdir(parents=True)
    (root / "srt" / "server_args.py").write_text("api_key: Optional[str] = None\n")
    if layout is not None:
        (root / layout).parent.mkdir(parents=True, exist_ok=True)
        with (root / layout).open("a") as f:
            f.write("admin_api_key: Optional[str] = None\n")
    assert sglang_auth_flag(root) == ("--api-key" if layout is None else "--admin-api-key")


# -- the real package -------------------------------------------------------------------------
def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="session")
def sglang_site() -> tuple[Path, Path]:
    """(site with the sglang package, folder with its import deps), installed once per cache."""
    cache = Path(os.environ.get("RLKIT_CACHE") or Path.home() / ".cache" / "rlkit")
    home = cache / f"sglang-{SGLANG_VERSION}"
    site, deps, done = home / "site", home / "deps", home / "installed"
    if not done.exists():
        home.mkdir(parents=True, exist_ok=True)
        got = _pip("download", "--no-deps", "-d", str(home / "wheels"), f"sglang=={SGLANG_VERSION}",
                   *SGLANG_IMPORT_DEPS)
        if got.returncode != 0:
            text = got.stdout + got.stderr
            if any(s in text for s in ("No matching distribution", "Could not find a version",
                                       "connection", "Connection", "Temporary failure", "timed out")):
                pytest.skip(f"the package registry cannot give sglang=={SGLANG_VERSION}: {text[-300:]}")
            pytest.fail(f"pip download failed: {text[-2000:]}")
        wheels = sorted((home / "wheels").glob("*.whl"))
        for target, pick in ((site, [w for w in wheels if w.name.startswith("sglang-")]),
                             (deps, [w for w in wheels if not w.name.startswith("sglang-")])):
            got = _pip("install", "-q", "--no-deps", "--upgrade", "--target", str(target), *map(str, pick))
            assert got.returncode == 0, got.stdout + got.stderr
        done.write_text(SGLANG_VERSION)
    return site, deps


def test_the_venv_never_sees_the_checked_package(sglang_site):
    from rlkit.rollout.engines.sglang_launcher import sglang_available

    assert not sglang_available()  # the skip markers of GPU tests keep their meaning


def test_the_auth_flag_against_the_real_package(sglang_site):
    site, _ = sglang_site
    assert sglang_auth_flag(site / "sglang") == "--admin-api-key"


async def _record_rlkit_calls() -> list[list]:
    """[method, path, body] of every call rlkit makes to an engine worker, as sent."""
    from rlkit.buffers.sample import Sample
    from rlkit.rollout.client import EngineClient
    from rlkit.rollout.config import SamplingConfig
    from rlkit.train.weight_sync.engine_control import HttpEngineControl
    from tests.rollout.fake_worker import FakeWorker, answer_json, answer_sse

    worker = await FakeWorker().start()
    stream = (FIXTURES / "generate_stream_cumulative.sse").read_text()
    client = await EngineClient(None, worker_urls=[worker.url]).connect()
    try:
        samplings = [SamplingConfig(max_new_tokens=8),
                     SamplingConfig(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20,
                                    min_new_tokens=2, stop=["\n\n"], stop_token_ids=[2],
                                    ignore_eos=True)]
        for sampling in samplings:
            worker.generate.append(answer_sse(stream))
            await client.generate(Sample(index=0, group_id=0, prompt_ids=[1, 2, 3]), sampling,
                                  max_new_tokens=8, version=0, worker=worker.url)
        resumed = Sample(index=1, group_id=0, prompt_ids=[1, 2, 3])
        resumed.append([7, 8], [-0.1, -0.2], 0)
        resumed.interrupt()
        worker.generate.append(answer_sse(stream))
        await client.generate(resumed, samplings[1], max_new_tokens=6, version=0, worker=worker.url)
        worker.generate.append(answer_json(json.loads((FIXTURES / "generate_normal.json").read_text())))
        assert await client.probe(worker.url, 10) is None  # the health monitor's one-token /generate
        await client.abort("some-rid")
        await client.abort_all()
        await client.loads()

        ctl = HttpEngineControl(worker.url, timeout_s=30)
        for call in (ctl.tp_size, lambda: ctl.pause("abort"), lambda: ctl.pause("retract"),
                     lambda: ctl.pause("in_place"), ctl.flush_cache, ctl.continue_generation,
                     lambda: ctl.update_from_disk("/m", 3), lambda: ctl.update_from_disk("/m", 3, flush_cache=False),
                     lambda: ctl.init_group("127.0.0.1", 29500, 1, 3, "g", "nccl"), ctl.begin_update,
                     lambda: ctl.update_from_distributed(["w"], ["bfloat16"], [[2, 2]], "g", 3),
                     ctl.end_update, lambda: ctl.destroy_group("g"),
                     lambda: ctl.release_memory(["kv_cache", "weights"]), lambda: ctl.resume_memory(["weights"]),
                     lambda: ctl.release_memory(None)):
            await asyncio.to_thread(call)
    finally:
        await client.close()
        await worker.stop()
    calls = [[m, p, b] for (m, p), (_, b) in zip(worker.methods, worker.requests)]
    # the launcher's readiness probe (start_sglang_server) and the info endpoints
    return calls + [["GET", "/health_generate", None], ["GET", "/model_info", None]]


def _fixtures() -> list[list]:
    from rlkit.rollout.protocol import parse_sse_line

    out = []
    for f in sorted(FIXTURES.glob("generate_*.json")):
        out.append([f.name, json.loads(f.read_text())])
    for f in sorted(FIXTURES.glob("generate_*.sse")):
        for i, line in enumerate(f.read_text().splitlines()):
            payload = parse_sse_line(line)
            if payload is not None:
                out.append([f"{f.name}#{i}", payload])
    return out


def _argvs() -> list[list]:
    from rlkit.rollout.engines.config import EngineConfig
    from rlkit.rollout.engines.sglang_launcher import sglang_server_argv

    configs = [
        (EngineConfig(), {"tp_size": 1}),
        (EngineConfig(gpus_per_engine=2, sglang_args={"mem_fraction_static": 0.8,
                                                      "chunked_prefill_size": 8192}),
         {"tp_size": 2, "mem_fraction_static": 0.8, "chunked_prefill_size": 8192}),
        (EngineConfig(incremental_streaming_output=False, dtype="float16"), {"dtype": "float16"}),
        (EngineConfig(dtype="float32"), {"dtype": "float32"}),
    ]
    out = []
    for config, expect in configs:
        argv = sglang_server_argv("/models/m", config, index=0, port=30000)
        args = argv[argv.index("sglang.launch_server") + 1:]
        out.append([[*args, "--admin-api-key", "k"], {**expect, "model_path": "/models/m",
                                                     "port": 30000, "admin_api_key": "k"}])
    return out


@pytest.mark.integration
def test_rlkit_speaks_sglangs_own_schema_routes_auth_and_flags(sglang_site, tmp_path):
    site, deps = sglang_site
    cases = {"calls": asyncio.run(_record_rlkit_calls()), "fixtures": _fixtures(),
             "argvs": _argvs(), "open_paths": OPEN_PATHS}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "conformance" / "sglang_contract.py"),
                          str(site), str(deps), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    checks = json.loads(run.stdout.strip().splitlines()[-1])["checks"]
    failed = [f"{name}: {detail}" for name, ok, detail in checks if not ok]
    assert not failed, "\n".join(failed)
    names = [name for name, _, _ in checks]
    # every kind of check ran
    for kind in ("route ", "body ", "/generate body", "response ", "auth ", "argv "):
        assert any(n.startswith(kind) for n in names), kind
    assert sum(n.startswith("/generate body") for n in names) == 4  # 3 generations + the probe

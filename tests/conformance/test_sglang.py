"""rlkit against the real SGLang package it is pinned to (SGLANG_VERSION), on CPU.

The wheel is installed with --no-deps into a folder of its own under the cache (never into the
test venv: `sglang_available()` must stay false here), and checked in a subprocess
(tests/conformance/sglang_contract.py) that runs the package's own code: routes, request
classes (types and values, as FastAPI validates them), auth decisions and the /server_info
builder, /generate's contract gate and response schema, the server's argument parser, its
tensor deserializer. What rlkit sends is recorded from rlkit itself (EngineClient,
HttpEngine, the in-memory weight push, sglang_server_argv through token_exec's
substitution) talking to a recording fake worker; what SGLang's code builds comes back and is
read by rlkit's own parsers. docs/engines.md lists what this keeps. In CI (CI=true) a wheel the
registry cannot give is a failure: a skip there would pass with no check at all.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.config import load_recipe
from rlkit.rollout.engines.sglang_launcher import sglang_auth_flags

SGLANG_VERSION = "0.5.23"
# what sglang's API and argument modules import beyond the venv, pinned as checked
SGLANG_IMPORT_DEPS = ("msgspec==0.22.0", "pybase64==1.5.1", "pyzmq==27.3.0")
ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sglang"
# begins with '-', as a secrets.token_urlsafe token may: SGLang's argparse must still read it
TOKEN = "-conformance-token-0123456789abcdefghijklmnop"


# -- the auth flag, on both layouts (no wheel needed) -------------------------------------------
@pytest.mark.parametrize("layout", ["srt/server_args.py", "srt/arg_groups/fields/serving.py", None])
def test_auth_flags_are_read_from_where_sglang_declares_its_arguments(tmp_path, layout):
    """Older SGLang declared every server argument in srt/server_args.py; 0.5.23 declares them
    per group under srt/arg_groups/fields/ (admin_api_key in serving.py). Either way the token
    is the API key, and the admin key too where SGLang has one."""
    root = tmp_path / "sglang"
    (root / "srt").mkdir(parents=True)
    (root / "srt" / "server_args.py").write_text("api_key: Optional[str] = None\n")
    if layout is not None:
        (root / layout).parent.mkdir(parents=True, exist_ok=True)
        with (root / layout).open("a") as f:
            f.write("admin_api_key: Optional[str] = None\n")
    assert sglang_auth_flags(root) == (["--api-key"] if layout is None else ["--api-key", "--admin-api-key"])


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
            offline = any(s in text for s in ("No matching distribution", "Could not find a version",
                                              "connection", "Connection", "Temporary failure", "timed out"))
            if offline and os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
                pytest.skip(f"the package registry cannot give sglang=={SGLANG_VERSION}: {text[-300:]}")
            pytest.fail(f"pip download of sglang=={SGLANG_VERSION} failed (in CI this is a failure, "
                        f"not a skip: the conformance checks would not run): {text[-2000:]}")
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


def test_the_auth_flags_against_the_real_package(sglang_site):
    site, _ = sglang_site
    assert sglang_auth_flags(site / "sglang") == ["--api-key", "--admin-api-key"]


def test_an_unknown_adapter_s_unload_is_recognised_in_sglang_s_words(sglang_site):
    """EngineUpdates.unload_adapters counts an adapter an engine does not hold (restarted since)
    as gone: engine_http.UNKNOWN_ADAPTER must hold the words SGLang's LoRA registry raises with
    (its ValueError becomes the unload's error_message)."""
    import ast

    from rlkit.common.engine_http import UNKNOWN_ADAPTER

    site, _ = sglang_site
    tree = ast.parse((site / "sglang" / "srt" / "lora" / "lora_registry.py").read_text())
    (unregister,) = [n for n in ast.walk(tree)
                     if isinstance(n, ast.AsyncFunctionDef) and n.name == "unregister"]
    raised = [ast.unparse(n.exc) for n in ast.walk(unregister) if isinstance(n, ast.Raise)]
    assert any(words in text for text in raised for words in UNKNOWN_ADAPTER), raised


TENSORS = {"model.embed_tokens.weight": ([4, 3], "bfloat16"), "lm_head.bias": ([5], "float32")}


async def _record_rlkit_calls(staged) -> list[list]:
    """[method, path, body] of every call rlkit makes to an engine worker, as sent (`staged`: an
    in-memory weight bucket, kept alive by the caller while SGLang's code opens it)."""
    from rlkit.buffers.sample import Sample
    from rlkit.rollout.http.client import EngineClient
    from rlkit.rollout.config import SamplingConfig
    from rlkit.common.engine_http import HttpEngine
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
        client.adapter = "policy@v3"  # LoRA adapter sync: requests name the adapter (lora_path)
        worker.generate.append(answer_sse(stream))
        await client.generate(Sample(index=2, group_id=0, prompt_ids=[1, 2, 3]), samplings[0],
                              max_new_tokens=8, version=0, worker=worker.url)
        client.adapter = None
        worker.generate.append(answer_json(json.loads((FIXTURES / "generate_normal.json").read_text())))
        assert await client.probe(worker.url, 10) is None  # the health monitor's one-token /generate
        await client.abort("some-rid")
        await client.abort_all()
        await client.loads()
        await client.progress(worker.url, 10)  # the health monitor's read of /v1/loads

        ctl = HttpEngine(worker.url, timeout_s=30)
        for call in (ctl.tp_size, ctl.gpu_ids, lambda: ctl.pause("abort"), lambda: ctl.pause("retract"),
                     lambda: ctl.pause("in_place"), ctl.flush_cache, ctl.continue_generation,
                     lambda: ctl.update_from_disk("/m", 3), lambda: ctl.update_from_disk("/m", 3, flush_cache=False),
                     lambda: ctl.init_group("127.0.0.1", 29500, 1, 3, "g", "nccl"),
                     lambda: ctl.init_group("127.0.0.1", 29500, 3, 7, "g", "gloo"), ctl.begin_update,
                     lambda: ctl.update_from_distributed(["w", "b"], ["bfloat16", "float32"], [[2, 2], [2]], "g", 3),
                     ctl.end_update, lambda: ctl.destroy_group("g"),
                     lambda: ctl.update_from_tensor(staged.body(tp_size=2, version=4)),
                     lambda: ctl.release_memory(["kv_cache", "weights"]), lambda: ctl.resume_memory(["weights"]),
                     lambda: ctl.resume_memory(["kv_cache", "cuda_graph"]), lambda: ctl.release_memory(None),
                     # LoRA adapter sync (train/weight_sync/sender.py publish_adapter, the rollout
                     # side's unload): the tensor body as the sender builds it
                     lambda: ctl.load_lora_from_tensors({
                         "lora_name": "policy@v3", "config_dict": {"peft_type": "LORA", "r": 8},
                         "load_format": None, "serialized_named_tensors":
                             staged.body(tp_size=2, version=None)["serialized_named_tensors"]}),
                     lambda: ctl.load_lora("policy@v3", "/runs/weights/policy-v3"),
                     lambda: ctl.unload_lora("policy@v3")):
            await asyncio.to_thread(call)
    finally:
        await client.close()
        await worker.stop()
    calls = [[m, p, b] for (m, p), (_, b) in zip(worker.methods, worker.requests)]
    # the launcher's readiness probe (start_sglang_server) and the info endpoints
    return calls + [["GET", "/health_generate", None], ["GET", "/model_info", None]]


def _fixtures() -> list[list]:
    from rlkit.rollout.http.protocol import parse_sse_line

    out = []
    for f in sorted(FIXTURES.glob("generate_*.json")):
        out.append([f.name, json.loads(f.read_text())])
    for f in sorted(FIXTURES.glob("generate_*.sse")):
        for i, line in enumerate(f.read_text().splitlines()):
            payload = parse_sse_line(line)
            if payload is not None:
                out.append([f"{f.name}#{i}", payload])
    return out


def _argvs(monkeypatch, package: Path) -> list[list]:
    """[name, argv as SGLang parses it, expected values] for each way rlkit launches SGLang:
    sglang_server_argv with the run's token in the environment and `package` as the installed
    SGLang, then token_exec's substitution (what the server process parses; its command line
    holds the placeholder)."""
    from rlkit.common.control_token import CONTROL_TOKEN_ENV
    from rlkit.rollout.engines import sglang_launcher
    from rlkit.rollout.engines.config import EngineConfig
    from rlkit.rollout.engines.sglang_launcher import sglang_server_argv
    from rlkit.rollout.http.token_exec import TOKEN_PLACEHOLDER, fill_token

    monkeypatch.setenv(CONTROL_TOKEN_ENV, TOKEN)
    flags = sglang_launcher.sglang_auth_flags(package)
    monkeypatch.setattr(sglang_launcher, "sglang_auth_flags", lambda package_root=None: flags)
    keys = {"api_key": TOKEN, "admin_api_key": TOKEN}
    configs = [  # (name, config, index, base_gpu_id, expected beyond the keys)
        ("default", EngineConfig(), 0, None, {"tp_size": 1, "base_gpu_id": 0}),
        ("tp2", EngineConfig(gpus_per_engine=2, sglang_args={"mem_fraction_static": 0.8,
                                                             "chunked_prefill_size": 8192}),
         1, None, {"tp_size": 2, "base_gpu_id": 2, "mem_fraction_static": 0.8, "chunked_prefill_size": 8192}),
        ("tp2 under Ray", EngineConfig(gpus_per_engine=2), 1, 0, {"tp_size": 2, "base_gpu_id": 0}),
        ("colocated", EngineConfig(sglang_args={"enable_memory_saver": True, "mem_fraction_static": 0.4}),
         0, 0, {"tp_size": 1, "enable_memory_saver": True, "mem_fraction_static": 0.4}),
        ("fp16, no incremental", EngineConfig(incremental_streaming_output=False, dtype="float16"),
         0, None, {"tp_size": 1, "dtype": "float16", "incremental_streaming_output": False}),
        ("fp32, kv cap", EngineConfig(dtype="float32", max_total_tokens=65536), 0, None,
         {"tp_size": 1, "dtype": "float32", "max_total_tokens": 65536}),
        # LoRA adapter sync: the flags the recipe derives from train.lora for SGLang
        ("lora", load_recipe(None, ["train.lora.rank=8", "train.lora.targets=[qkv, fc2]",
                                    "rollout.engine.kind=sglang"]).rollout.engine, 0, None,
         {"tp_size": 1, "enable_lora": True, "max_lora_rank": 8, "max_loaded_loras": 4,
          "lora_target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}),
        # resume 'own' keeps up to keep_versions adapters, and one more is loaded at each sync
        ("lora, resume own", load_recipe(None, [
            "train.lora.rank=8", "train.lora.resume=own", "train.lora.keep_versions=5",
            "rollout.engine.kind=sglang"]).rollout.engine, 0, None,
         {"tp_size": 1, "enable_lora": True, "max_lora_rank": 8, "max_loaded_loras": 6,
          "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"]}),
    ]
    out = []
    for name, config, index, base, expect in configs:
        argv = sglang_server_argv("/models/m", config, index=index, port=30000, base_gpu_id=base)
        assert TOKEN not in " ".join(argv) and " ".join(argv).count(TOKEN_PLACEHOLDER) == 2, argv
        assert argv[1:4] == ["-m", "rlkit.rollout.http.token_exec", "sglang.launch_server"], argv
        args = fill_token(argv[4:], TOKEN)
        out.append([name, args, {**expect, **keys, "model_path": "/models/m", "port": 30000}])
    return out


@pytest.mark.integration
def test_rlkit_speaks_sglangs_own_schema_routes_auth_and_flags(sglang_site, tmp_path, monkeypatch):
    import torch

    from rlkit.rollout.http.protocol import parse_output, progress_mark, total_requests
    from rlkit.train.weight_sync.in_memory import stage_bucket
    from rlkit.train.weight_sync.topology import rank_offsets

    site, deps = sglang_site
    generator = torch.Generator().manual_seed(0)
    bucket = [(name, torch.randn(*shape, generator=generator).to(getattr(torch, dtype)))
              for name, (shape, dtype) in TENSORS.items()]
    staged = stage_bucket(bucket, "shared_memory")  # alive until SGLang's code has opened it
    tp_sizes = [2, 1, 4]
    offsets, world = rank_offsets(tp_sizes)
    cases = {"calls": asyncio.run(_record_rlkit_calls(staged)), "fixtures": _fixtures(),
             "argvs": _argvs(monkeypatch, site / "sglang"), "token": TOKEN,
             "rank_layout": {"tp_sizes": tp_sizes, "offsets": offsets, "world": world},
             "tensor_update": {"tp_size": 2, "tensors": {
                 n: [list(t.shape), str(t.dtype).removeprefix("torch."), float(t.double().sum())]
                 for n, t in bucket}}}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        run = subprocess.run([sys.executable, str(ROOT / "tests" / "conformance" / "sglang_contract.py"),
                              str(site), str(deps), str(tmp_path / "cases.json")],
                             capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    finally:
        staged.release()
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    checks = result["checks"]
    failed = [f"{name}: {detail}" for name, ok, detail in checks if not ok]
    assert not failed, "\n".join(failed)
    names = [name for name, _, _ in checks]
    # every kind of check ran, on every body and every launch
    for kind in ("route ", "body ", "value ", "rank layout", "tensor update rank 1", "/generate body",
                 "response generate_stream_weight_versions", "argv ", "server_info ", "auth "):
        assert any(n.startswith(kind) for n in names), kind
    bodies = [p for _, p, b in cases["calls"] if isinstance(b, dict) and p != "/generate"]
    assert sum(n.startswith("body ") for n in names) == len(bodies) >= 18
    assert sum(n.startswith("/generate body") for n in names) == 5  # 4 generations + the probe
    assert sum(n.endswith("holds the token") for n in names) == len(cases["argvs"])

    # what SGLang's own code builds, read by rlkit's parsers
    samples = result["samples"]
    assert total_requests(samples["loads"]) == 6  # 3 running + 1 waiting + 2 running
    before, after = (progress_mark(b) for b in samples["loads_published"])
    assert before is not None and after is not None and before != after
    meta = samples["weight_versions_meta"]
    fixture = [json.loads(x[6:]) for x in (FIXTURES / "generate_stream_weight_versions.sse").read_text().split("\n\n")
               if x.startswith("data: {")][-1]["meta_info"]
    assert fixture["weight_versions"] == meta["weight_versions"], "the fixture is not what SGLang builds"
    assert fixture["weight_version"] == meta["weight_version"]
    chunk = parse_output({"meta_info": {**fixture, **meta}})
    assert chunk.versions_by_token(0, 9) == [3, 3, 3, 3, 4, 4, 4, 5, 5]
    assert samples["server_info"]["tp_size"] == 1  # the field HttpEngine.tp_size reads

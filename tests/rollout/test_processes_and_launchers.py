"""Process lifecycle: clear errors for a missing router, a port clash, a bad model; nothing is
left running. The SGLang launcher builds the right command and refuses clearly without sglang."""

from __future__ import annotations

import importlib.util
import socket

import psutil
import pytest

from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.builtin.core_client import CoreError, CoreRefused, EngineCoreClient
from rlkit.rollout.engines.builtin.engine_core import CoreConfig
from rlkit.rollout.engines.process import ProcessStartError, free_port, start_hf_server
from rlkit.rollout.engines.sglang_launcher import (
    SGLangNotInstalled,
    passthrough_args,
    require_sglang,
    sglang_server_argv,
)
from rlkit.rollout.http.router import Router, RouterError


def test_missing_router_binary_is_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang_router" else real(name, *a))
    with pytest.raises(RouterError, match="sglang-router is not installed"):
        Router().start([])


def test_router_port_clash_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RouterError, match=f"port {port} .* in use"):
            Router(RouterConfig(port=port)).start([])


@pytest.mark.integration
def test_router_lifecycle_leaves_nothing_behind():
    router = Router(RouterConfig())
    router.start([])
    pid = router.process.pid
    assert router.alive() and router.list_workers() == []
    with pytest.raises(RouterError, match="does not answer /health"):
        router.add_worker(f"http://127.0.0.1:{free_port()}")
    router.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.integration
def test_a_bad_model_path_fails_with_the_engines_log(tmp_path):
    with pytest.raises(ProcessStartError, match="(?s)exited with code.*log"):
        start_hf_server(str(tmp_path / "no-model"), EngineConfig(startup_timeout_s=60))


@pytest.mark.integration
def test_stopping_an_engine_stops_its_core_process(tiny_model_dir):
    engine = start_hf_server(str(tiny_model_dir), EngineConfig(startup_timeout_s=120), threads=1)
    family = [psutil.Process(engine.pid), *psutil.Process(engine.pid).children(recursive=True)]
    assert len(family) >= 2  # the HTTP process and the engine core
    # only the core has torch: the HTTP process tokenizes without it (hf_server.hide_torch)
    assert not _maps_torch(engine.pid) and any(_maps_torch(p.pid) for p in family[1:])
    engine.stop()
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert alive == []


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


_TEXTS = ["What is 12+7? Answer:", "<|im_start|>user\nSolve 3 * (4 - 1).<|im_end|>\n",
          "  leading spaces,\ttabs\nand\n\nnewlines", "unicode: é ü 中文 😀", "x" * 300,
          "the sum of 1234567 and 89 is 1234656."]
_ENCODE = """
import json, sys
from rlkit.rollout.engines.builtin.hf_server import hide_torch
hide_torch()
from rlkit.rollout.engines.builtin.detokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
texts = json.loads(sys.stdin.read())
ids = [tok.encode(t) for t in texts]
print(json.dumps({"ids": ids, "text": [tok.decode(i) for i in ids],
                  "raw": [tok.decode(i, skip_special_tokens=False) for i in ids],
                  "torch": "torch" in sys.modules and sys.modules["torch"] is not None}))
"""


def test_the_http_process_tokenizes_without_torch_exactly_as_with_it(tiny_model_dir):
    """transformers may rewrite a tokenizer.json (Qwen2's pre-tokenizer): loaded with torch
    hidden it must still be the same tokenizer, ids and text."""
    import json
    import subprocess
    import sys

    from rlkit.rollout.engines.builtin.detokenizer import load_tokenizer

    out = subprocess.run([sys.executable, "-c", _ENCODE, str(tiny_model_dir)], input=json.dumps(_TEXTS),
                         capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout)
    tok = load_tokenizer(str(tiny_model_dir))
    ids = [tok.encode(t) for t in _TEXTS]
    assert got["torch"] is False
    assert got["ids"] == ids
    assert got["text"] == [tok.decode(i) for i in ids]
    assert got["raw"] == [tok.decode(i, skip_special_tokens=False) for i in ids]


def test_sglang_command_line():
    config = EngineConfig(kind="sglang", gpus_per_engine=2, max_running_requests=128, seed=3,
                          sglang_args={"mem_fraction_static": 0.8, "enable_metrics": True,
                                       "disable_radix_cache": False, "cuda_graph_bs": [1, 2]})
    argv = sglang_server_argv("/models/qwen", config, index=1, port=31000)
    line = " ".join(argv)
    assert "-m sglang.launch_server --model-path /models/qwen" in line
    assert "--tp-size 2 --base-gpu-id 2 --random-seed 4" in line
    assert "--incremental-streaming-output" in argv and "--skip-server-warmup" in argv
    assert line.endswith("--mem-fraction-static 0.8 --enable-metrics --cuda-graph-bs 1 2")
    assert passthrough_args({"x": None, "y": False}) == []
    with pytest.raises(ValueError, match="tp_size"):
        sglang_server_argv("/m", EngineConfig(kind="sglang", sglang_args={"tp_size": 4}), index=0, port=1)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed")
def test_without_sglang_the_launcher_says_so():
    with pytest.raises(SGLangNotInstalled, match="kind=hf"):
        require_sglang()


@pytest.mark.integration
def test_an_engine_whose_launcher_dies_exits(tiny_model_dir, tmp_path):
    """The launcher is killed without stopping its engine: the engine stops by itself."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "launcher.py"
    script.write_text(
        "import time\n"
        "from rlkit.rollout.engines.config import EngineConfig\n"
        "from rlkit.rollout.engines.process import start_hf_server\n"
        f"e = start_hf_server({str(tiny_model_dir)!r}, EngineConfig(startup_timeout_s=120), threads=1)\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n")
    repo = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                                cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    engine_pid = None
    try:
        engine_pid = int(launcher.stdout.readline())
        family = [psutil.Process(engine_pid), *psutil.Process(engine_pid).children(recursive=True)]
        launcher.kill()
        launcher.wait(10)
        gone, alive = psutil.wait_procs(family, timeout=30)
        assert alive == []
    finally:
        launcher.kill()
        if engine_pid is not None:  # never leave the engine behind, even when the test fails
            try:
                os.killpg(engine_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def test_the_core_tells_a_refused_command_from_a_failed_one(tiny_model_dir):
    """A command with wrong arguments is CoreRefused (the HTTP side answers 400, the caller's
    mistake); the core keeps answering afterwards."""
    core = EngineCoreClient(CoreConfig(model_path=str(tiny_model_dir),
                                       tokenizer_path=str(tiny_model_dir), device="cpu"))
    core.launch()
    try:
        await core.wait_ready(timeout_s=120)
        with pytest.raises(CoreRefused, match="unknown engine command 'no_such_command'"):
            await core.call("no_such_command")
        with pytest.raises(CoreRefused, match="no weight update group 'nope'"):
            await core.call("destroy_group", group_name="nope")
        with pytest.raises(CoreError) as failed:  # a TypeError inside: failed, not refused
            await core.call("stats", no_such_argument=1)
        assert not isinstance(failed.value, CoreRefused) and "TypeError" in str(failed.value)
        assert (await core.call("loads")) is not None
    finally:
        await core.stop()

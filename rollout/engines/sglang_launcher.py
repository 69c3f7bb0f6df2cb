"""Launch real SGLang servers (GPU machines): `python -m sglang.launch_server ...` per engine.

Server arguments come from EngineConfig; `sglang_args` passes any other SGLang flag through
unchanged ({"mem_fraction_static": 0.8} -> `--mem-fraction-static 0.8`, True -> bare flag,
False/None -> omitted, a list -> repeated values). Each server gets its own GPUs through
`--base-gpu-id`, its own port, and is polled on /health_generate (a real one-token generation)
before it counts as up. Where sglang is not installed this fails with a clear error instead of
an ImportError deep in a subprocess. With a control token ($RLKIT_CONTROL_TOKEN) SGLang gets it
as its API key and its admin key (`sglang_auth_flags`), added inside the process
(rollout.http.token_exec, which also blanks it out of the log), never on the command line; beyond
loopback without a token a server is not started.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from rlkit.common.errors import UserError
from rlkit.rollout.http.auth import ControlTokenMissing, check_bind, control_token_from_env
from rlkit.rollout.engines.config import EngineConfig
from rlkit.rollout.engines.process import ManagedProcess, ProcessStartError, free_port, spawn
from rlkit.rollout.http.token_exec import TOKEN_PLACEHOLDER


class SGLangNotInstalled(UserError, RuntimeError):
    """sglang is missing: it only installs on CUDA machines."""


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def require_sglang() -> None:
    if not sglang_available():
        raise SGLangNotInstalled(
            "rollout.engine.kind=sglang needs the sglang package, which installs only on CUDA "
            "machines (`pip install 'rlkit[gpu]'`); on CPU use rollout.engine.kind=hf"
        )


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def passthrough_args(extra: dict[str, Any]) -> list[str]:
    """EngineConfig.sglang_args as command-line flags."""
    out: list[str] = []
    for key, value in extra.items():
        if value is None or value is False:
            continue
        if value is True:
            out.append(_flag(key))
        elif isinstance(value, (list, tuple)):
            out += [_flag(key), *(str(v) for v in value)]
        else:
            out += [_flag(key), str(value)]
    return out


def sglang_server_argv(model_path: str, config: EngineConfig, *, index: int, port: int,
                       base_gpu_id: int | None = None) -> list[str]:
    """`base_gpu_id`: the first of the engine's GPUs among those CUDA_VISIBLE_DEVICES shows it;
    by default engine `index` takes the index-th run of gpus_per_engine (a fleet started where
    every GPU is visible). Under Ray each engine sees only its bundle's GPUs: 0."""
    if base_gpu_id is None:
        base_gpu_id = index * config.gpus_per_engine
    argv = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path, "--host", config.host, "--port", str(port),
        "--tp-size", str(config.gpus_per_engine),
        "--base-gpu-id", str(base_gpu_id),
        "--random-seed", str(config.seed + index),
        "--max-running-requests", str(config.max_running_requests),
        "--stream-interval", str(config.stream_interval),
        "--skip-server-warmup",
    ]
    if config.max_total_tokens:
        argv += ["--max-total-tokens", str(config.max_total_tokens)]
    if config.incremental_streaming_output:
        argv.append("--incremental-streaming-output")
    if config.dtype != "auto":
        argv += ["--dtype", config.dtype]
    explicit = {a.lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    clashes = sorted(set(config.sglang_args) & explicit)
    if clashes:
        raise ValueError(f"rollout.engine.sglang_args sets {clashes}, which rlkit derives from "
                         "other engine fields; set those fields instead")
    argv += passthrough_args(config.sglang_args)
    if control_token_from_env() is not None:  # the keys join the arguments inside the process
        # FLAG=VALUE: a token may begin with '-', which argparse takes for a flag after a space
        argv += [f"{flag}={TOKEN_PLACEHOLDER}" for flag in sglang_auth_flags()]
        argv[1:3] = ["-m", "rlkit.rollout.http.token_exec", "sglang.launch_server"]
    return argv


def sglang_auth_flags(package_root: str | Path | None = None) -> list[str]:
    """The flags that give the installed SGLang (or the one unpacked at `package_root`) the
    control token: `--api-key`, and `--admin-api-key` where it has one. Both, because of what
    each guards (sglang/srt/utils/auth.py): the admin key alone guards the admin endpoints
    (weight updates, abort, pause/continue, flush_cache, sleep/wake) but leaves every other
    endpoint open, /server_info included, which returns every server argument, the admin key
    among them (srt/utils/common.py build_server_info); the API key guards all but /health*,
    /ready* and /metrics*, and with both set the admin endpoints take the admin key. The
    router sends it to the engines (rollout.router: its --api-key), rlkit's clients send it on
    every request. Read from the source, not by importing sglang (a slow, GPU-initialising
    import): the server arguments sat in srt/server_args.py until 0.5.x, and 0.5.23 declares
    them per group in srt/arg_groups/fields/*.py (admin_api_key in serving.py)."""
    if package_root is None:
        spec = importlib.util.find_spec("sglang")
        roots = list(spec.submodule_search_locations or []) if spec else []
    else:
        roots = [package_root]
    for root in map(Path, roots):
        sources = [root / "srt" / "server_args.py", *sorted((root / "srt" / "arg_groups").rglob("*.py"))]
        if any(f.is_file() and "admin_api_key" in f.read_text(errors="replace") for f in sources):
            return ["--api-key", "--admin-api-key"]
    return ["--api-key"]


def start_sglang_server(model_path: str, config: EngineConfig, *, index: int,
                        log_path: Path | None = None, base_gpu_id: int | None = None) -> ManagedProcess:
    """Start SGLang server `index` and wait until it generates (`base_gpu_id`: as in
    sglang_server_argv)."""
    require_sglang()
    try:
        check_bind(config.host, control_token_from_env(), f"SGLang server {index}")
    except ControlTokenMissing as e:
        raise ProcessStartError(str(e)) from None
    port = free_port(config.host)
    argv = sglang_server_argv(model_path, config, index=index, port=port, base_gpu_id=base_gpu_id)
    proc = spawn(f"sglang-{index}", argv, log_path=log_path)
    proc.url = f"http://{config.host}:{port}"
    try:
        proc.wait_healthy(f"{proc.url}/health_generate", config.startup_timeout_s, interval_s=2.0)
    except ProcessStartError as e:
        raise ProcessStartError(f"SGLang server {index} for {model_path}: {e}") from None
    return proc

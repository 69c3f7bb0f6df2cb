"""EngineFleet: the engine servers and the router in front of them, started and stopped as one.

    with EngineFleet(model_path, EngineConfig(num_engines=2), RouterConfig()) as fleet:
        async with fleet.client() as client: ...

Engines start in parallel (model loading dominates start-up), the router starts once they are
healthy and registers them; `stop()` stops the router first, then every engine's process group.
A failed start stops whatever already started.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.process import ManagedProcess, start_hf_server
from rlkit.rollout.engines.sglang_launcher import require_sglang, start_sglang_server
from rlkit.rollout.http.router import Router


def start_engine(model_path: str, config: EngineConfig, index: int,
                 log_dir: Path | None = None, *, own_gpus: bool = False) -> ManagedProcess:
    """Start engine `index` of a fleet (hf or sglang per `config.kind`) and wait until it is
    healthy. Engine i samples unseeded requests from seed + i; hf engines split the cores
    (`cpu_threads`, or cores // num_engines). Its log is `log_dir/engine-<index>.log`.
    `own_gpus`: this process sees only the engine's GPUs (a Ray actor's CUDA_VISIBLE_DEVICES),
    so an SGLang engine starts at the first of them; else at the index-th run of them."""
    log_path = log_dir / f"engine-{index}.log" if log_dir else None
    if config.kind == "sglang":
        return start_sglang_server(model_path, config, index=index, log_path=log_path,
                                   base_gpu_id=0 if own_gpus else None)
    return start_hf_server(model_path, config, seed=config.seed + index, log_path=log_path)


class EngineFleet:
    def __init__(self, model_path: str, engine: EngineConfig | None = None,
                 router: RouterConfig | None = None, *, log_dir: Path | None = None) -> None:
        self.model_path = model_path
        self.engine_config = engine or EngineConfig()
        self.router = Router(router or RouterConfig(),
                             log_path=log_dir / "router.log" if log_dir else None)
        self.log_dir = log_dir
        self.engines: list[ManagedProcess] = []

    @property
    def worker_urls(self) -> list[str]:
        return [e.url for e in self.engines if e.url]

    def _start_engine(self, index: int) -> ManagedProcess:
        return start_engine(self.model_path, self.engine_config, index, self.log_dir)

    def start(self) -> "EngineFleet":
        if self.engine_config.kind == "sglang":
            require_sglang()
        n = self.engine_config.num_engines
        try:
            with ThreadPoolExecutor(max_workers=n) as pool:
                futures = [pool.submit(self._start_engine, i) for i in range(n)]
                errors = []
                for f in futures:
                    try:
                        self.engines.append(f.result())
                    except Exception as e:  # collect all, then stop what started
                        errors.append(e)
            if errors:
                raise errors[0]
            self.router.start(self.worker_urls)
        except BaseException:
            self.stop()
            raise
        return self

    def client(self, **kwargs: object) -> EngineClient:
        """A new client for this fleet (the caller owns it: `async with fleet.client() as c`)."""
        return EngineClient(self.router.url, worker_urls=self.worker_urls, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.router.stop()
        for e in self.engines:
            e.stop()
        self.engines = []

    def __enter__(self) -> "EngineFleet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

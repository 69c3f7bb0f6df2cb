"""Loopback receivers: local processes that stand in for engines on the *receiving* side of a
weight update, for tests and `rlkit bench train` when no engine server is at hand.

Each receiver joins the weight-update group exactly as an engine does (train/weight_sync/group.py)
and receives every broadcast tensor into a fresh buffer of the announced dtype and shape; a disk
update reads the safetensors folder. An engine of TP size k is k receiver processes, joining as
rank_offset + tp_rank the way SGLang's TP ranks do. It generates nothing and speaks no HTTP: it checks the
trainer's half of the protocol (order of calls, versions, bytes on the wire), not an engine.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Sequence

import torch

from rlkit.common.engine_http import WeightSyncError


def _receiver_main(conn, tp_rank: int) -> None:
    import torch.distributed as dist

    from rlkit.train.hf_io import load_hf_state_dict
    from rlkit.train.weight_sync.group import join_weight_group, leave_weight_group

    torch.set_num_threads(1)
    group = None
    received: dict[str, torch.Tensor] = {}
    log: list[tuple] = []
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "dump":
                conn.send(("ok", (received, log)))
                continue
            log.append((cmd, *[a for a in args if not isinstance(a, (list, tuple))]))
            if cmd == "init_group":
                addr, port, rank_offset, world, name, backend = args
                group = join_weight_group(
                    backend=backend, master_address=addr, master_port=port, world_size=world,
                    rank=rank_offset + tp_rank, group_name=name, timeout_s=600,
                )
            elif cmd == "bucket":
                names, dtypes, shapes, version = args
                log[-1] = ("bucket", len(names), version)
                for n, d, s in zip(names, dtypes, shapes):
                    t = torch.empty(s, dtype=getattr(torch, d))
                    dist.broadcast(t, src=0, group=group)
                    received[n] = t
            elif cmd == "disk":
                path, version, _flush = args
                # materialise every tensor (safetensors maps the file lazily), as loading would
                received = {k: v.clone() for k, v in load_hf_state_dict(path).items()}
            elif cmd == "destroy" and group is not None:
                leave_weight_group(group)
                group = None
            conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001 - sent back to the caller
            conn.send(("error", f"{type(e).__name__}: {e}"))


class LoopbackControl:
    """EngineControl for one loopback engine: its TP ranks' receivers, told the same thing."""

    def __init__(self, url: str, conns: Sequence[Any]) -> None:
        self.url, self._conns = url, list(conns)

    def _ask(self, cmd: str, *args: Any) -> Any:
        for conn in self._conns:  # all first: the ranks of a broadcast receive together
            conn.send((cmd, args))
        answers = [conn.recv() for conn in self._conns]
        for status, payload in answers:
            if status != "ok":
                raise RuntimeError(f"{self.url} {cmd}: {payload}")
        return answers[0][1]

    def tp_size(self) -> int: return len(self._conns)
    def gpu_ids(self) -> list[str]: return []
    def pause(self, mode: str) -> None: self._ask("pause", mode)
    def flush_cache(self) -> None: self._ask("flush")
    def continue_generation(self) -> None: self._ask("continue")
    def begin_update(self) -> None: self._ask("begin")
    def end_update(self) -> None: self._ask("end")
    def destroy_group(self, group_name: str) -> None: self._ask("destroy", group_name)
    def update_from_tensor(self, body) -> None: self._ask("tensor", len(body.get("serialized_named_tensors", ())))
    def release_memory(self, tags=None) -> dict: return self._ask("release", tags) or {}
    def resume_memory(self, tags=None) -> dict: return self._ask("resume", tags) or {}

    # loopback receivers hold plain weights: LoRA adapters are the HTTP engines' (lora_adapters.py)
    def load_lora_from_tensors(self, body) -> None: self._no_lora()
    def load_lora(self, name: str, path: str) -> None: self._no_lora()
    def unload_lora(self, name: str) -> None: self._no_lora()

    def _no_lora(self) -> None:
        raise WeightSyncError("loopback engines serve no LoRA adapters (train.lora.sync: merged)")

    def update_from_disk(self, model_path: str, version: int, *, flush_cache: bool = True) -> None:
        self._ask("disk", model_path, version, flush_cache)

    def init_group(self, master_address, master_port, rank_offset, world_size, group_name, backend) -> None:
        self._ask("init_group", master_address, master_port, rank_offset, world_size, group_name, backend)

    def update_from_distributed(self, names, dtypes, shapes, group_name, version) -> None:
        self._ask("bucket", list(names), list(dtypes), [list(s) for s in shapes], version)


class LoopbackEngines:
    """`n` engines with URLs loopback://0 .. loopback://n-1; engine i has `tp_sizes[i]` receiver
    processes (default 1 each)."""

    def __init__(self, n: int, tp_sizes: Sequence[int] | None = None) -> None:
        ctx = mp.get_context("spawn")
        sizes = list(tp_sizes) if tp_sizes is not None else [1] * n
        if len(sizes) != n:
            raise ValueError(f"{n} engines but {len(sizes)} TP sizes")
        self.urls = [f"loopback://{i}" for i in range(n)]
        self._procs, self._controls = [], {}
        for url, size in zip(self.urls, sizes):
            pipes = [ctx.Pipe() for _ in range(size)]
            for r, (_, child) in enumerate(pipes):
                self._procs.append(ctx.Process(target=_receiver_main, args=(child, r), daemon=True))
                self._procs[-1].start()
            self._controls[url] = LoopbackControl(url, [parent for parent, _ in pipes])

    def control(self, url: str) -> LoopbackControl:
        return self._controls[url]

    def received(self, url: str, tp_rank: int = 0) -> tuple[dict[str, torch.Tensor], list[tuple]]:
        """(tensors received by the last update, log of control calls) of one engine's TP rank."""
        conn = self._controls[url]._conns[tp_rank]
        conn.send(("dump", ()))
        status, payload = conn.recv()
        if status != "ok":
            raise RuntimeError(f"{url} rank {tp_rank} dump: {payload}")
        return payload

    def close(self) -> None:
        for c in self._controls.values():
            try:
                c._ask("stop")
            except (EOFError, OSError, RuntimeError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> "LoopbackEngines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LoopbackEngines", "LoopbackControl"]

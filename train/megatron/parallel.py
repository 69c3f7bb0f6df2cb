"""torch.distributed + megatron parallel state for one trainer process.

Ranks are laid out TP-major, as megatron does: global rank = dp_rank * tp + tp_rank. On CPU the
backend is gloo and the CPU shim is applied; on CUDA it is NCCL and megatron seeds its CUDA RNG
tracker. A process holds one trainer world for its lifetime (megatron's parallel state is global).
"""

from __future__ import annotations

import datetime
import random
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlkit.common.control_token import collectives_on_loopback


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    tp_rank: int
    tp_size: int
    dp_rank: int
    dp_size: int


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bound_tcp_store(host: str, port: int, world_size: int,
                    timeout: datetime.timedelta) -> dist.TCPStore:
    """The rendezvous store of rank 0, listening on `host` only. torch's own TCPStore server
    listens on every interface whatever address it is given (measured: tcp://127.0.0.1:P
    listens on *:P), which would open the trainer's store to the network on a loopback run; a
    socket bound here and handed over keeps it where the recipe says."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        fd = sock.fileno()
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                              master_listen_fd=fd, wait_for_workers=True, multi_tenant=False)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store listens on this fd now: the socket object must not close it
    return store


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but torch sees no CUDA device in this process")
    return torch.device(name)


def init_parallel(
    *,
    rank: int,
    world_size: int,
    tp: int,
    master_addr: str,
    master_port: int,
    device: torch.device,
    seed: int,
    timeout_s: float = 600.0,
) -> RankInfo:
    """Join the trainer world and build megatron's TP/DP groups (idempotent for the same shape)."""
    from megatron.core import parallel_state

    if world_size % tp:
        raise ValueError(f"world size {world_size} is not a multiple of tensor parallel size {tp}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"this process already belongs to a trainer world of size {dist.get_world_size()} "
                f"(rank {dist.get_rank()}); cannot join one of size {world_size} as rank {rank}"
            )
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None else 0)
        timeout = datetime.timedelta(seconds=timeout_s)
        collectives_on_loopback(master_addr)  # one node: no socket of the world beyond it
        # rank 0's store listens on master_addr only (torch's own would listen everywhere)
        store = (bound_tcp_store(master_addr, master_port, world_size, timeout) if rank == 0
                 else dist.TCPStore(master_addr, master_port, world_size, is_master=False,
                                    timeout=timeout))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    if device.type == "cpu":
        from rlkit.train.megatron.cpu_shim import apply_cpu_shim

        apply_cpu_shim()
    if parallel_state.model_parallel_is_initialized():
        have = parallel_state.get_tensor_model_parallel_world_size()
        if have != tp:
            raise RuntimeError(f"megatron is already initialised with TP={have}, not TP={tp}")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    return current_rank_info()


def init_single_process(device: torch.device, seed: int) -> RankInfo:
    """A world of one (TP=1, DP=1) in this process: tests, benchmarks, export."""
    return init_parallel(
        rank=0,
        world_size=1,
        tp=1,
        master_addr="127.0.0.1",
        master_port=0 if dist.is_initialized() else free_port(),  # no rendezvous when joined
        device=device,
        seed=seed,
    )


def current_rank_info() -> RankInfo:
    from megatron.core import parallel_state as ps

    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def shutdown_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Python's and torch's RNGs of this rank (megatron's CUDA tracker is seeded in init_parallel)."""
    random.seed(seed)
    torch.manual_seed(seed)

"""The process group between the trainer (rank 0) and engine workers (ranks 1..N) for broadcasts.

It is formed the way SGLang's `init_custom_process_group` forms it, because real SGLang engines
are on the other side: rendezvous at tcp://master_address:master_port (rank 0, the trainer,
hosts the TCPStore), keys prefixed with the group name, and the group created as an extra
"default-style" group with an identity rank map so `broadcast(src=0, group=...)` works in a
process that already belongs to the trainer's own torch.distributed world. The built-in engine
server must join the same way (it uses the same torch).
"""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlkit.common.control_token import collectives_on_loopback
from rlkit.train.megatron.parallel import bound_tcp_store


def join_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Create (rank 0) or join (rank > 0) the weight-update group; blocks until all have joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    collectives_on_loopback(master_address)  # all on this machine: gloo/NCCL on loopback too
    if rank == 0:
        store: dist.Store = bound_tcp_store(master_address, master_port, world_size, timeout)
    else:
        store, rank, world_size = next(
            c10d.rendezvous(
                f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout
            )
        )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)

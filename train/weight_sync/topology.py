"""How weights reach each engine, chosen from where things run (pure: no torch.distributed, no HTTP).

The sending trainer rank lives on one node and one device ("cpu" or a GPU); each engine has TP
ranks, each on a node and a device. Per engine, one of:

- `tensor`: every TP rank of the engine is on the trainer rank's own node, and on its device or
  on that node's CPU. The weights pass in memory (train/weight_sync/in_memory.py): CUDA IPC
  handles when every rank is on the trainer's GPU (`memory="cuda_ipc"`), shared memory when they
  are on the CPU (`memory="shared_memory"`; a GPU trainer stages each bucket into it).
- `distributed`: the engine's TP ranks join the broadcast group as SGLang joins them, rank
  `rank_offset + tp_rank` (sglang 0.5.23 srt/model_executor/model_runner_components/
  weight_updater.py:124), the trainer being rank 0; the world is 1 + the TP ranks of every
  distributed engine. NCCL when the trainer rank is on a GPU, gloo on a CPU.
- `disk`: everything else, and every engine when the caller asks for disk.

The rule that always holds: an NCCL group never has two ranks on one GPU (NCCL refuses:
"Duplicate GPU detected"), nor a rank on a CPU. So an engine with a rank on the trainer's GPU
never joins it, and of two engines sharing a GPU only the first does (the other goes to disk).

Devices are compared as given: name GPUs the same way for the trainer and every engine, by their
physical identity on the node (the index nvidia-smi shows, as Ray's `get_gpu_ids()` gives it, or
the GPU's UUID), never by a process's CUDA_VISIBLE_DEVICES-relative index, which is 0 everywhere
under Ray. An int `n` is taken as "cuda:n".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

Method = Literal["tensor", "distributed", "disk"]
Requested = Literal["auto", "tensor", "distributed", "disk"]
Memory = Literal["cuda_ipc", "shared_memory", ""]
REQUESTED = ("auto", "tensor", "distributed", "disk")


class TopologyError(ValueError):
    """A placement the requested method cannot serve (the message names the engines and why)."""


def device_name(device: str | int) -> str:
    """"cpu", or a GPU's name: an int n is "cuda:n"; other strings are kept (a UUID, "cuda:3")."""
    if isinstance(device, bool):
        raise TopologyError(f"device must be 'cpu', a GPU index or a GPU id, got {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise TopologyError(f"GPU index must be >= 0, got {device}")
        return f"cuda:{device}"
    name = str(device).strip()
    if not name:
        raise TopologyError("empty device name")
    return "cpu" if name.lower() == "cpu" else name


@dataclass(frozen=True)
class Place:
    """Where one process runs: a node and a device ("cpu" or a GPU, see the module docstring)."""

    node: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "node", str(self.node))
        object.__setattr__(self, "device", device_name(self.device))

    @property
    def on_gpu(self) -> bool:
        return self.device != "cpu"

    def __str__(self) -> str:
        return f"{self.node}/{self.device}"


@dataclass(frozen=True)
class EnginePlan:
    """How one engine (position `index` in the list given) receives the weights.
    `rank_offset` is the engine's first rank in the broadcast group (distributed only, else 0);
    `memory` how the in-memory handles are made (tensor only, else "")."""

    index: int
    method: Method
    tp_size: int
    rank_offset: int = 0
    memory: Memory = ""
    reason: str = ""

    @property
    def ranks(self) -> range:
        """The engine's ranks in the broadcast group (empty unless distributed)."""
        if self.method != "distributed":
            return range(0)
        return range(self.rank_offset, self.rank_offset + self.tp_size)

    def describe(self) -> str:
        if self.method == "distributed":
            how = f"distributed, ranks {self.rank_offset}..{self.rank_offset + self.tp_size - 1}"
        elif self.method == "tensor":
            how = f"tensor ({self.memory})"
        else:
            how = "disk"
        return f"engine {self.index}: {how}, tp {self.tp_size}" + (f" ({self.reason})" if self.reason else "")


@dataclass(frozen=True)
class SyncPlan:
    """The method of every engine, and the broadcast group of the distributed ones."""

    trainer: Place
    engines: tuple[EnginePlan, ...]
    backend: Literal["nccl", "gloo", ""]  # of the broadcast group; "" when no engine is in it
    world_size: int  # 1 (the trainer) + the TP ranks of the distributed engines

    def indices(self, method: Method) -> tuple[int, ...]:
        """Positions of the engines sent by `method`, in order."""
        return tuple(e.index for e in self.engines if e.method == method)

    def describe(self) -> str:
        """One line per engine, for logs."""
        head = f"weight sync from trainer rank at {self.trainer}"
        if self.backend:
            head += f"; {self.backend} group of {self.world_size} ranks"
        return "\n".join([head, *("  " + e.describe() for e in self.engines)])


def _in_memory(trainer: Place, ranks: Sequence[Place]) -> tuple[Memory, str]:
    """(memory, "") when the engine can take the weights in memory, else ("", why not)."""
    far = [str(r) for r in ranks if r.node != trainer.node]
    if far:
        return "", f"rank(s) {far} on another node than the trainer's {trainer.node}"
    if all(r.device == "cpu" for r in ranks):
        return "shared_memory", ""
    if trainer.on_gpu and all(r.device == trainer.device for r in ranks):
        return "cuda_ipc", ""
    other = sorted({r.device for r in ranks if r.device not in ("cpu", trainer.device)})
    if other:
        return "", f"on {other}, not the trainer's {trainer.device} or this node's cpu"
    return "", f"ranks split between {trainer.device} and cpu"


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[list[int], int]:
    """(rank_offset of each engine, world size) of a broadcast group of the trainer (rank 0) and
    engines of these TP sizes, each TP rank joining as rank_offset + tp_rank (SGLang's layout)."""
    offsets, next_rank = [], 1
    for n in tp_sizes:
        if n < 1:
            raise TopologyError(f"an engine reports tp_size {n}")
        offsets.append(next_rank)
        next_rank += n
    return offsets, next_rank


def plan_weight_sync(
    trainer: Place,
    engines: Sequence[Sequence[Place]],
    *,
    method: Requested = "auto",
) -> SyncPlan:
    """Choose each engine's transport. `engines[i]` lists engine i's TP ranks' places, by TP rank.

    `method`: "auto" (in memory where possible, else the broadcast group, else disk);
    "distributed" (never in memory: the broadcast group where it may, else disk); "disk" (every
    engine); "tensor" (every engine in memory, or TopologyError naming those that cannot)."""
    if method not in REQUESTED:
        raise TopologyError(f"method must be one of {REQUESTED}, got {method!r}")
    backend: Literal["nccl", "gloo"] = "nccl" if trainer.on_gpu else "gloo"
    taken = {(trainer.node, trainer.device)}  # GPUs in the NCCL group so far
    next_rank = 1
    plans: list[EnginePlan] = []
    refused: list[str] = []
    for i, ranks in enumerate(engines):
        ranks = list(ranks)
        if not ranks:
            raise TopologyError(f"engine {i} has no TP rank")
        tp = len(ranks)
        if method == "disk":
            plans.append(EnginePlan(i, "disk", tp, reason="asked for"))
            continue
        memory, why_not = _in_memory(trainer, ranks)
        if memory and method in ("auto", "tensor"):
            plans.append(EnginePlan(i, "tensor", tp, memory=memory, reason="same node and device"))
            continue
        if method == "tensor":
            refused.append(f"engine {i} ({why_not})")
            continue
        reason = ""
        if backend == "nccl":
            places = [(r.node, r.device) for r in ranks]
            on_cpu = [str(r) for r in ranks if not r.on_gpu]
            shared = sorted({f"{n}/{d}" for n, d in places if (n, d) in taken})
            twice = sorted({f"{n}/{d}" for n, d in places if places.count((n, d)) > 1})
            if on_cpu:
                reason = f"rank(s) on {on_cpu}: an NCCL group has GPU ranks only"
            elif shared or twice:
                reason = (f"its GPU(s) {shared or twice} already have a rank in the NCCL group "
                          "(NCCL refuses two ranks on one GPU)")
            else:
                taken.update(places)
        if reason:
            plans.append(EnginePlan(i, "disk", tp, reason=reason))
            continue
        plans.append(EnginePlan(i, "distributed", tp, rank_offset=next_rank,
                                reason=f"{backend} broadcast" + (f"; in memory not possible: {why_not}"
                                                                 if why_not else "")))
        next_rank += tp
    if refused:
        raise TopologyError("method 'tensor' (weights in memory) needs every TP rank of every engine on "
                            f"the trainer rank's node ({trainer}) and on its device or the CPU: "
                            + "; ".join(refused))
    return SyncPlan(trainer=trainer, engines=tuple(plans),
                    backend=backend if next_rank > 1 else "", world_size=next_rank)


__all__ = ["EnginePlan", "Place", "SyncPlan", "TopologyError", "device_name", "plan_weight_sync",
           "rank_offsets"]

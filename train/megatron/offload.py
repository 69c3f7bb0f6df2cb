"""Free the trainer's device memory while colocated engines generate, and take it back to train.

Three kinds, each offloaded and onloaded on its own (idempotently: a kind already in the asked
state moves nothing and reports 0 bytes):

  params     the module's parameters and registered buffers, and the reference copy (if any)
  grads      megatron DDP's contiguous grad buffers (`buffer.grad_data`; `param.main_grad` are
             views into them)
  optimizer  optimizer state tensors and the fp32 master params of megatron's mixed-precision
             optimizer

Mechanics, the same on CPU and CUDA: every distinct storage on the trainer's device is copied
whole into a host buffer (pinned on CUDA) and then `untyped_storage().resize_(0)`; onload resizes
it back and copies the bytes in. Working on storages rather than tensors keeps every Python object
valid (Parameters, the main_grad views, the optimizer's references and state keys) and moves a
storage shared by several views once. CPU runs the identical path, so CI tests what CUDA runs.
While a kind is offloaded its tensors must not be touched: their storages hold 0 bytes, and
reading them is undefined (a view raises; a raw kernel on CPU may crash the process).

Grads are dropped, not copied: `MegatronTrainer.step` and `discard_gradients` end with
`model.zero_grad_buffer()`, so between steps the buffers hold zeros and onload re-zeroes them.
If samples are pending (accumulated but not stepped) the grads are copied like the other kinds.

Where tensors are found (explicit paths, read from megatron-core 0.16):
  params     module.named_parameters(), module.buffers(), the extra tensors (reference)
  grads      ddp.buffers + ddp.expert_parallel_buffers -> .grad_data; every param.main_grad
  optimizer  the wrapped optimizer: torch.optim.Optimizer -> param_groups params and .state;
             megatron ChainedOptimizer -> .chained_optimizers; a megatron optimizer -> .optimizer
             (its torch optimizer) and fp32_from_float16_groups

Aliasing, and which kind owns a shared storage: the first of params, grads, optimizer that
reaches it (a fixed precedence, so partial offloads never move another kind's memory). What
megatron-core 0.16 actually aliases, as built here (use_distributed_optimizer=False,
grad_reduce_in_fp32=True):
  - grad_data is its own allocation; params are not remapped into DDP's param_data (that exists
    only with the distributed optimizer, where params are views of it: then params own it).
  - Float16OptimizerWithFloat16Params (bf16 on CUDA): master params are `param.detach().clone()
    .float()`, their own storages -> optimizer. During step `main_param.grad = main_grad.float()`
    aliases the fp32 grad buffer, but `zero_grad(set_to_none=True)` clears it after the step, and
    .grad is not followed anyway.
  - FP32Optimizer (fp32 on CUDA) and TorchAdamW (CPU) put the model params themselves in
    param_groups -> they stay params; the optimizer kind is then only the state (exp_avg,
    exp_avg_sq, step).
Not covered: megatron's small scalar tensors (found_inf, loss scale) and its global memory buffer
for attention scores; empty_cache returns whatever the caching allocator holds free.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

KINDS = ("params", "grads", "optimizer")  # also the precedence for a storage reached by several


@dataclass
class _Parts:
    module: torch.nn.Module
    ddp: Any = None
    optimizer: Any = None
    extra: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # uint8 copy; None: dropped (grads), zeroed on onload


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (whatever dtypes and offsets its views use)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _torch_optimizers(opt: Any) -> Iterator[torch.optim.Optimizer]:
    if opt is None:
        return
    if isinstance(opt, torch.optim.Optimizer):
        yield opt
    elif hasattr(opt, "chained_optimizers"):  # megatron ChainedOptimizer (its .optimizer asserts one)
        for o in opt.chained_optimizers:
            yield from _torch_optimizers(o)
    elif hasattr(opt, "_opt"):  # our StepOptimizer
        yield from _torch_optimizers(opt._opt)
    elif hasattr(opt, "optimizer"):  # megatron MegatronOptimizer; None on a stub
        yield from _torch_optimizers(opt.optimizer)
    else:
        raise TypeError(f"TrainerOffload: cannot find the torch optimizer inside {type(opt).__name__}")


def _megatron_optimizers(opt: Any) -> Iterator[Any]:
    if hasattr(opt, "chained_optimizers"):
        for o in opt.chained_optimizers:
            yield from _megatron_optimizers(o)
    elif hasattr(opt, "_opt"):
        yield from _megatron_optimizers(opt._opt)
    elif opt is not None and not isinstance(opt, torch.optim.Optimizer):
        yield opt


class TrainerOffload:
    """Offload / onload a MegatronTrainer's device memory by kind (see the module docstring).

    `TrainerOffload(trainer)` reads trainer.module, .model (megatron DDP), .optimizer and
    ._reference at every call, so state created or replaced later (optimizer state after the
    first step, a checkpoint load) is found. `TrainerOffload.from_parts(...)` takes the parts.
    Host buffers are kept between rounds (re-pinning gigabytes every step costs seconds); pass
    keep_host_buffers=False to free them at each onload.

    offload(kinds) and onload(kinds) (kinds: one name, several, or None for all) report:
      bytes/<kind>   bytes released from (offload) or restored to (onload) the device, for each
                     asked kind; 0 when the kind was already in that state
      bytes          their sum; copied_bytes: the part copied across (dropped grads are not)
      storages       storages moved; seconds: wall time, copies finished
      on CUDA        cuda_allocated_before/_after: torch.cuda.memory_allocated (this process);
                     cuda_used_before/_after: total - free from mem_get_info, device-wide (so
                     with the engine's memory), after empty_cache
    Not thread-safe; the trainer must not run between offload and onload of a kind it uses.
    """

    def __init__(self, trainer: Any, *, keep_host_buffers: bool = True) -> None:
        self._setup(
            lambda: _Parts(
                trainer.module,
                trainer.model,
                trainer.optimizer,
                list((trainer._reference or {}).values()),
            ),
            device=trainer.device,
            grads_pending=lambda: trainer.pending_samples > 0,
            keep_host_buffers=keep_host_buffers,
        )

    @classmethod
    def from_parts(
        cls,
        module: torch.nn.Module,
        *,
        ddp: Any = None,
        optimizer: Any = None,
        extra: Iterable[torch.Tensor] = (),
        device: torch.device | str | None = None,
        grads_pending: Callable[[], bool] | None = None,
        keep_host_buffers: bool = True,
    ) -> "TrainerOffload":
        """module: the bare model (its params and buffers); ddp: megatron DDP around it (grad
        buffers), if any; optimizer: a StepOptimizer, megatron optimizer or torch optimizer;
        extra: more tensors of the params kind; device: default the first parameter's;
        grads_pending: true when the grads hold something to keep (default: never)."""
        self = cls.__new__(cls)
        parts = _Parts(module, ddp, optimizer, list(extra))
        if device is None:
            device = next(module.parameters()).device
        self._setup(lambda: parts, device=device, grads_pending=grads_pending or (lambda: False),
                    keep_host_buffers=keep_host_buffers)
        return self

    def _setup(self, parts, *, device, grads_pending, keep_host_buffers) -> None:
        self._parts: Callable[[], _Parts] = parts
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._grads_pending = grads_pending
        self._keep_host = keep_host_buffers
        self._offloaded: dict[str, list[_Moved]] = {}
        self._host: dict[int, torch.Tensor] = {}  # storage key -> reusable host buffer
        list(_torch_optimizers(parts().optimizer))  # an unknown optimizer fails here, not mid-run

    # -- where tensors are ----------------------------------------------------------------------
    def _tensors(self, kind: str, parts: _Parts) -> Iterator[Any]:
        if kind == "params":
            yield from parts.module.parameters()
            yield from parts.module.buffers()
            yield from parts.extra
        elif kind == "grads":
            ddp = parts.ddp
            for attr in ("buffers", "expert_parallel_buffers"):
                bufs = getattr(ddp, attr, None) if ddp is not None else None
                if isinstance(bufs, (list, tuple)):  # on a plain Module `buffers` is the method
                    yield from (b.grad_data for b in bufs)
            yield from (getattr(p, "main_grad", None) for p in parts.module.parameters())
        else:
            for opt in _torch_optimizers(parts.optimizer):
                for group in opt.param_groups:
                    yield from group["params"]
                for state in opt.state.values():
                    yield from state.values()
            for opt in _megatron_optimizers(parts.optimizer):
                for group in getattr(opt, "fp32_from_float16_groups", None) or []:
                    yield from group

    def _on_device(self, t: torch.device) -> bool:
        return t.type == self.device.type and (self.device.index is None or t.index == self.device.index)

    def _claims(self) -> dict[str, dict[int, torch.UntypedStorage]]:
        """Each kind's distinct storages on the device, a shared one given to the first kind.
        Keyed by the StorageImpl address (`_cdata`): unlike data_ptr it stays the same while the
        storage is resized to 0 and is shared by all views of one storage."""
        parts = self._parts()
        seen: set[int] = set()
        claims: dict[str, dict[int, torch.UntypedStorage]] = {}
        for kind in KINDS:
            mine: dict[int, torch.UntypedStorage] = {}
            for t in self._tensors(kind, parts):
                if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not self._on_device(t.device):
                    continue
                s = t.untyped_storage()
                if s._cdata not in seen:
                    seen.add(s._cdata)
                    mine[s._cdata] = s
            claims[kind] = mine
        return claims

    # -- moving -----------------------------------------------------------------------------------
    @property
    def offloaded(self) -> tuple[str, ...]:
        """The kinds now offloaded, in KINDS order."""
        return tuple(k for k in KINDS if k in self._offloaded)

    def offload(self, kinds: str | Iterable[str] | None = None) -> dict[str, float]:
        """Copy the kinds' storages to host (grads: drop) and release them on the device."""
        kinds = _kinds(kinds)
        todo = [k for k in kinds if k not in self._offloaded]
        report, t0 = self._begin(kinds), time.perf_counter()
        moved: dict[str, list[_Moved]] = {}
        if todo:
            claims = self._claims()
            self._prune_host({key for c in claims.values() for key in c})
            keep_grads = self._grads_pending()
            for kind in todo:
                moved[kind] = []
                for key, s in claims[kind].items():
                    n = s.nbytes()
                    if n == 0:  # released by someone else (e.g. megatron's offload_grad_buffers)
                        continue
                    if not s.resizable():  # before any storage is released: fail whole
                        raise RuntimeError(f"TrainerOffload: a {kind} storage is not resizable")
                    host = None
                    if kind != "grads" or keep_grads:
                        host = self._host_buffer(key, n)
                        host.copy_(_byte_view(s), non_blocking=self._cuda)
                    moved[kind].append(_Moved(s, n, host))
            if self._cuda:
                torch.cuda.synchronize()  # the copies have landed before the memory is released
            for kind, entries in moved.items():
                for m in entries:
                    m.storage.resize_(0)
                self._offloaded[kind] = entries
            if self._cuda:
                torch.cuda.empty_cache()  # give the freed blocks to the driver, i.e. the engine
        return self._end(report, moved, t0)

    def onload(self, kinds: str | Iterable[str] | None = None) -> dict[str, float]:
        """Reallocate the kinds' storages on the device and copy their bytes back (grads: zero)."""
        kinds = _kinds(kinds)
        report, t0 = self._begin(kinds), time.perf_counter()
        moved = {k: self._offloaded[k] for k in kinds if k in self._offloaded}
        for entries in moved.values():
            for m in entries:
                m.storage.resize_(m.nbytes)
                view = _byte_view(m.storage)
                if m.host is None:
                    view.zero_()
                else:
                    view.copy_(m.host, non_blocking=self._cuda)
        if self._cuda and moved:
            torch.cuda.synchronize()  # before the host buffers may be freed or rewritten
        for kind in moved:
            del self._offloaded[kind]
        if not self._keep_host:
            self._host.clear()
        return self._end(report, moved, t0)

    def _host_buffer(self, key: int, nbytes: int) -> torch.Tensor:
        buf = self._host.get(key)
        if buf is None or buf.numel() != nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
            self._host[key] = buf
        return buf

    def _prune_host(self, live: set[int]) -> None:
        """Drop host buffers of storages the trainer no longer holds (e.g. replaced optimizer state)."""
        for key in list(self._host):
            if key not in live:
                del self._host[key]

    # -- reports ----------------------------------------------------------------------------------
    def _begin(self, kinds: list[str]) -> dict[str, float]:
        report: dict[str, float] = {f"bytes/{k}": 0 for k in kinds}
        if self._cuda:
            report["cuda_allocated_before"] = torch.cuda.memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            report["cuda_used_before"] = total - free
        return report

    def _end(self, report: dict[str, float], moved: dict[str, list[_Moved]], t0: float) -> dict[str, float]:
        for kind, entries in moved.items():
            report[f"bytes/{kind}"] = sum(m.nbytes for m in entries)
        report["bytes"] = sum(m.nbytes for e in moved.values() for m in e)
        report["copied_bytes"] = sum(m.nbytes for e in moved.values() for m in e if m.host is not None)
        report["storages"] = sum(len(e) for e in moved.values())
        report["seconds"] = time.perf_counter() - t0
        if self._cuda:
            report["cuda_allocated_after"] = torch.cuda.memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            report["cuda_used_after"] = total - free
        return report


def _kinds(kinds: str | Iterable[str] | None) -> list[str]:
    if kinds is None:
        return list(KINDS)
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown offload kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return [k for k in KINDS if k in kinds]

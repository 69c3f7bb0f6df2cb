"""LoRA adapters served by the built-in engine, several at once, each request naming its own
(SGLang's `lora_path`): what `/load_lora_adapter_from_tensors`, `/load_lora_adapter` and
`/unload_lora_adapter` manage in the engine core.

An adapter is PEFT's: a config (`r`, `lora_alpha`, `target_modules`) and per HF module an A
[r, in] and a B [out, r] named `base_model.model.<module>.lora_A.weight` / `lora_B.weight`. The
base weights are never touched: a forward hook on each adapted nn.Linear adds
(lora_alpha / r) B A x to the rows whose request names that adapter (`bind`, before each
forward; rows of one adapter are gathered and done as one matmul pair), so requests under
different adapters, or none, share one batch.

An adapter that running or queued requests name cannot be unloaded (refused, with the count):
the caller unloads it once they are done (rollout/engine_updates.py keeps the adapters of
parked samples that resume under their own).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")


@dataclass
class Adapter:
    name: str
    scale: float
    rank: int
    layers: dict[str, tuple[Any, Any]]  # module name -> (A [r, in], B [out, r])
    bytes: int


class AdapterSet:
    """The adapters an engine holds, and the hooks that apply them."""

    def __init__(self, model: Any, *, max_loaded: int = 8) -> None:
        self.model = model
        self.max_loaded = max_loaded
        self.adapters: dict[str, Adapter] = {}
        self._modules = dict(model.named_modules())
        self._hooked: set[str] = set()
        self._rows: dict[str, Any] = {}  # adapter name -> row index tensor of the current forward

    # -- loading ---------------------------------------------------------------------------------
    def load(self, name: str, config: dict[str, Any], tensors: Iterable[tuple[str, Any]], *,
             empty_ok: bool = False) -> Adapter:
        """Validate and hold an adapter (ValueError, naming what is wrong, when it does not fit
        this model). Runs on the decoder thread (between two steps) or before decoding starts.
        `empty_ok`: no tensors is an adapter that changes nothing (the fault switch's drop)."""
        import torch

        if not name:
            raise ValueError("lora_name is empty")
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if len(self.adapters) >= self.max_loaded:
            raise ValueError(f"{len(self.adapters)} LoRA adapters are loaded, the most this engine "
                             f"holds (max_loaded_loras); unload one first")
        if str(config.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{name}: peft_type {config.get('peft_type')!r} is not LORA")
        try:
            rank, alpha = int(config["r"]), float(config["lora_alpha"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: config_dict needs integer r and number lora_alpha") from None
        if rank <= 0:
            raise ValueError(f"{name}: r must be > 0, got {rank}")
        pairs: dict[str, dict[str, Any]] = {}
        for tname, t in tensors:
            m = _PEFT_NAME.match(tname)
            if not m:
                raise ValueError(f"{name}: {tname!r} is not a PEFT LoRA tensor name")
            pairs.setdefault(m.group(1), {})[m.group(2)] = t
        if not pairs and not empty_ok:
            raise ValueError(f"{name}: no LoRA tensors")
        layers: dict[str, tuple[Any, Any]] = {}
        size = 0
        for module, ab in sorted(pairs.items()):
            linear = self._modules.get(module)
            if not isinstance(linear, torch.nn.Linear):
                raise ValueError(f"{name}: {module!r} is not a linear layer of this model")
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{name}: {module} has lora_{'A' if 'A' not in ab else 'B'} missing")
            w = linear.weight
            # copies: tensors from /load_lora_adapter_from_tensors map the sender's memory,
            # which it frees once the engine has answered
            a = ab["A"].to(device=w.device, dtype=w.dtype, copy=True)
            b = ab["B"].to(device=w.device, dtype=w.dtype, copy=True)
            if tuple(a.shape) != (rank, w.shape[1]) or tuple(b.shape) != (w.shape[0], rank):
                raise ValueError(
                    f"{name}: {module} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                    f"its weight {tuple(w.shape)} at r={rank}")
            layers[module] = (a, b)
            size += a.numel() * a.element_size() + b.numel() * b.element_size()
        for module in layers:
            if module not in self._hooked:
                self._modules[module].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        adapter = self.adapters[name] = Adapter(name, alpha / rank, rank, layers, size)
        return adapter

    def unload(self, name: str, in_use: int) -> None:
        if name not in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        if in_use:
            raise ValueError(f"LoRA adapter {name!r} is named by {in_use} running or queued "
                             "request(s); unload it once they are done")
        del self.adapters[name]

    # -- applying --------------------------------------------------------------------------------
    def bind(self, names: list[str | None]) -> None:
        """Row i of the next forward runs under adapter names[i] (None: the base model)."""
        import torch

        rows: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n is not None:
                rows.setdefault(n, []).append(i)
        self._rows = {n: torch.tensor(r, dtype=torch.long) for n, r in rows.items()}

    def _hook(self, module: str):
        def hook(_mod, inputs, output):
            if not self._rows:
                return output
            x = inputs[0]
            for name, rows in self._rows.items():
                layer = self.adapters[name].layers.get(module)
                if layer is None:
                    continue
                a, b = layer
                rows = rows.to(x.device)
                delta = (x.index_select(0, rows) @ a.t()) @ b.t()
                output = output.index_add(0, rows, delta, alpha=self.adapters[name].scale)
            return output
        return hook

    def info(self) -> dict[str, Any]:
        return {n: {"rank": a.rank, "scale": a.scale, "modules": len(a.layers), "bytes": a.bytes}
                for n, a in self.adapters.items()}

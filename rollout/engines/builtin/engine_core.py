"""The engine core: the process that owns the model, the BatchedDecoder and the weight-update
process groups. The HTTP process (hf_server) drives it over one duplex pipe.

Why a separate process: with a small model the decode loop is mostly Python, so an HTTP event
loop in the same process fights it for the GIL and both end up on one core. SGLang splits its
server the same way (tokenizer/HTTP process, scheduler process). Per decode step the core sends
ONE message with every request's new tokens, so IPC costs do not grow with per-token chunks.

Messages (pickled tuples). HTTP -> core:
    ("submit", DecodeRequest)          (its _rng is set by the core's decoder)
    ("abort", rid | None, abort_all)
    ("call", call_id, name, kwargs)    a command, answered by one "result"
    ("stop",)
Core -> HTTP:
    ("ready", info)                    once the model is loaded
    ("progress", [(rid, new_ids, new_logprobs, new_versions, weight_version, finish_wire | None,
                   input_logprobs | None), ...])
                          new_versions: the weight version of each new token; input_logprobs:
                          the scored input (logprob_start_len), in a request's first entry only
    ("result", call_id, ok, value_or_error_message, refused)
                                       refused: the command's arguments were wrong (ValueError),
                                       as opposed to the command failing
    ("crashed", message)
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

log = logging.getLogger("rlkit.engine_core")


@dataclass(frozen=True)
class CoreConfig:
    model_path: str
    tokenizer_path: str
    device: str = "auto"
    dtype: str = "auto"
    threads: int = 1
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 8192
    context_length: int | None = None
    seed: int = 0
    weight_version: str = "0"
    weight_group_timeout_s: float = 600.0
    stream_interval: int = 1  # tokens per streamed chunk: the core reports no more often
    log_level: str = "warning"
    weights_cpu_backup: bool = False  # keep a host copy of released weights (SGLang's flag)
    max_loaded_loras: int = 8  # LoRA adapters held at once (SGLang's --max-loaded-loras)


class EngineCore:
    def __init__(self, config: CoreConfig, conn: Connection) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rlkit.rollout.engines.builtin.batched_decoder import BatchedDecoder

        self.config = config
        self.conn = conn
        self._send_lock = threading.Lock()
        device = config.device if config.device != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        dtype = config.dtype if config.dtype != "auto" else (
            "bfloat16" if device == "cuda" else "float32")
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model_path, dtype=getattr(torch, dtype), attn_implementation="sdpa"
        ).to(self.device).eval()
        self.decoder = BatchedDecoder(
            self.model,
            eos_token_ids=self._eos_ids(),
            detokenize=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            max_running_requests=config.max_running_requests,
            max_total_tokens=config.max_total_tokens,
            max_prefill_tokens=config.max_prefill_tokens,
            context_length=config.context_length,  # None: the model's max_position_embeddings
            seed=config.seed,
            weight_version=config.weight_version,
            on_progress=self._report,
            weights_cpu_backup=config.weights_cpu_backup,
        )
        from rlkit.rollout.engines.builtin.lora_adapters import AdapterSet

        self.decoder.adapters = AdapterSet(self.model, max_loaded=config.max_loaded_loras)
        self.groups: dict[str, Any] = {}
        # Blocking command work (joining a group, receiving a bucket, reading a checkpoint) runs
        # here, so the pipe keeps being read and decoding goes on meanwhile.
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="core-cmd")
        self._reported: dict[str, int] = {}
        self._crash_reported = False

    def info(self) -> dict[str, Any]:
        import torch  # the core process has it loaded; the module stays importable without

        return {
            "vocab_size": int(self.model.get_input_embeddings().weight.shape[0]),
            "context_length": self.decoder.context_length,
            "eos_token_ids": sorted(self.decoder.eos_token_ids),
            "device": str(self.device),
            # the GPU's identity across processes (CUDA_VISIBLE_DEVICES renumbers indices): the
            # trainer checks it before forming an NCCL group (never two ranks on one GPU)
            "gpu_uuids": [str(torch.cuda.get_device_properties(self.device).uuid)]
            if self.device.type == "cuda" else [],
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "max_running_requests": self.decoder.max_running_requests,
            "max_total_tokens": self.decoder.max_total_tokens,
            "max_prefill_tokens": self.decoder.max_prefill_tokens,
            "pid": os.getpid(),
            "max_loaded_loras": self.config.max_loaded_loras,
        }

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(x) for x in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # -- pipe ------------------------------------------------------------------------------------
    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _report(self, requests: list[Any]) -> None:
        """Decoder thread, once per step: the new tokens of the requests that progressed, for
        each request only when the HTTP side has something to do with them (a streamed chunk is
        due, the weight version changed under it, or it finished). The finishing report always
        carries every remaining token."""
        entries = []
        interval = max(1, self.config.stream_interval)
        for r in requests:
            n = len(r.output_ids)
            sent = self._reported.get(r.rid, 0)
            finish = r.finish_reason.wire() if r.finish_reason is not None else None
            version_changed = n > sent and r.output_versions[sent] != r.output_versions[n - 1]
            if finish is None and not version_changed and (not r.stream or n - sent < interval):
                continue  # nothing copied: a non-streamed request is sent only when it finishes
            first = r.rid not in self._reported
            entries.append((r.rid, r.output_ids[sent:n], r.output_logprobs[sent:n],
                            r.output_versions[sent:n], r.weight_version, finish,
                            r.input_logprobs if first else None))
            if finish is None:
                self._reported[r.rid] = n
            else:
                self._reported.pop(r.rid, None)
        if entries:
            self.send(("progress", entries))
        if self.decoder.crashed and not self._crash_reported:
            self._crash_reported = True
            self.send(("crashed", self.decoder.crashed))

    def serve(self) -> None:
        self.decoder.start()
        self.send(("ready", self.info()))
        while True:
            try:
                message = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                break  # the HTTP process is gone: so are we
            kind = message[0]
            if kind == "submit":
                self.decoder.submit(message[1])
            elif kind == "abort":
                self.decoder.abort(message[1], abort_all=message[2])
            elif kind == "call":
                self.pool.submit(self._answer, message[1], message[2], message[3])
            elif kind == "stop":
                break
        self.decoder.abort(abort_all=True)
        self.decoder.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _answer(self, call_id: int, name: str, kwargs: dict[str, Any]) -> None:
        handler: Callable[..., Any] | None = getattr(self, f"cmd_{name}", None)
        try:
            if handler is None:
                raise ValueError(f"unknown engine command {name!r}")
            result = (True, handler(**kwargs), False)
        except Exception as e:  # answered, not raised: the HTTP side turns it into a 4xx/5xx
            log.debug("command %s failed:\n%s", name, traceback.format_exc())
            refused = isinstance(e, ValueError)
            result = (False, str(e) if refused else f"{type(e).__name__}: {e}", refused)
        self.send(("result", call_id, *result))

    # -- commands (pool threads; decoder-state changes go through decoder.call) -----------------
    def cmd_loads(self) -> dict[str, Any]:
        return self.decoder.loads()

    def cmd_stats(self, reset: bool = False) -> dict[str, Any]:
        if reset:
            return self.decoder.call(self.decoder.reset_stats).result()
        return self.decoder.stats.as_dict()

    def cmd_pause(self, mode: str) -> int:
        return self.decoder.pause(mode).result()  # type: ignore[arg-type]

    def cmd_resume(self) -> None:
        self.decoder.resume().result()

    def cmd_flush(self) -> bool:
        return self.decoder.flush().result()

    def cmd_set_weight_version(self, version: str) -> None:
        self.decoder.set_weight_version(version).result()

    def cmd_memory(self) -> dict[str, Any]:
        return self.decoder.memory_state()

    def cmd_release_memory(self, tags: list[str] | None) -> dict[str, Any]:
        report = self.decoder.release_memory(tags).result()
        log.info("released memory %s: freed %s", list(report["freed_bytes"]), report["freed_bytes"])
        return {**report, "memory": self.decoder.memory_state()}

    def cmd_resume_memory(self, tags: list[str] | None) -> dict[str, Any]:
        report = self.decoder.resume_memory(tags).result()
        log.info("resumed memory %s: %s", list(report["resumed_bytes"]), report["resumed_bytes"])
        return {**report, "memory": self.decoder.memory_state()}

    def _apply(self, tensors: dict[str, Any], version: str | None, abort_all: bool, flush: bool) -> str:
        from rlkit.rollout.engines.builtin.weight_receiver import load_into_model

        def load() -> None:  # on the decoder thread, between two steps
            self.decoder.check_weights_resident()
            load_into_model(self.model, tensors)
            self.decoder.weights_loaded(tensors)

        if abort_all:
            self.decoder.abort(abort_all=True)
        self.decoder.call(load).result()
        message = f"Updated {len(tensors)} tensors."
        if version is not None:
            self.decoder.set_weight_version(version).result()
            message += f" Weight version updated to {version}."
        if flush:
            self.decoder.flush().result()
        return message

    def cmd_update_from_disk(self, model_path: str, version: str | None, abort_all: bool,
                             flush: bool) -> str:
        from rlkit.rollout.engines.builtin.weight_receiver import named_for_model, read_checkpoint

        self.decoder.check_weights_resident()  # before reading the checkpoint (_apply checks again)
        tensors = named_for_model(self.model, read_checkpoint(model_path))
        return self._apply(tensors, version, abort_all, flush)

    def cmd_update_from_tensor(self, serialized_named_tensors: list[str], load_format: str | None,
                               version: str | None, abort_all: bool, flush: bool) -> str:
        """Weights in memory (tensor_receiver.py): this TP rank's entry mapped, not copied."""
        from rlkit.rollout.engines.builtin.tensor_receiver import tensors_from_request
        from rlkit.rollout.engines.builtin.weight_receiver import check_named_shapes

        tensors = dict(tensors_from_request(serialized_named_tensors, tp_rank=0, load_format=load_format))
        try:
            check_named_shapes(self.model, ((n, tuple(t.shape)) for n, t in tensors.items()))
            return self._apply(tensors, version, abort_all, flush)
        finally:
            tensors.clear()  # unmap now: the trainer frees the bucket once we answer

    # -- LoRA adapters (lora_adapters.py): loaded and unloaded between two decode steps ----------
    def cmd_load_lora_from_tensors(self, lora_name: str, config_dict: dict[str, Any],
                                   serialized_named_tensors: list[str], load_format: str | None,
                                   dropped: bool = False) -> dict:
        from rlkit.rollout.engines.builtin.tensor_receiver import tensors_from_request

        tensors = tensors_from_request(serialized_named_tensors, tp_rank=0, load_format=load_format)
        return self._load_lora(lora_name, config_dict, [] if dropped else tensors, dropped)

    def cmd_load_lora(self, lora_name: str, lora_path: str, dropped: bool = False) -> dict:
        """A PEFT folder (adapter_config.json + adapter_model.safetensors)."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        folder = Path(lora_path)
        try:
            config = json.loads((folder / "adapter_config.json").read_text())
            tensors = load_file(str(folder / "adapter_model.safetensors"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{lora_path}: not a PEFT adapter folder ({e})") from None
        return self._load_lora(lora_name, config, [] if dropped else tensors.items(), dropped)

    def _load_lora(self, name: str, config: dict[str, Any], tensors: Any, dropped: bool) -> dict:
        """`dropped` (the test-only fault switch): the name is served by the base model."""
        adapters = self.decoder.adapters
        self.decoder.call(lambda: adapters.load(name, config, tensors, empty_ok=dropped)).result()
        return adapters.info()

    def cmd_unload_lora(self, lora_name: str) -> dict:
        adapters = self.decoder.adapters
        self.decoder.call(
            lambda: adapters.unload(lora_name, self.decoder.lora_in_use(lora_name))).result()
        return adapters.info()

    def cmd_init_group(self, master_address: str, master_port: int, rank: int, world_size: int,
                       group_name: str, backend: str) -> str:
        from rlkit.rollout.engines.builtin.weight_receiver import WeightGroup, create_group

        if group_name in self.groups:
            raise ValueError(f"weight update group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA engine; use backend gloo on CPU")
        pg = create_group(master_address=master_address, master_port=master_port, rank=rank,
                          world_size=world_size, group_name=group_name, backend=backend,
                          timeout_s=self.config.weight_group_timeout_s)
        self.groups[group_name] = WeightGroup(group_name, rank, world_size, backend, pg,
                                              threading.Lock())
        return f"Joined weight update group {group_name!r} as rank {rank} of {world_size}."

    def cmd_destroy_group(self, group_name: str) -> str:
        from rlkit.rollout.engines.builtin.weight_receiver import destroy_group

        group = self.groups.pop(group_name, None)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}")
        destroy_group(group.group)
        return f"Destroyed weight update group {group_name!r}."

    def cmd_receive_bucket(self, group_name: str, names: list[str], dtypes: list[str],
                           shapes: list[list[int]], version: str | None, abort_all: bool,
                           flush: bool) -> str:
        from rlkit.rollout.engines.builtin.weight_receiver import (
            check_named_shapes, parse_dtype, receive_bucket)

        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight update group {group_name!r}; call "
                             "/init_weights_update_group first")
        for d in dtypes:
            parse_dtype(d)
        # Receive the whole bucket before judging it, so rank 0's broadcasts always complete.
        tensors = receive_bucket(group, names, dtypes, shapes, self.device)
        try:
            self.decoder.check_weights_resident()
            check_named_shapes(self.model, ((n, tuple(s)) for n, s in zip(names, shapes)))
        except ValueError as e:  # WeightUpdateError is one
            raise ValueError(f"bucket received but not applied: {e}") from None
        return self._apply(tensors, version, abort_all, flush)


def run_engine_core(conn: Connection, config: CoreConfig) -> None:
    """Entry point of the core process (multiprocessing, spawn)."""
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    torch.set_num_threads(max(1, config.threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    try:
        core = EngineCore(config, conn)
    except BaseException as e:
        conn.send_bytes(pickle.dumps(("crashed", f"engine core failed to start: "
                                      f"{type(e).__name__}: {e}")))
        raise
    core.serve()

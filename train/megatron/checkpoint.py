"""Trainer checkpoints: model, optimizer, RNG, step and version; resumable at another TP or DP size.

Layout of a checkpoint folder (format 2):
  meta.json              step, version, the TP/DP sizes that wrote it, the architecture, the format,
                         and where each Megatron parameter lies in dist/ (for `rlkit export`)
  hf/                    config.json + tokenizer files of the source model (for `rlkit export`)
  dist/                  megatron-core `dist_checkpointing` folder (backend torch_dist): every
                         parameter and Adam moment as one global tensor (the TP=1 layout), written
                         in the saving ranks' shards and cut again into the loading ranks' own, so
                         a checkpoint of TP=2 resumes at TP=1 or DP=2 and the reverse; the
                         optimizer's step and hyper-parameters as its common state (common.pt)
  rng_rank{g:04d}.pt     python/torch(/cuda) RNG states of global rank g

Saving: dist/ is written into a hidden sibling (`.dist.tmp`, every file fsync'd) renamed
into place, the other files through temporary siblings renamed into place, then a barrier; rank 0
writes meta.json last (after removing it first), so a folder with meta.json is complete. Only the
main replica (DP rank 0) writes tensors.

Loading reads nothing as code: torch files with `weights_only=True`, and dist/'s `.metadata`
(a pickle, which torch's reader unpickles with plain `pickle.load`) is checked first with an
unpickler that knows only the classes of torch's checkpoint index, which must list tensors only
(a "bytes" entry would be unpickled without weights_only). A missing or cut-short file (its
index says how long each must be), a foreign one, another architecture are refused naming the
file. The RNG state of a rank the checkpoint has no file for (a larger world) is reseeded.

Format 1 (per-TP files `model_tp{r}.pt`, `optim_tp{r}.pt`; rlkit before issue 23) still loads,
at the TP size that wrote it; at another TP size the message says how to convert it (load it at
its TP size and save: saves write format 2).

Not resharded: pipeline parallelism (not wired in rlkit), megatron's distributed optimizer (not
used). On CUDA the optimizer's part is megatron's own optimizer's sharded_state_dict, not run
here (no GPU in the tests). The backend sits behind `_save_dist` / `_load_dist` and
`read_dist_model` (export).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlkit.common.errors import CheckpointError
from rlkit.buffers.persistence import fsync_dir
from rlkit.train.hf_io import copy_side_files
from rlkit.train.megatron.parallel import seed_everything


class Checkpointed(Protocol):
    """What saving and loading need of a trainer (MegatronTrainer is one): typed structurally so
    this module and the trainer, which calls it, do not import each other."""

    rank: Any  # parallel.RankInfo: rank, tp_rank, dp_rank
    optimizer: Any  # optimizer.StepOptimizer
    device: torch.device
    dtype: torch.dtype
    model_path: Path
    arch: Any  # hf_arch.HFArch
    config: Any  # train.config.TrainConfig
    step_count: int
    version: int
    pending_samples: int

    @property
    def module(self) -> torch.nn.Module: ...  # the bare GPTModel
    def megatron_state(self) -> dict[str, torch.Tensor]: ...
    def _load_megatron_state(self, state: dict[str, torch.Tensor]) -> None: ...
    def lora_merge_plan(self) -> dict[str, list]: ...
    def discard_gradients(self) -> None: ...


FORMAT_VERSION = 2  # dist_checkpointing (reshards)
LEGACY_FORMAT_VERSION = 1  # per-TP files
DIST_DIR = "dist"


def _rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _world(trainer: Checkpointed) -> bool:
    return dist.is_initialized() and trainer.rank.world_size > 1


def _all_ok(trainer: Checkpointed, ok: bool) -> bool:
    """Whether every rank says ok (a collective: a rank that failed alone must not leave the
    others waiting in a barrier)."""
    if not _world(trainer):
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=trainer.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _dcp_errors() -> tuple[type[BaseException], ...]:
    """What a failed save or load raises: torch.distributed.checkpoint gathers every rank's
    exception into a CheckpointException, which is a BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _why(e: BaseException, limit: int = 300) -> str:
    """The cause in one line: the errno text, or the (first rank's) exception's message."""
    failures = getattr(e, "failures", None)  # torch's CheckpointException: {rank: (exc, tb)}
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    cause: BaseException | None = e  # torch.save words a failed write "unexpected pos": the
    while cause is not None and not isinstance(cause, OSError):  # OSError is its context
        cause = cause.__cause__ or cause.__context__
    e = cause if cause is not None else e
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip()
    text = text.splitlines()[-1] if text else type(e).__name__
    if isinstance(e, KeyError) and " " not in text:
        text = f"it has no {text}"
    if "unexpected pos" in text:  # torch.save into a stream whose write failed; errno is lost
        text = f"a write stopped part-way, is the disk full? ({text})"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the dist_checkpointing backend ---------------------------------------------------------------
def _sharded_state(trainer: Checkpointed, *, is_loading: bool) -> dict[str, Any]:
    """{"model": the GPTModel's sharded state dict, "optimizer": the optimizer's, cut like it}."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    model = trainer.module.sharded_state_dict()
    # Tensors only: dist_checkpointing stores ShardedObjects (module extra state, empty for the
    # local layer spec) as pickles it loads without weights_only.
    model = {k: v for k, v in model.items() if not isinstance(v, ShardedObject)}
    return {"model": model, "optimizer": trainer.optimizer.sharded_state_dict(model, is_loading=is_loading)}


def _dist_keys(model_sharded: dict[str, Any], names: list[str]) -> dict[str, list]:
    """Where each Megatron parameter lies in dist/: [global tensor key, layer index or None]
    (megatron stacks the decoder layers' tensors along a leading axis)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out: dict[str, list] = {}
    for name in names:
        sh = model_sharded[name]
        if isinstance(sh, ShardedTensorFactory):  # e.g. SwiGLU's fc1: one key, two halves
            sh = next(iter(nested_values(sh.build())))
        layer = sh.global_offset[0] if sh.prepend_axis_num else None
        out[name] = [sh.key, None if layer is None else int(layer)]
    return out


def _sync_torch_dist_strategy():
    """megatron-core's torch_dist save strategy, written synchronously in this process.

    Its own `save` goes through the asynchronous writer, which starts a `spawn` Manager process
    for a results queue, forks one writer process per file and calls `torch.cuda.synchronize()`
    (no CPU path). The files are torch.distributed.checkpoint's either way: this writes the same
    translation of megatron's sharded tensors (same keys, same planner) with torch's own
    FileSystemWriter (fsync'd), and megatron's torch_dist loader reads them."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class SyncTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp.save(
                mcore_to_pyt_state_dict(sharded_state_dict, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1, sync_files=True),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                ),
            )

    return SyncTorchDistSave("torch_dist", 1)


def _save_dist(trainer: Checkpointed, path: Path) -> dict[str, list]:
    """Write dist/ (collective) and return the parameters' keys for meta.json."""
    from megatron.core import dist_checkpointing

    from rlkit.train.convert import megatron_param_names

    r = trainer.rank
    final, tmp = path / DIST_DIR, path / f".{DIST_DIR}.tmp"
    failure = None
    if r.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            failure = e
    if not _all_ok(trainer, failure is None):
        raise CheckpointError(f"{tmp}: cannot write ({_why(failure) if failure else 'failed on rank 0'})")
    state = _sharded_state(trainer, is_loading=False)
    adapters = [a for merge in trainer.lora_merge_plan().values() for a in merge[:2]]
    keys = _dist_keys(state["model"], megatron_param_names(trainer.arch) + adapters)
    try:
        dist_checkpointing.save(state, str(tmp), sharded_strategy=_sync_torch_dist_strategy())
    except _dcp_errors() as e:  # torch reports a failed write on every rank
        if r.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{tmp}: cannot write ({_why(e)})") from None
    failure = None
    if r.rank == 0:  # every rank's files are written (the save ends in a barrier)
        old = path / f".{DIST_DIR}.old"
        try:
            for f in tmp.iterdir():  # torch fsyncs its own files, megatron not common.pt
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            shutil.rmtree(old, ignore_errors=True)
            if final.exists():
                final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
            fsync_dir(path)
        except OSError as e:
            failure = e
    if not _all_ok(trainer, failure is None):
        raise CheckpointError(f"{final}: cannot write ({_why(failure) if failure else 'failed on rank 0'})")
    return keys


def _load_dist(trainer: Checkpointed, path: Path) -> None:
    from megatron.core import dist_checkpointing

    folder = path / DIST_DIR
    check_dist_folder(folder)
    state = _sharded_state(trainer, is_loading=True)
    try:
        loaded = dist_checkpointing.load(state, str(folder))
    except _dcp_errors() as e:  # megatron and torch word a mismatch many ways
        raise CheckpointError(f"{folder}: does not fit this model and optimizer ({_why(e)})") from None
    try:
        trainer._load_megatron_state(loaded["model"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: does not fit this model ({e})") from None
    try:
        trainer.optimizer.load_sharded_state_dict(loaded["optimizer"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: does not fit this optimizer ({e})") from None


# torch.distributed.checkpoint's index (`.metadata`), and nothing else, may be unpickled.
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a name -> torch.strided and the like
    "torch": {"Size"},  # and the dtypes, below
    "pathlib": {"PosixPath", "PurePosixPath"},  # the checkpoint id
    "collections": {"OrderedDict"},
}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _INDEX_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def check_dist_folder(folder: Path) -> Any:
    """The checkpoint index of a dist/ folder, checked before torch reads it: it unpickles to
    the index's own classes only, lists tensors only, and every file it points into is there
    and long enough. A CheckpointError names the file otherwise."""
    index = folder / ".metadata"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: missing (an incomplete checkpoint?)")
    if not index.is_file():
        raise CheckpointError(f"{index}: missing checkpoint index (an incomplete checkpoint?)")
    try:
        metadata = _IndexUnpickler(io.BytesIO(index.read_bytes())).load()
    except Exception as e:  # noqa: BLE001 - a cut pickle, a foreign class, ...
        raise CheckpointError(f"{index}: unreadable checkpoint index, truncated or not one ({_why(e)})") from None
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{index}: not a checkpoint index ({type(metadata).__name__})")
    pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    if pickled:
        raise CheckpointError(f"{index}: lists pickled objects ({', '.join(pickled[:3])}), not tensors only")
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = str(info.relative_path)
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = folder / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"{index}: points outside its folder ({rel})")
        if not f.is_file():
            raise CheckpointError(f"{f}: missing tensor file (an incomplete checkpoint?)")
        if f.stat().st_size < size:
            raise CheckpointError(f"{f}: cut short ({f.stat().st_size} bytes, the index needs {size})")
    common = folder / "common.pt"
    if common.is_file():  # the optimizer's step and hyper-parameters: plain data
        _load(common, "common state")
    return metadata


# -- save and load ---------------------------------------------------------------------------------
def save_checkpoint(trainer: Checkpointed, path: Path) -> None:
    if trainer.pending_samples:
        raise CheckpointError(
            f"save: {trainer.pending_samples} samples accumulated since the last step; step first"
        )
    r = trainer.rank
    meta_file = path / "meta.json"
    failure = None
    try:
        path.mkdir(parents=True, exist_ok=True)
        if r.rank == 0:
            meta_file.unlink(missing_ok=True)  # being rewritten: incomplete until meta.json is back
            for old in (*path.glob("model_tp*.pt"), *path.glob("optim_tp*.pt")):  # format 1's
                old.unlink()
            for old in path.glob("rng_rank*.pt"):  # of a larger world that saved here before
                index = old.stem.removeprefix("rng_rank")
                if not index.isdigit() or int(index) >= r.world_size:
                    old.unlink()
    except OSError as e:
        failure = e
    if not _all_ok(trainer, failure is None):
        why = f"{failure.strerror or failure}" if failure else "failed on another rank"
        raise CheckpointError(f"{path}: cannot write the trainer checkpoint ({why})") from None
    keys = _save_dist(trainer, path)
    _save(_rng_state(trainer.device), path / f"rng_rank{r.rank:04d}.pt")
    if r.rank == 0:
        hf = path / "hf"
        try:
            hf.mkdir(exist_ok=True)
            shutil.copy2(trainer.model_path / "config.json", hf / "config.json")
            copy_side_files(trainer.model_path, hf)
        except OSError as e:
            raise CheckpointError(f"{hf}: cannot write ({e.strerror or e})") from None
    if _world(trainer):
        dist.barrier()
    if r.rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "format": "megatron-core dist_checkpointing (torch_dist)",
            "step": trainer.step_count,
            "version": trainer.version,
            "tensor_parallel": r.tp_size,
            "data_parallel": r.dp_size,
            "arch": trainer.arch.to_dict(),
            "source_model": str(trainer.model_path),
            "dtype": str(trainer.dtype).removeprefix("torch."),
            "dist_keys": keys,
            # LoRA: each adapted weight's [A, B, scale] (their tensors are in dist_keys); export
            # merges W + scale B A
            "lora": trainer.lora_merge_plan() or None,
        }
        _replace(meta_file, lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
    if _world(trainer):
        dist.barrier()


def _save(obj: object, file: Path) -> None:
    _replace(file, lambda tmp: torch.save(obj, tmp))


def _replace(file: Path, write) -> None:
    """Write `file` through a temporary sibling renamed over it, so a crash or a full disk never
    leaves a half-written file under the real name. A write failure names the file."""
    tmp = file.with_name(f".{file.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1]
        raise CheckpointError(f"{file}: cannot write ({why})") from None


def _load(file: Path, what: str) -> dict:
    """A checkpoint file as tensors and plain data only (weights_only: never runs code from the
    file); a missing, truncated or foreign file is refused with its name."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing {what} (an incomplete checkpoint?)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch reports a cut zip, a bad pickle, ... differently
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: unreadable {what}, truncated or not a checkpoint file ({why})") from None


def read_meta(path: Path) -> dict:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no meta.json (not a checkpoint, or an incomplete one)")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: unreadable ({e})") from None
    got = meta.get("format_version") if isinstance(meta, dict) else None
    if got not in (FORMAT_VERSION, LEGACY_FORMAT_VERSION):
        raise CheckpointError(
            f"{meta_file}: format_version {got}; this rlkit reads {FORMAT_VERSION} and {LEGACY_FORMAT_VERSION}"
        )
    missing = {"step", "version", "tensor_parallel", "arch"} - set(meta)
    if got == FORMAT_VERSION:
        missing |= {"dist_keys"} - set(meta)
    if missing:
        raise CheckpointError(f"{meta_file}: lacks {', '.join(sorted(missing))}")
    return meta


def load_checkpoint(trainer: Checkpointed, path: Path) -> None:
    meta = read_meta(path)
    r = trainer.rank
    if meta["arch"] != trainer.arch.to_dict():
        theirs, mine = meta["arch"], trainer.arch.to_dict()
        diff = ", ".join(f"{k} {theirs.get(k)!r} vs {mine.get(k)!r}" for k in sorted(set(theirs) | set(mine))
                         if theirs.get(k) != mine.get(k))
        raise CheckpointError(
            f"{path / 'meta.json'}: saved for a different architecture than {trainer.model_path} ({diff})"
        )
    if meta["format_version"] == LEGACY_FORMAT_VERSION:
        _load_legacy(trainer, path, meta)
    else:
        _load_dist(trainer, path)
    rng_file = path / f"rng_rank{r.rank:04d}.pt"
    if rng_file.is_file():
        _set_rng_state(_load(rng_file, "RNG state"), trainer.device)
    else:
        seed_everything(trainer.config.seed + r.rank + 7919 * meta["step"])
    trainer.step_count = int(meta["step"])
    trainer.version = int(meta["version"])
    trainer.discard_gradients()


def _load_legacy(trainer: Checkpointed, path: Path, meta: dict) -> None:
    """Format 1: this TP rank's own files, so the same TP size only."""
    r = trainer.rank
    if meta["tensor_parallel"] != r.tp_size:
        raise CheckpointError(
            f"{path / 'meta.json'}: a format-1 checkpoint (per-TP files) saved with "
            f"TP={meta['tensor_parallel']}, this trainer runs TP={r.tp_size}. Convert it: load it "
            f"once at TP={meta['tensor_parallel']} and save (saves write format 2, which loads at "
            "any TP and DP), or `rlkit export` it and start from the HF folder (weights only)"
        )
    model_file = path / f"model_tp{r.tp_rank:02d}.pt"
    model = _load(model_file, "model shard")
    try:
        trainer._load_megatron_state(model)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{model_file}: does not fit this model ({e})") from None
    optim_file = path / f"optim_tp{r.tp_rank:02d}.pt"
    optim = _load(optim_file, "optimizer state")
    try:
        trainer.optimizer.load_state_dict(optim)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{optim_file}: does not fit this optimizer ({e})") from None


# -- export (no megatron, no process group) --------------------------------------------------------
def checkpoint_hf_shards(path: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(meta, Megatron state of every TP rank) of a checkpoint, for export without megatron:
    format 2 gives one state of TP=1 layout, format 1 its per-TP files."""
    meta = read_meta(path)
    if meta["format_version"] == LEGACY_FORMAT_VERSION:
        return meta, [_load(path / f"model_tp{t:02d}.pt", "model shard") for t in range(meta["tensor_parallel"])]
    state = read_dist_model(path, meta)
    for name, (a, b, scale) in (meta.get("lora") or {}).items():  # a LoRA run: merged weights
        delta = (state.pop(b).double() @ state.pop(a).double()) * scale
        state[name] = (state[name].double() + delta).to(state[name].dtype)
    return meta, [state]


def read_dist_model(path: Path, meta: dict | None = None) -> dict[str, torch.Tensor]:
    """The whole Megatron parameters (TP=1 layout) from dist/, read in this one process with
    torch.distributed.checkpoint (no process group; the optimizer's tensors are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = meta if meta is not None else read_meta(path)
    folder = path / DIST_DIR
    index = check_dist_folder(folder)
    wanted = {key for key, _ in meta["dist_keys"].values()}
    full: dict[str, torch.Tensor] = {}
    for key in sorted(wanted):
        md = index.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{folder / '.metadata'}: has no tensor {key!r} (meta.json lists it)")
        full[key] = torch.empty(md.size, dtype=md.properties.dtype)
    try:
        dcp.load(full, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    except _dcp_errors() as e:
        raise CheckpointError(f"{folder}: unreadable ({_why(e)})") from None
    out: dict[str, torch.Tensor] = {}
    for name, (key, layer) in meta["dist_keys"].items():
        out[name] = full[key] if layer is None else full[key][int(layer)]
    return out

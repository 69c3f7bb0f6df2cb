"""Trainer checkpoints in megatron-core's dist_checkpointing format (train/megatron/checkpoint.py):
a checkpoint written at TP=2 resumes at TP=1 and the reverse with its optimizer state, `rlkit
export` reads it, damaged or code-carrying files are refused by name, and the per-TP files of
format 1 still load at their own TP size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.train.helpers import random_batch
from rlkit.train.config import TrainConfig

pytestmark = pytest.mark.integration

LR = 1e-3
LOGPROB_ATOL = 1e-5  # fp32; TP=2 and TP=1 compute the same sums in another order
# After one more Adam step the weights of two layouts agree to float noise scaled by lr; a lost
# optimizer state moves them by ~lr (checked below), a hundred times more.
WEIGHT_ATOL = 1e-2 * LR


def config(tp: int = 1, dp: int = 1) -> TrainConfig:
    return TrainConfig.model_validate(
        {"device": "cpu", "parallelism": {"tensor": tp, "data": dp}, "micro_batch_size": 4,
         "optimizer": {"lr": LR}}
    )


def local(model_dir):
    from rlkit.train.megatron.trainer import MegatronTrainer

    return MegatronTrainer.single_process(model_dir, config())


def hf_weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.iter_hf_weights()}


def group_weights(group, folder: Path) -> dict[str, torch.Tensor]:
    from rlkit.train.hf_io import load_hf_state_dict

    return load_hf_state_dict(group.export_hf(folder))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def close_logprobs(a, b) -> bool:
    return all(torch.allclose(x, y, rtol=0, atol=LOGPROB_ATOL) for x, y in zip(a, b, strict=True))


def train(trainer, *seeds: int) -> None:
    for seed in seeds:
        trainer.accumulate(random_batch(6, seed=seed))
        trainer.step()


@pytest.mark.slow
def test_checkpoints_reshard_between_tp1_tp2_and_dp2_with_the_optimizer_state(ray_cluster, tiny_qwen2_dir, tmp_path):
    """TP=1 -> TP=2 -> TP=1 and -> DP=2 -> TP=1 through checkpoints: logprobs of a fixed batch
    equal after each load, and the next step gives the weights of the run that went on without
    saving (the Adam moments and step travelled); `rlkit export` of the TP=2 checkpoint gives
    its weights."""
    from rlkit.cli import main
    from rlkit.train.hf_io import load_hf_state_dict
    from rlkit.train.ray_group import TrainerGroup

    fixed = random_batch(7, seed=30)
    a = local(tiny_qwen2_dir)
    train(a, 31, 32)  # moments with a history: a lost state would show
    a.save(tmp_path / "tp1")
    assert json.loads((tmp_path / "tp1" / "meta.json").read_text())["format_version"] == 2
    lp_tp1 = a.logprobs(fixed)
    train(a, 33)
    continued = hf_weights(a)

    # the control: the same weights with a fresh optimizer end far from the continued run
    fresh = local(tiny_qwen2_dir)
    fresh.load(tmp_path / "tp1")
    fresh.optimizer._opt.state.clear()
    train(fresh, 33)
    assert max_diff(hf_weights(fresh), continued) > 30 * WEIGHT_ATOL

    g = TrainerGroup(tiny_qwen2_dir, config(tp=2), num_cpus_per_worker=1)
    try:
        g.load(tmp_path / "tp1")
        assert g.step_count == 2
        assert close_logprobs(g.logprobs(fixed), lp_tp1)
        train(g, 33)
        assert max_diff(group_weights(g, tmp_path / "g1"), continued) <= WEIGHT_ATOL
        g.save(tmp_path / "tp2")
        lp_tp2 = g.logprobs(fixed)
        train(g, 34)
        continued_tp2 = group_weights(g, tmp_path / "g2")
    finally:
        g.shutdown()

    b = local(tiny_qwen2_dir)
    b.load(tmp_path / "tp2")
    assert (b.step_count, json.loads((tmp_path / "tp2" / "meta.json").read_text())["tensor_parallel"]) == (3, 2)
    assert close_logprobs(b.logprobs(fixed), lp_tp2)
    assert main(["export", str(tmp_path / "tp2"), str(tmp_path / "exported")]) == 0
    exported, loaded = load_hf_state_dict(tmp_path / "exported"), hf_weights(b)
    assert sorted(exported) == sorted(loaded) and all(torch.equal(exported[k], loaded[k]) for k in loaded)
    train(b, 34)
    assert max_diff(hf_weights(b), continued_tp2) <= WEIGHT_ATOL

    d = TrainerGroup(tiny_qwen2_dir, config(dp=2), num_cpus_per_worker=1)
    try:
        d.load(tmp_path / "tp2")
        assert close_logprobs(d.logprobs(fixed), lp_tp2)
        train(d, 34)
        assert max_diff(group_weights(d, tmp_path / "d1"), continued_tp2) <= WEIGHT_ATOL
        d.save(tmp_path / "dp2")  # the main replica (DP rank 0) writes the tensors
        lp_dp2 = d.logprobs(fixed)
    finally:
        d.shutdown()
    c = local(tiny_qwen2_dir)
    c.load(tmp_path / "dp2")
    assert c.step_count == 4 and close_logprobs(c.logprobs(fixed), lp_dp2)


def save_format1(trainer, path: Path) -> None:
    """What rlkit wrote before format 2, from a world of one (TP=1)."""
    from rlkit.train.megatron.checkpoint import _rng_state

    (path / "hf").mkdir(parents=True)
    torch.save({n: t.clone() for n, t in trainer.megatron_state().items()}, path / "model_tp00.pt")
    torch.save(trainer.optimizer.state_dict(), path / "optim_tp00.pt")
    torch.save(_rng_state(trainer.device), path / "rng_rank0000.pt")
    shutil.copy2(trainer.model_path / "config.json", path / "hf" / "config.json")
    meta = {"format_version": 1, "step": trainer.step_count, "version": trainer.version,
            "tensor_parallel": 1, "data_parallel": 1, "arch": trainer.arch.to_dict(),
            "source_model": str(trainer.model_path), "dtype": "float32"}
    (path / "meta.json").write_text(json.dumps(meta))


class Payload:  # a pickle that would run code when loaded without weights_only
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def refused(trainer, tmp_path: Path, good: Path, cases: dict) -> None:
    """Each case: a copy of `good` changed so that loading must fail with `message` (after the
    folder's path); the intact folder loads afterwards."""
    from rlkit.train.megatron.checkpoint import CheckpointError

    for name, (change, message) in cases.items():
        path = tmp_path / name
        shutil.copytree(good, path)
        change(path)
        with pytest.raises(CheckpointError) as e:
            trainer.load(path)
        assert f"{path}/{message}" in str(e.value), (name, str(e.value))
    assert not (tmp_path / "code-ran").exists()  # nothing in a file ran


def cut(file: str):
    return lambda p: (p / file).write_bytes((p / file).read_bytes()[: (p / file).stat().st_size // 2])


def meta(**kw):
    return lambda p: (p / "meta.json").write_text(json.dumps({**json.loads((p / "meta.json").read_text()), **kw}))


def test_format1_checkpoints_load_at_their_tp_and_name_the_conversion_otherwise(tiny_qwen2_dir, tmp_path):
    """A format-1 folder resumes exactly (weights, moments, RNG, step) and exports; saved again
    it becomes format 2, which loads the same; damaged format-1 files are refused by name."""
    from rlkit.commands.export import export_checkpoint
    from rlkit.train.hf_io import load_hf_state_dict

    a = local(tiny_qwen2_dir)
    train(a, 40)
    a.version = 3
    save_format1(a, tmp_path / "v1")
    rng_after_save = torch.rand(3)
    saved = hf_weights(a)
    train(a, 41)

    b = local(tiny_qwen2_dir)
    b.load(tmp_path / "v1")
    assert (b.step_count, b.version) == (1, 3)
    exported = load_hf_state_dict(export_checkpoint(tmp_path / "v1", tmp_path / "v1-hf"))
    assert sorted(exported) == sorted(saved) and all(torch.equal(exported[k], saved[k]) for k in saved)
    assert torch.equal(torch.rand(3), rng_after_save)
    b.save(tmp_path / "v2")  # the conversion: load at its TP, save
    c = local(tiny_qwen2_dir)
    c.load(tmp_path / "v2")
    train(b, 41)
    train(c, 41)
    wa, wb, wc = a.megatron_state(), b.megatron_state(), c.megatron_state()
    assert all(torch.equal(wa[k], wb[k]) and torch.equal(wa[k], wc[k]) for k in wa)

    def wrong_shape(p):
        shard = torch.load(p / "model_tp00.pt", weights_only=True)
        name = next(iter(shard))
        shard[name] = shard[name][:1]
        torch.save(shard, p / "model_tp00.pt")

    refused(b, tmp_path, tmp_path / "v1", {
        "model_cut": (cut("model_tp00.pt"), "model_tp00.pt: unreadable model shard, truncated"),
        "optim_cut": (cut("optim_tp00.pt"), "optim_tp00.pt: unreadable optimizer state, truncated"),
        "model_missing": (lambda p: (p / "model_tp00.pt").unlink(), "model_tp00.pt: missing model shard"),
        "wrong_tp": (meta(tensor_parallel=2), "meta.json: a format-1 checkpoint (per-TP files) saved with "
                     "TP=2, this trainer runs TP=1. Convert it: load it once at TP=2 and save"),
        "wrong_shape": (wrong_shape, "model_tp00.pt: does not fit this model"),
        "unsafe": (lambda p: torch.save({"state": Payload(tmp_path / "code-ran")}, p / "optim_tp00.pt"),
                   "optim_tp00.pt: unreadable optimizer state"),
    })


def test_dist_checkpoint_files_cut_short_foreign_or_unsafe_are_refused_naming_the_file(
    tiny_qwen2_dir, tiny_llama_dir, tmp_path
):
    import pickle

    a = local(tiny_qwen2_dir)
    train(a, 42)
    a.save(tmp_path / "good")
    llama = local(tiny_llama_dir)
    llama.save(tmp_path / "llama")  # before any step: the optimizer's initial state is saved
    dist = tmp_path / "good" / "dist"
    data = sorted(f.name for f in dist.glob("*.distcp"))
    assert data and {".metadata", "common.pt", "metadata.json"} <= {f.name for f in dist.iterdir()}

    def unsafe_index(p):  # the index's own pickle, with a payload beside it
        index = p / "dist" / ".metadata"
        index.write_bytes(pickle.dumps((Payload(tmp_path / "code-ran"), pickle.loads(index.read_bytes()))))

    def foreign_dist(p):
        shutil.rmtree(p / "dist")
        shutil.copytree(tmp_path / "llama" / "dist", p / "dist")

    b = local(tiny_qwen2_dir)
    refused(b, tmp_path, tmp_path / "good", {
        "data_cut": (cut(f"dist/{data[0]}"), f"dist/{data[0]}: cut short"),
        "data_missing": (lambda p: (p / "dist" / data[0]).unlink(), f"dist/{data[0]}: missing tensor file"),
        "index_cut": (cut("dist/.metadata"), "dist/.metadata: unreadable checkpoint index"),
        "index_missing": (lambda p: (p / "dist" / ".metadata").unlink(), "dist/.metadata: missing checkpoint index"),
        "unsafe_index": (unsafe_index, "dist/.metadata: unreadable checkpoint index"),
        "unsafe_common": (lambda p: torch.save({"x": Payload(tmp_path / "code-ran")}, p / "dist" / "common.pt"),
                          "dist/common.pt: unreadable common state"),
        "rng_cut": (cut("rng_rank0000.pt"), "rng_rank0000.pt: unreadable RNG state"),
        "no_dist": (lambda p: shutil.rmtree(p / "dist"), "dist: missing"),
        "other_model": (meta(arch={**a.arch.to_dict(), "num_layers": 3}), "meta.json: saved for a different architecture"),
        "foreign_dist": (foreign_dist, "dist: does not fit this model and optimizer"),
        "future_format": (meta(format_version=3), "meta.json: format_version 3; this rlkit reads 2 and 1"),
    })
    b.load(tmp_path / "good")
    assert b.step_count == 1
    c = local(tiny_llama_dir)
    c.load(tmp_path / "llama")  # saved before a step: loads, and the next step is a first step
    train(c, 43)
    train(llama, 43)
    wl, wc = llama.megatron_state(), c.megatron_state()
    assert all(torch.equal(wl[k], wc[k]) for k in wl)


def test_a_full_disk_while_saving_names_the_folder_and_leaves_no_partial_checkpoint(tiny_qwen2_dir, tmp_path):
    """A file-size limit on this process (EFBIG, as a full disk fails a write with ENOSPC;
    Python ignores SIGXFSZ): the save fails naming the temporary dist/ folder and the cause, and
    leaves neither it nor a meta.json; with room again the same folder saves and loads."""
    import resource

    from rlkit.train.megatron.checkpoint import CheckpointError

    a = local(tiny_qwen2_dir)
    train(a, 44)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(CheckpointError) as e:
            a.save(tmp_path / "c")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(e.value).startswith(f"{tmp_path / 'c' / '.dist.tmp'}: cannot write ("), str(e.value)
    assert "disk full" in str(e.value)  # torch.save loses the errno (EFBIG here, ENOSPC on a disk)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == []
    a.save(tmp_path / "c")
    b = local(tiny_qwen2_dir)
    b.load(tmp_path / "c")
    assert b.step_count == 1

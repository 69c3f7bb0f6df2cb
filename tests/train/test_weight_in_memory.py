"""Weights in memory (SGLang's /update_weights_from_tensor): the sender's bodies
(train/weight_sync/in_memory.py), opened by the engine side (rollout/engines/builtin/
tensor_receiver.py) in another process, give bit-identical tensors; loaded into a tiny model
with the built-in engine's loader they give the same engine weights as the gloo broadcast path;
handles that cannot be opened there are refused with a message that says why. SGLang's own
deserializer (its SafeUnpickler) opens a body in tests/conformance/test_sglang.py."""

from __future__ import annotations

import base64
import io
import json
import multiprocessing as mp
import os
import pickle
import pickletools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from rlkit.rollout.engines.builtin.tensor_receiver import (InMemoryHandleError, TensorUpdateError,
                                                           UpdateWeightsFromTensorRequest, tensors_from_request)
from rlkit.train.weight_sync.in_memory import (InMemoryError, push_in_memory, serialize_named_tensors,
                                               stage_bucket)
from rlkit.train.weight_sync.sender import bucketize
from rlkit.train.weight_sync.topology import EnginePlan

ROOT = Path(__file__).resolve().parents[2]


def odd_tensors() -> list[tuple[str, torch.Tensor]]:
    """Every dtype and layout a bucket may hold, with values whose bits matter (nan, -0.0, inf)."""
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 3.0])
    return [
        ("model.embed_tokens.weight", torch.randn(17, 8, generator=g)),
        ("specials", special),
        ("bf16.transposed", torch.randn(5, 3, generator=g).to(torch.bfloat16).t()),  # not contiguous
        ("fp16.slice", torch.randn(40, generator=g).to(torch.float16)[3:29:2]),  # a strided view
        ("int64", torch.arange(-3, 9)),
        ("bool", torch.tensor([True, False, True])),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("empty", torch.zeros(0, 4)),
        ("param", torch.nn.Parameter(torch.randn(3, 2, generator=g))),
    ]


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def my_shm_segments() -> set[str]:
    """This process's torch shared-memory segments (torch names them torch_<pid>_...)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


RECEIVER = """
import json, sys, torch
from rlkit.rollout.engines.builtin.tensor_receiver import tensors_from_request
body = json.load(sys.stdin)
out = {}
for rank in range(len(body["serialized_named_tensors"])):
    pairs = tensors_from_request(body["serialized_named_tensors"], tp_rank=rank)
    # mapped, not copied: every tensor lives in shared memory
    assert all(t.untyped_storage().is_shared() for _, t in pairs if t.numel()), "copied"
    out[rank] = [(n, t.clone()) for n, t in pairs]
del pairs
torch.save(out, sys.argv[1])
"""


def test_body_is_sglang_s_request_one_entry_per_tp_rank():
    staged = stage_bucket(odd_tensors(), "shared_memory")
    body = staged.body(tp_size=2, version=7)
    assert set(body) == {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                         "weight_version"}
    assert (body["weight_version"], body["flush_cache"], body["abort_all_requests"], body["load_format"]) == (
        "7", False, False, None)
    entries = body["serialized_named_tensors"]
    assert len(entries) == 2 and all(isinstance(e, str) for e in entries)
    assert base64.b64decode(entries[0])[:1] == b"\x80"  # a pickle, as SGLang's normaliser expects
    UpdateWeightsFromTensorRequest.model_validate(json.loads(json.dumps(body)))  # the engine's model
    staged.release()
    with pytest.raises(InMemoryError, match="released"):
        staged.body(tp_size=1, version=1)


def test_the_http_process_can_read_the_body_without_torch():
    """The built-in engine's HTTP process never imports torch; it validates the body and passes
    the entries to the core process, which opens them."""
    code = ("import sys; from rlkit.rollout.engines.builtin.tensor_receiver import "
            "UpdateWeightsFromTensorRequest; assert 'torch' not in sys.modules, 'torch imported'")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_another_process_maps_the_same_pages_and_reads_bit_identical_tensors(tmp_path):
    """A process that is no child of the sender (subprocess) opens every TP rank's entry."""
    sent = odd_tensors()
    before = my_shm_segments()
    staged = stage_bucket(sent, "shared_memory")
    assert len(my_shm_segments() - before) == 1  # one segment per bucket
    body = staged.body(tp_size=2, version=3)
    out = tmp_path / "got.pt"
    p = subprocess.run([sys.executable, "-c", RECEIVER, str(out)], input=json.dumps(body), text=True,
                       capture_output=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = torch.load(out)
    for rank in (0, 1):
        assert [n for n, _ in got[rank]] == [n for n, _ in sent]
        for (name, a), (_, b) in zip(sent, got[rank]):
            assert same_bits(a, b), name
    staged.release()
    del staged
    assert my_shm_segments() == before  # given back once both sides let go


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal in a process without CUDA")
def test_a_cuda_handle_in_a_process_without_cuda_is_refused_saying_why():
    from torch.multiprocessing import reductions

    class FakeCuda(pickle.Pickler):  # what a sender on a GPU writes, made without a GPU
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return reductions.rebuild_cuda_tensor, (torch.Tensor, (2,), (1,), 0, torch.storage.TypedStorage,
                                                        torch.float32, "GPU-0000", b"h", 8, 0, False, b"r", 0,
                                                        b"e", False)
            return NotImplemented

    buf = io.BytesIO()
    FakeCuda(buf, protocol=4).dump([("w", torch.zeros(2))])
    with pytest.raises(InMemoryHandleError, match="no CUDA device.*trainer rank's own device"):
        tensors_from_request([base64.b64encode(buf.getvalue()).decode()])


def test_a_segment_that_does_not_exist_here_is_refused_saying_why():
    """As on another node: the handle names a shared-memory segment this host does not have."""
    staged = stage_bucket([("w", torch.ones(4))], "shared_memory")
    raw = serialize_named_tensors(staged.named)
    name = next(a for _, a, _ in pickletools.genops(raw) if isinstance(a, bytes) and a.startswith(b"/torch_"))
    forged = raw.replace(name, b"/" + b"x" * (len(name) - 1))
    with pytest.raises(InMemoryHandleError, match="shared-memory segment.*trainer rank's own device"):
        tensors_from_request([base64.b64encode(forged).decode()])
    tensors_from_request([raw])  # the real one opens (and gives its reference back)
    staged.release()


def test_what_the_engine_side_refuses():
    from multiprocessing.reduction import ForkingPickler  # torch registered its reductions there

    good = stage_bucket([("w", torch.ones(2))], "shared_memory").body(tp_size=1, version=1)
    entries = good["serialized_named_tensors"]
    with pytest.raises(TensorUpdateError, match="one per TP rank; this is TP rank 1"):
        tensors_from_request(entries, tp_rank=1)
    with pytest.raises(TensorUpdateError, match="flattened_bucket' is not supported"):
        tensors_from_request(entries, load_format="flattened_bucket")
    with pytest.raises(TensorUpdateError, match="not base64"):
        tensors_from_request(["%%%"])
    evil = base64.b64encode(pickle.dumps([("w", os.getcwd)])).decode()  # a callable, not a tensor
    with pytest.raises(InMemoryHandleError, match="refused to unpickle posix.getcwd"):
        tensors_from_request([evil])
    by_fd = io.BytesIO()  # torch's default CPU sharing: a file descriptor, for children only
    ForkingPickler(by_fd).dump([("w", torch.ones(2).share_memory_())])
    if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
        with pytest.raises(InMemoryHandleError, match="file descriptor"):
            tensors_from_request([base64.b64encode(by_fd.getvalue()).decode()])
    with pytest.raises(InMemoryError, match="CUDA IPC needs CUDA tensors"):
        stage_bucket([("w", torch.ones(2))], "cuda_ipc")
    assert torch.equal(tensors_from_request(entries)[0][1], torch.ones(2))


def test_sglang_local_serialized_tensor_is_read_per_tp_rank(monkeypatch):
    """slime and verl send a TP engine one handle per rank inside each tensor
    (sglang's LocalSerializedTensor); rank r opens values[r]."""
    import dataclasses
    import types

    mod = types.ModuleType("sglang.srt.model_executor.model_runner_components.weight_updater")

    @dataclasses.dataclass
    class LocalSerializedTensor:
        values: list

    LocalSerializedTensor.__module__ = mod.__name__
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    mod.LocalSerializedTensor = LocalSerializedTensor
    parts = mod.__name__.split(".")
    for i in range(1, len(parts)):  # stub parents, for this test only, so pickle finds the class
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    per_rank = [torch.full((3,), float(r)) for r in range(2)]
    staged = [stage_bucket([("w", t)], "shared_memory") for t in per_rank]
    values = [_tensor_only_payload(s.named[0][1]) for s in staged]
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=4).dump([("w", LocalSerializedTensor(values=values))])
    entry = base64.b64encode(buf.getvalue()).decode()
    for r in range(2):
        (name, t), = tensors_from_request([entry, entry], tp_rank=r)
        assert name == "w" and torch.equal(t, per_rank[r])
    for s in staged:
        s.release()


def _tensor_only_payload(t: torch.Tensor) -> bytes:
    """One tensor pickled as a handle (not a list), as SGLang puts into LocalSerializedTensor."""
    from rlkit.train.weight_sync.in_memory import _HandlePickler

    buf = io.BytesIO()
    _HandlePickler(buf, protocol=4).dump(t)
    return buf.getvalue()


# -- the acceptance test: the same engine weights as the broadcast path ---------------------------
def _engine_main(conn) -> None:
    """A stand-in for the built-in engine core's weight updates, on a tiny model: joins the group
    and loads broadcast buckets, or opens in-memory bodies, with the engine's own functions."""
    from rlkit.rollout.engines.builtin.tensor_receiver import tensors_from_request
    from rlkit.rollout.engines.builtin.weight_receiver import (WeightGroup, create_group, load_into_model,
                                                               receive_bucket)
    from tests.train.helpers import make_hf_model
    import threading

    torch.set_num_threads(1)
    model = make_hf_model("qwen2", tie=True, seed=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    group = None
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "stop":
                conn.send(("ok", None))
                return
            if cmd == "init_group":
                addr, port, rank, world, name, backend = args
                group = WeightGroup(name, rank, world, backend,
                                    create_group(master_address=addr, master_port=port, rank=rank,
                                                 world_size=world, group_name=name, backend=backend,
                                                 timeout_s=300),
                                    threading.Lock())
                answer = None
            elif cmd == "bucket":
                names, dtypes, shapes = args
                load_into_model(model, receive_bucket(group, names, dtypes, shapes, torch.device("cpu")))
                answer = None
            elif cmd == "tensor":
                body = UpdateWeightsFromTensorRequest.model_validate(args[0])
                pairs = tensors_from_request(body.serialized_named_tensors, load_format=body.load_format)
                load_into_model(model, dict(pairs))
                del pairs
                answer = None
            elif cmd == "state":
                answer = {k: v.detach().clone() for k, v in model.state_dict().items()}
            elif cmd == "reset":
                load_into_model(model, {k: v for k, v in initial.items() if k != "lm_head.weight"})
                answer = None
            else:
                answer = None  # pause, flush, begin, end, continue, destroy: nothing to do here
            conn.send(("ok", answer))
        except Exception as e:  # noqa: BLE001 - sent back to the test
            conn.send(("error", f"{type(e).__name__}: {e}"))


class EngineStandIn:
    """EngineControl (both paths) for one _engine_main process."""

    url = "stand-in://0"

    def __init__(self, conn) -> None:
        self._conn = conn

    def ask(self, cmd, *args):
        self._conn.send((cmd, args))
        status, payload = self._conn.recv()
        if status != "ok":
            raise RuntimeError(payload)
        return payload

    def tp_size(self): return 1
    def pause(self, mode): self.ask("pause")
    def flush_cache(self): self.ask("flush")
    def continue_generation(self): self.ask("continue")
    def begin_update(self): self.ask("begin")
    def end_update(self): self.ask("end")
    def destroy_group(self, name): self.ask("destroy")
    def init_group(self, addr, port, rank_offset, world, name, backend):
        self.ask("init_group", addr, port, rank_offset, world, name, backend)
    def update_from_distributed(self, names, dtypes, shapes, group_name, version):
        self.ask("bucket", list(names), list(dtypes), [list(s) for s in shapes])
    def update_from_tensor(self, body):
        self.ask("tensor", json.loads(json.dumps(body)))  # as it travels: JSON


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_in_memory_update_gives_the_same_engine_weights_as_the_broadcast():
    from tests.train.helpers import make_hf_model
    from rlkit.common.weight_update import WeightUpdate
    from rlkit.train.weight_sync.sender import WeightSender

    new = make_hf_model("qwen2", tie=True, seed=5)
    sent = [(k, v.detach()) for k, v in new.state_dict().items() if k != "lm_head.weight"]  # tied
    bucket_bytes = 64 * 1024  # several buckets
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_engine_main, args=(child,), daemon=True)
    proc.start()
    engine = EngineStandIn(parent)
    try:
        initial = engine.ask("state")
        sender = WeightSender(bucket_mb=1, engine_factory=lambda url: engine)
        sender.bucket_bytes = bucket_bytes
        try:
            report = sender.sync_distributed(WeightUpdate(1, (engine.url,), "distributed"), iter(sent))
        finally:
            sender.close()
        by_broadcast = engine.ask("state")
        engine.ask("reset")
        assert all(same_bits(engine.ask("state")[k], v) for k, v in initial.items())
        before = my_shm_segments()
        plan = EnginePlan(0, "tensor", 1, memory="shared_memory")
        with ThreadPoolExecutor(2) as pool:
            def wait(futures, step):
                for _, f in futures:
                    f.result(timeout=300)

            stats = push_in_memory([(engine, plan)], bucketize(iter(sent), bucket_bytes), 1,
                                   submit=pool.submit, wait=wait)
        in_memory = engine.ask("state")
        assert my_shm_segments() == before  # every bucket's segment given back
    finally:
        try:
            engine.ask("stop")
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    assert stats.buckets == report.buckets > 2 and stats.tensors == report.tensors == len(sent)
    assert stats.bytes == report.bytes
    assert sorted(in_memory) == sorted(by_broadcast) == sorted(initial)
    for k in initial:
        assert same_bits(in_memory[k], by_broadcast[k]), k
        assert not same_bits(in_memory[k], initial[k]), k  # the update changed every tensor
    expected = dict(sent)
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]  # tied: one storage
    assert all(same_bits(in_memory[k], expected[k]) for k in in_memory)


# -- CUDA IPC (runs only where there is a GPU) ------------------------------------------------------
CUDA_RECEIVER = """
import json, sys, torch
from rlkit.rollout.engines.builtin.tensor_receiver import tensors_from_request
body = json.load(sys.stdin)
pairs = tensors_from_request(body["serialized_named_tensors"])
assert all(t.is_cuda for _, t in pairs)
torch.save([(n, t.cpu()) for n, t in pairs], sys.argv[1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_ipc_handles_name_the_gpu_by_uuid_and_open_in_another_process(tmp_path):
    sent = [(n, t.cuda()) for n, t in odd_tensors() if n != "param"]
    staged = stage_bucket(sent, "cuda_ipc")
    body = staged.body(tp_size=1, version=1)
    raw = base64.b64decode(body["serialized_named_tensors"][0])
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert uuid in {a for _, a, _ in pickletools.genops(raw) if isinstance(a, str)}
    out = tmp_path / "got.pt"
    p = subprocess.run([sys.executable, "-c", CUDA_RECEIVER, str(out)], input=json.dumps(body), text=True,
                       capture_output=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for (name, a), (_, b) in zip(sent, torch.load(out)):
        assert same_bits(a.cpu(), b), name
    staged.release()

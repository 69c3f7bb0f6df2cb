"""A weight update, both halves: the rollout side's hold on the engines (rollout/
engine_updates.py: pause, flush, sessions, sleep and wake) and the trainer's publish into it
(train/weight_sync/sender.py): call order, versions, buckets, disk folders, and the gloo
broadcast to a peer process that joins the group the way an engine does."""

from __future__ import annotations

from pathlib import Path

import subprocess

import pytest
import torch

from rlkit.common.engine_http import CONTROL_CALLS
from rlkit.rollout.engine_updates import EngineUpdates
from rlkit.train.weight_sync.sender import WeightSender, WeightSyncError, bucketize


def both(factory, method="disk", pause_mode="abort", **sender_kwargs):
    """The rollout side's EngineUpdates and the trainer's WeightSender over the same engines."""
    return (EngineUpdates(method=method, pause_mode=pause_mode, control=factory),
            WeightSender(engine_factory=factory, **sender_kwargs))


def disk(updates, sender, urls, folder, version, write=lambda p: p.mkdir(), **kwargs):
    return updates.run(urls, version, lambda u: sender.sync_from_disk(u, folder, write=write, **kwargs))


def distributed(updates, sender, urls, weights, version):
    return updates.run(urls, version, lambda u: sender.sync_distributed(u, weights))


class RecordingEngine:
    """An EngineControl that records calls (and optionally fails one)."""

    def __init__(self, url: str, log: list, fail_on: str | None = None, tp: int = 1,
                 gpus: tuple[str, ...] = ()) -> None:
        self.url, self.log, self.fail_on, self.tp, self.gpus = url, log, fail_on, tp, list(gpus)

    def _rec(self, *call):
        self.log.append((self.url, *call))
        if self.fail_on == call[0]:
            raise RuntimeError(f"{call[0]} refused")

    def tp_size(self): return self.tp
    def gpu_ids(self): return self.gpus
    def pause(self, mode): self._rec("pause", mode)
    def flush_cache(self): self._rec("flush")
    def continue_generation(self): self._rec("continue")
    def update_from_disk(self, path, version, *, flush_cache=True):
        self._rec("disk", path, version) if flush_cache else self._rec("disk", path, version, "no flush")
    def init_group(self, *a): self._rec("init_group", *a)
    def begin_update(self): self._rec("begin")
    def update_from_distributed(self, names, dtypes, shapes, group, version): self._rec("bucket", tuple(names), version)
    def end_update(self): self._rec("end")
    def destroy_group(self, name): self._rec("destroy", name)
    def update_from_tensor(self, body): self._rec("tensor", body.get("weight_version"))
    def release_memory(self, tags=None): self._rec("release", tags); return {}
    def resume_memory(self, tags=None): self._rec("resume", tags); return {}
    def load_lora_from_tensors(self, body): self._rec("load_lora", body["lora_name"])
    def load_lora(self, name, path): self._rec("load_lora", name)
    def unload_lora(self, name): self._rec("unload_lora", name)


def test_bucketize_respects_the_byte_budget():
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5])]  # fp32: 40, 40, 120, 20, 20 bytes
    buckets = [[n for n, _ in b] for b in bucketize(ts, 80)]
    assert buckets == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_disk_sync_order_version_and_folder(tmp_path):
    log: list = []
    updates, sender = both(lambda u: RecordingEngine(u, log))

    def write(p: Path):
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"x" * 1000)

    r1 = disk(updates, sender, ["http://a", "http://b"], tmp_path / "v000001", 1, write=write)
    steps = [(u, c[0]) for u, *c in log if u == "http://a"]
    assert [s for _, s in steps] == ["pause", "flush", "disk", "continue"]
    assert ("http://a", "pause", "abort") in log
    assert ("http://b", "disk", str((tmp_path / "v000001").resolve()), 1) in log
    assert (r1.version, r1.engines, r1.bytes) == (1, 2, 1000)
    disk(updates, sender, ["http://a"], tmp_path / "v000002", 2, write=write)
    assert not (tmp_path / "v000001").exists()  # the previous version's folder is removed
    assert (tmp_path / "v000002" / "model.safetensors").exists()


def test_a_failed_update_leaves_engines_paused_and_names_the_engine(tmp_path):
    log: list = []
    updates, sender = both(lambda u: RecordingEngine(u, log, fail_on="disk" if u == "http://b" else None))
    with pytest.raises(WeightSyncError, match=r"update_weights_from_disk failed on 1 engine\(s\): http://b"):
        disk(updates, sender, ["http://a", "http://b"], tmp_path / "v1", 1)
    assert not any(c[1] == "continue" for c in log)


def test_the_trainer_never_changes_an_engine_s_state(tmp_path):
    """One owner for the engines: every control call (pause, flush, continue, sessions, sleep,
    wake) comes from the rollout side; the trainer's publish makes only weight calls."""
    log: list = []
    updates, sender = both(lambda u: RecordingEngine(u, log))
    update = updates.open(["http://a"], 1)
    del log[:]
    sender.sync_from_disk(update, tmp_path / "v1", write=lambda p: p.mkdir())
    assert log and not [c for c in log if c[1] in ("pause", "flush", "continue", "begin", "end",
                                                    "release", "resume")]
    assert set(CONTROL_CALLS) == {"pause", "flush_cache", "continue_generation", "begin_update",
                                  "end_update", "release_memory", "resume_memory", "unload_lora"}


@pytest.mark.integration
def test_distributed_broadcast_reaches_every_engine_in_buckets():
    from rlkit.train.weight_sync.loopback import LoopbackEngines

    g = torch.Generator().manual_seed(0)
    weights = {f"w{i}": torch.randn(300, 500, generator=g) for i in range(5)}  # 600 kB each
    weights["b"] = torch.randn(7, generator=g).to(torch.bfloat16)
    with LoopbackEngines(2) as engines:
        updates, sender = both(engines.control, method="distributed", bucket_mb=1)
        try:
            r1 = distributed(updates, sender, engines.urls, weights.items(), 3)
            r2 = distributed(updates, sender, engines.urls, weights.items(), 4)  # reuses the group
        finally:
            sender.close()
        for url in engines.urls:
            got, log = engines.received(url)
            assert sorted(got) == sorted(weights)
            assert all(torch.equal(got[k], v) for k, v in weights.items())
        assert (r1.buckets, r1.tensors, r1.version) == (5, 6, 3)  # 600 kB tensors, 1 MiB buckets
        assert r1.bytes == sum(t.numel() * t.element_size() for t in weights.values())
        assert r2.seconds_stage == 0.0  # group formed once
        _, log = engines.received(engines.urls[1])
        assert log[3][0] == "init_group" and log[3][3:] == (2, 3, log[3][5], "gloo")  # rank 2 of 3
        calls = [c[0] for c in log]
        assert calls.count("init_group") == 1 and calls.count("pause") == 2
        # the rollout side opens (pause, flush, begin), then the trainer forms its group
        assert calls[:4] == ["pause", "flush", "begin", "init_group"]
        assert calls[-3:] == ["end", "continue", "destroy"]
        assert ("bucket", 1, 3) in log and ("bucket", 2, 4) in log  # every bucket carries its version


def test_an_unreachable_engine_fails_the_group_at_once_naming_it():
    import time

    from rlkit.common.engine_http import HttpEngine
    from rlkit.common.weight_update import WeightUpdate
    from rlkit.train.weight_sync.sender import WeightSender

    sender = WeightSender(timeout_s=120, engine_factory=lambda u: HttpEngine(u, timeout_s=5))
    t0 = time.perf_counter()
    # the first call of forming a group reads each engine's TP size
    with pytest.raises(WeightSyncError, match=r"server_info \(tp_size\) failed on 1 engine\(s\): http://127.0.0.1:9: .*refused"):
        sender.sync_distributed(WeightUpdate(1, ("http://127.0.0.1:9/",), "distributed"),
                                [("w", torch.zeros(3))])
    assert time.perf_counter() - t0 < 20  # not the 120 s rendezvous timeout
    sender.close()


class SGLangCacheRules(RecordingEngine):
    """An EngineControl that keeps SGLang 0.5.23's cache rule (srt/managers/scheduler.py
    `flush_cache`: refused unless the scheduler is idle; a paused engine's waiting queue is
    ignored): requests are running until a pause; `abort` ends them, `retract` moves them back
    to the waiting queue and frees their KV, `in_place` keeps them and their KV. A flush, or an
    update asked to flush, while any request holds KV fails, as SGLang's 400 does."""

    def __init__(self, url: str, log: list) -> None:
        super().__init__(url, log)
        self.holding_kv = True  # requests are in flight when the update begins

    def pause(self, mode):
        super().pause(mode)
        self.holding_kv = mode == "in_place"

    def _refuse_if_holding(self, what):
        if self.holding_kv:
            raise RuntimeError(f"{what}: cache not flushed, requests are still running")

    def flush_cache(self):
        self._refuse_if_holding("flush_cache")
        super().flush_cache()

    def update_from_disk(self, path, version, *, flush_cache=True):
        if flush_cache:
            self._refuse_if_holding("update_weights_from_disk")
        super().update_from_disk(path, version, flush_cache=flush_cache)


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_every_pause_mode_completes_a_sync_under_sglangs_cache_rule(tmp_path, mode):
    """in_place keeps the paused requests' KV, so it must neither flush nor ask the update to:
    a flush would be refused (400) and the sync would always fail."""
    log: list = []
    engines: dict = {}  # one per URL: both sides talk to the same engine
    updates, sender = both(lambda u: engines.setdefault(u, SGLangCacheRules(u, log)), pause_mode=mode)
    disk(updates, sender, ["http://a"], tmp_path / "v1", 1)
    steps = [c[0] for _, *c in log]
    if mode == "in_place":
        assert steps == ["pause", "disk", "continue"] and log[1][-1] == "no flush"
    else:
        assert steps == ["pause", "flush", "disk", "continue"]


def test_rank_offsets_follow_sglangs_tp_layout():
    from rlkit.train.weight_sync.topology import TopologyError, rank_offsets

    assert rank_offsets([1, 1]) == ([1, 2], 3)
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)  # engine i's TP rank r is offset_i + r
    with pytest.raises(TopologyError, match="tp_size 0"):
        rank_offsets([1, 0])


@pytest.mark.integration
def test_distributed_group_with_tensor_parallel_engines_in_place():
    """Engines of TP size 2 and 1 (every TP rank a process joining as rank_offset + tp_rank, as
    SGLang's do): the group forms with world 1 + 3, every rank receives every tensor, and an
    in_place sync never flushes."""
    from rlkit.train.weight_sync.loopback import LoopbackEngines

    weights = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    with LoopbackEngines(2, tp_sizes=[2, 1]) as engines:
        updates, sender = both(engines.control, method="distributed", pause_mode="in_place", bucket_mb=1)
        try:
            distributed(updates, sender, engines.urls, weights.items(), 1)
        finally:
            sender.close()
        for url, ranks in zip(engines.urls, (2, 1)):
            for r in range(ranks):
                got, log = engines.received(url, tp_rank=r)
                assert all(torch.equal(got[k], v) for k, v in weights.items())
                assert "flush" not in [c[0] for c in log]
        joins = [next(c for c in engines.received(u)[1] if c[0] == "init_group") for u in engines.urls]
        assert joins[0][3:5] == (1, 4) and joins[1][3:5] == (3, 4)  # (rank_offset, world_size)


def test_the_fakes_are_engine_controls():
    """The Protocols are the one list of calls of each side: every stand-in implements both."""
    from rlkit.common.engine_http import CONTROL_CALLS, WEIGHT_CALLS, HttpEngine
    from rlkit.train.weight_sync.loopback import LoopbackControl

    calls = set(CONTROL_CALLS) | set(WEIGHT_CALLS)
    for cls in (HttpEngine, LoopbackControl, RecordingEngine, SGLangCacheRules):
        assert calls <= set(dir(cls)), (cls.__name__, sorted(calls - set(dir(cls))))


@pytest.mark.integration
def test_a_sync_that_fails_closes_the_update_sessions_it_opened():
    """An engine dies at begin_weight_update: the engines where the update began get
    end_weight_update (and stay paused), so the sync the driver sends again to the engines left
    can begin; the same sender then updates them."""
    from rlkit.train.weight_sync.loopback import LoopbackEngines

    weights = {"w": torch.arange(6.0)}
    with LoopbackEngines(2) as engines:
        dead = engines.urls[1]

        class Dying:
            def __init__(self, url):
                self.inner = engines.control(url)

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def begin_update(self):
                if self.inner.url == dead:
                    raise RuntimeError("connection reset")
                self.inner.begin_update()

        updates, sender = both(Dying, method="distributed", bucket_mb=1)
        try:
            with pytest.raises(WeightSyncError, match="begin_weight_update failed on 1 engine"):
                distributed(updates, sender, engines.urls, weights.items(), 1)
            _, log = engines.received(engines.urls[0])
            assert [c[0] for c in log][-3:] == ["flush", "begin", "end"]  # closed, not continued
            distributed(updates, sender, engines.urls[:1], weights.items(), 1)  # the one left
        finally:
            sender.close()
        got, log = engines.received(engines.urls[0])
        calls = [c[0] for c in log]  # the group formed with the engine left
        assert torch.equal(got["w"], weights["w"]) and calls.count("init_group") == 1
        assert calls[-3:] == ["end", "continue", "destroy"]  # (the last: sender.close)


class SGLangMemoryRules(RecordingEngine):
    """An EngineControl that keeps SGLang 0.5.23's memory-occupation rules: a release needs the
    engine idle; resuming a tag that is not released fails (the scheduler asserts); a flush, or
    an update asked to flush, while the KV cache is released fails; generation resumes (continue)
    is not needed after a wake. `dies_on`: the call that finds this engine dead."""

    def __init__(self, url: str, log: list, dies_on: str | None = None) -> None:
        super().__init__(url, log, fail_on=dies_on)
        self.released: set[str] = set()

    def release_memory(self, tags=None):
        self._rec("release", tags)
        self.released |= set(tags or ("kv_cache", "weights", "cuda_graph"))
        return {"freed_bytes": {"kv_cache": 100, "weights": 10}}

    def resume_memory(self, tags=None):
        self._rec("resume", tuple(tags or ()))
        if not set(tags) <= self.released:
            raise RuntimeError(f"resume of {sorted(set(tags) - self.released)}: not released")
        self.released -= set(tags)
        return {}

    def flush_cache(self):
        assert "kv_cache" not in self.released, "flush while the KV cache is released"
        super().flush_cache()

    def update_from_disk(self, path, version, *, flush_cache=True):
        assert not (flush_cache and "kv_cache" in self.released), "flush while the KV cache is released"
        assert "weights" not in self.released, "update before the weights' memory is back"
        super().update_from_disk(path, version, flush_cache=flush_cache)


def test_a_sleeping_engine_wakes_in_stages_weights_update_then_kv(tmp_path):
    """verl's staged wake, so the GPU never holds two allocations: weights back, the update
    (no flush, no pause), the trainer's after_send, then the KV cache; an awake engine (one
    restarted since) is paused and continued as usual in the same update."""
    log: list = []
    engines = {u: SGLangMemoryRules(u, log) for u in ("http://a", "http://b")}
    updates, sender = both(lambda u: engines[u])
    report = updates.release(["http://a"])
    assert report["colocate/engine_freed_bytes"] == 110 and updates.sleeping == {"http://a": "asleep"}
    assert updates.release(["http://a"])["colocate/engines_slept"] == 0  # asleep already
    sent = []
    disk(updates, sender, ["http://a", "http://b"], tmp_path / "v1", 1, after_send=lambda: sent.append(len(log)))
    a = [c[0] if c[0] != "resume" else ("resume", c[1]) for u, *c in log if u == "http://a"]
    assert a == ["release", ("resume", ("weights",)), "disk", ("resume", ("kv_cache", "cuda_graph"))]
    assert [c[0] for u, *c in log if u == "http://b"] == ["pause", "flush", "disk", "continue"]
    assert log[sent[0] - 1][1] == "disk" and log[sent[0]][1] in ("resume", "continue")  # after the update
    assert updates.sleeping == {} and engines["http://a"].released == set()


def test_a_wake_that_fails_half_way_resumes_only_what_is_still_released(tmp_path):
    """b dies during the update: a's weights are already back. Sent again to the engines left,
    the wake must not resume a's weights a second time (SGLang fails that)."""
    log: list = []
    engines = {"http://a": SGLangMemoryRules("http://a", log),
               "http://b": SGLangMemoryRules("http://b", log, dies_on="disk")}
    updates, sender = both(lambda u: engines[u])
    updates.release(list(engines))
    with pytest.raises(WeightSyncError, match="http://b"):
        disk(updates, sender, list(engines), tmp_path / "v1", 1)
    assert updates.sleeping == {"http://a": "weights", "http://b": "weights"}
    updates.forget(["http://b"])  # the dead one: its restart comes back awake
    del log[:]
    disk(updates, sender, ["http://a"], tmp_path / "v1", 1)
    assert [(c[0], *c[1:2]) for _, *c in log if c[0] == "resume"] == [("resume", ("kv_cache", "cuda_graph"))]
    assert updates.sleeping == {}


def test_an_nccl_group_that_would_put_two_ranks_on_one_gpu_is_named_before_it_is_formed():
    """The failure of a disaggregated run on one GPU ("Duplicate GPU detected : rank 0 and rank
    1 both on CUDA device"): GPUs are compared by the UUIDs the engines report in /server_info;
    an engine on the trainer's GPU, or on another engine's, is named (the trainer then syncs by
    disk); engines that report none (SGLang) are counted apart and named as unchecked."""
    log: list = []
    engines = {"a": RecordingEngine("a", log, gpus=("GPU-1",)), "b": RecordingEngine("b", log, gpus=("GPU-1",)),
               "c": RecordingEngine("c", log, gpus=("GPU-0",)), "d": RecordingEngine("d", log)}
    sender = WeightSender(engine_factory=lambda u: engines[u])
    check = sender.nccl_conflict(["a", "d"], "GPU-0")
    assert check.clash is None and check.unchecked == ("d",)
    check = sender.nccl_conflict(["a", "b", "c", "d"], "GPU-0")
    clash = check.clash
    assert check.unchecked == ("d",)
    assert clash.startswith("b (its GPU(s) ['node/GPU-1'] already have a rank") and "c (" in clash
    assert "a (" not in clash and "d (" not in clash


def test_the_trainer_says_once_which_engines_it_cannot_check_for_a_shared_gpu(monkeypatch):
    """SGLang engines report no GPU: the sending rank cannot rule out a shared one, so it syncs
    by NCCL as asked and says so once, naming them (before, it assumed they were apart)."""
    import warnings
    from types import SimpleNamespace

    from rlkit.train.megatron.trainer import MegatronTrainer

    monkeypatch.setattr("rlkit.train.weight_sync.in_memory.gpu_uuid", lambda index: "GPU-0")
    log: list = []
    engines = {"hf": RecordingEngine("hf", log, gpus=("GPU-1",)), "sg": RecordingEngine("sg", log),
               "on-mine": RecordingEngine("on-mine", log, gpus=("GPU-0",))}
    sender = WeightSender(engine_factory=lambda u: engines[u])
    rank = SimpleNamespace(device=torch.device("cuda", 0), _nccl_check={}, _nccl_unchecked=set(),
                           _warned_nccl=False)
    with pytest.warns(UserWarning, match=r"cannot check that sg share no GPU.*method: disk"):
        assert MegatronTrainer._nccl_safe(rank, sender, ["hf", "sg"]) == "distributed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: not again, for this set or another
        assert MegatronTrainer._nccl_safe(rank, sender, ["hf", "sg"]) == "distributed"
        assert MegatronTrainer._nccl_safe(rank, sender, ["sg"]) == "distributed"
    with pytest.warns(UserWarning, match="by disk instead of the NCCL broadcast: on-mine"):
        assert MegatronTrainer._nccl_safe(rank, sender, ["sg", "on-mine"]) == "disk"


def test_the_group_meets_where_the_engines_reach_the_trainer():
    """Engines on loopback meet the trainer's store on 127.0.0.1 (no other machine reaches it);
    engines elsewhere, at this node's address toward them (before, always 127.0.0.1: an engine
    on another node could never join)."""
    from rlkit.train.weight_sync.sender import address_toward

    assert address_toward(["http://127.0.0.1:3000", "http://localhost:3001"]) == "127.0.0.1"
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    own = [a for a in own if ":" not in a and not a.startswith("127.")]
    if own:  # an engine at this machine's own address is reached from that address
        assert address_toward(["http://127.0.0.1:3000", f"http://{own[0]}:3001"]) == own[0]

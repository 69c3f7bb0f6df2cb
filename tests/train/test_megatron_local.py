"""The megatron backend in this process (TP=1, DP=1, gloo world of one): parity with transformers,
streamed accumulation, optimisation, reference policy, checkpoints, export."""

from __future__ import annotations

import random

import pytest
import torch

from tests.train.helpers import hf_response_logprobs, random_batch
from rlkit.train.config import TrainConfig

pytestmark = pytest.mark.integration

PARITY_ATOL = 1e-4  # fp32; measured max abs diff is ~5e-7


def make_trainer(model_dir, **overrides):
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({"device": "cpu", "micro_batch_size": 4, **overrides})
    return MegatronTrainer.single_process(model_dir, cfg)


@pytest.fixture(scope="module")
def hf_qwen2(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()


def max_parity_diff(trainer, hf_model, batch, temperature=1.0):
    ours = trainer.logprobs(batch)
    return max(
        float((hf_response_logprobs(hf_model, s.tokens, s.prompt_length, temperature) - lp).abs().max())
        for s, lp in zip(batch.samples, ours)
    )


@pytest.mark.parametrize("packing", [{"pack_row_tokens": 2048}, {}, {"packing": False}],
                         ids=["packed-2048", "packed-longest", "padded"])
def test_parity_qwen2_tied(tiny_qwen2_dir, hf_qwen2, packing):
    trainer = make_trainer(tiny_qwen2_dir, **packing)
    assert max_parity_diff(trainer, hf_qwen2, random_batch(9, seed=1)) < PARITY_ATOL


def test_parity_llama_untied_and_temperature(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlkit.train.megatron.trainer import MegatronTrainer

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    cfg = TrainConfig(device="cpu", micro_batch_size=3)
    for temperature in (1.0, 0.7):
        trainer = MegatronTrainer.single_process(tiny_llama_dir, cfg, temperature=temperature)
        assert max_parity_diff(trainer, hf, random_batch(7, seed=2), temperature) < PARITY_ATOL


@pytest.mark.parametrize("model", ["qwen2-tied", "llama-untied-t0.7"])
def test_shared_prompts_give_the_unshared_logprobs(tiny_qwen2_dir, tiny_llama_dir, model):
    """Groups of 3 share a prompt, held once per row (train/packing.py): every response token's
    logprob still matches transformers run on that sample alone."""
    from transformers import AutoModelForCausalLM

    from rlkit.train.megatron.trainer import MegatronTrainer

    path, temperature = (tiny_qwen2_dir, 1.0) if model == "qwen2-tied" else (tiny_llama_dir, 0.7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    trainer = MegatronTrainer.single_process(path, TrainConfig(device="cpu", micro_batch_size=6),
                                             temperature=temperature)
    batch = random_batch(11, seed=5, group_size=3)
    assert trainer._pack(batch.samples[:6]).shared > 0
    assert max_parity_diff(trainer, hf, batch, temperature) < PARITY_ATOL


def test_shared_prompts_train_as_the_unshared_step(tiny_qwen2_dir):
    """The step's gradient on groups sharing their prompt is the gradient with every sample's
    prompt in its own row (float summation order aside)."""
    batch = random_batch(12, seed=7, group_size=4)
    grads, stats = [], []
    for share in (True, False):
        trainer = make_trainer(tiny_qwen2_dir, share_prompts=share, micro_batch_size=8)
        stats.append(trainer.accumulate(batch))
        grads.append(trainer.finalize_grads_for_test())
        if share:  # two groups of 4 per micro-batch: each prompt held once, not 4 times
            packed = trainer._pack(batch.samples[:8])
            assert packed.shared == 3 * sum(s.prompt_length for s in batch.samples[:8:4])
    assert stats[0]["denominator"] == stats[1]["denominator"] and stats[0]["samples"] == 12
    for name, g in grads[0].items():
        assert g.abs().max() > 0, name
        assert torch.allclose(g, grads[1][name], atol=1e-7, rtol=1e-4), name


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_streamed_accumulation_equals_one_synchronous_batch(tiny_qwen2_dir, aggregation):
    algo = {"loss_aggregation": aggregation, "off_policy_correction": "tis", "entropy_coef": 0.01}
    trainer = make_trainer(tiny_qwen2_dir, algorithm=algo, pack_row_tokens=24)
    batch = random_batch(12, seed=3)
    batch = batch.with_logprobs(old=[lp - 0.05 for lp in trainer.logprobs(batch)])

    trainer.accumulate(batch)
    sync_grads = trainer.finalize_grads_for_test()
    trainer.discard_gradients()

    order = list(range(len(batch)))
    random.Random(0).shuffle(order)
    arrivals = [order[:1], order[1:4], order[4:9], order[9:]]  # groups arriving in any grouping
    for part in arrivals:
        trainer.accumulate(batch.subset(part))
    stream_grads = trainer.finalize_grads_for_test()
    trainer.discard_gradients()

    scale = max(float(g.abs().max()) for g in sync_grads.values())
    for name, g in sync_grads.items():
        assert torch.allclose(stream_grads[name], g, rtol=1e-5, atol=1e-6 * scale), name


def test_stream_and_sync_steps_give_the_same_weights(tiny_qwen2_dir):
    cfg = {"optimizer": {"lr": 1e-3}, "micro_batch_size": 5}
    a, b = make_trainer(tiny_qwen2_dir, **cfg), make_trainer(tiny_qwen2_dir, **cfg)
    batch = random_batch(10, seed=4)
    a.accumulate(batch)
    ma = a.step()
    for part in ([7, 2], [0, 1, 3, 9], [4, 5, 6, 8]):
        b.accumulate(batch.subset(part))
    mb = b.step()
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], rel=1e-5)
    assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-5)
    # Adam's first step is ~lr * sign(g): entries whose gradient is float noise (~1e-10) can move
    # differently, so weights agree to a fraction of lr, not bit for bit (measured 3e-6 = 0.003 lr).
    wa, wb = a.megatron_state(), b.megatron_state()
    for name in wa:
        assert float((wa[name] - wb[name]).abs().max()) <= 1e-2 * 1e-3, name


def test_steps_raise_the_logprob_of_advantaged_samples(tiny_qwen2_dir):
    trainer = make_trainer(tiny_qwen2_dir, optimizer={"lr": 3e-3, "grad_clip": 0.0}, algorithm={"kl_coef": 0.1})
    batch = random_batch(4, seed=5, advantages=[1.0, -1.0, 1.0, -1.0])
    before = trainer.logprobs(batch)
    for _ in range(3):
        batch_k = batch.with_logprobs(ref=trainer.logprobs(batch, policy="reference"))
        trainer.accumulate(batch_k)
        metrics = trainer.step()
    after = trainer.logprobs(batch)
    delta = [float((a - b).mean()) for a, b in zip(after, before)]
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
    assert trainer.step_count == 3 and metrics["train/step_applied"] == 1.0
    assert metrics["train/kl"] > 0
    # the reference policy is still the initial model
    ref = trainer.logprobs(batch, policy="reference")
    assert all(torch.allclose(r, b, atol=1e-6) for r, b in zip(ref, before))


def test_empty_accumulation_does_not_step(tiny_qwen2_dir):
    trainer = make_trainer(tiny_qwen2_dir)
    before = trainer.megatron_state()["decoder.final_layernorm.weight"].clone()
    metrics = trainer.step()
    assert metrics["train/step_applied"] == 0.0 and trainer.step_count == 0
    assert torch.equal(trainer.megatron_state()["decoder.final_layernorm.weight"], before)


def test_checkpoint_resume_continues_identically(tiny_qwen2_dir, tmp_path):
    cfg = {"optimizer": {"lr": 1e-3, "warmup_steps": 3}}
    first, second = random_batch(6, seed=6), random_batch(6, seed=7)
    a = make_trainer(tiny_qwen2_dir, **cfg)
    a.accumulate(first)
    a.step()
    a.version = 5
    a.save(tmp_path / "ckpt")
    rng_after_save = torch.rand(3)
    a.accumulate(second)
    ma = a.step()

    b = make_trainer(tiny_qwen2_dir, **cfg)
    b.load(tmp_path / "ckpt")
    assert (b.step_count, b.version) == (1, 5)
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG restored
    b.accumulate(second)
    mb = b.step()
    assert ma["train/lr"] == mb["train/lr"]  # warm-up position restored with the step
    wa, wb = a.megatron_state(), b.megatron_state()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name  # optimizer moments restored exactly


def test_checkpoint_refuses_pending_gradients_and_other_models(tiny_qwen2_dir, tiny_llama_dir, tmp_path):
    from rlkit.train.megatron.checkpoint import CheckpointError

    a = make_trainer(tiny_qwen2_dir)
    a.accumulate(random_batch(2, seed=8))
    with pytest.raises(CheckpointError, match="step first"):
        a.save(tmp_path / "c")
    a.step()
    a.save(tmp_path / "c")
    with pytest.raises(CheckpointError, match="different architecture"):
        make_trainer(tiny_llama_dir).load(tmp_path / "c")
    with pytest.raises(CheckpointError, match="no meta.json"):
        a.load(tmp_path / "nothing")


def test_export_writes_a_folder_transformers_loads(tiny_qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer(tiny_qwen2_dir, optimizer={"lr": 1e-2})
    batch = random_batch(5, seed=9)
    trainer.accumulate(batch)
    trainer.step()
    out = trainer.export_hf(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert max_parity_diff(trainer, hf, batch) < PARITY_ATOL


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_publish_weights_sends_the_trained_weights_with_a_new_version(tiny_qwen2_dir, tmp_path, method):
    from rlkit.common.weight_update import WeightUpdate
    from rlkit.rollout.engine_updates import EngineUpdates
    from rlkit.train.weight_sync.loopback import LoopbackEngines
    from rlkit.train.weight_sync.sender import WeightSender

    trainer = make_trainer(tiny_qwen2_dir, optimizer={"lr": 1e-2}, weight_sync={"bucket_mb": 1})
    trainer.accumulate(random_batch(4, seed=10))
    trainer.step()
    expected = dict(trainer.iter_hf_weights())
    with LoopbackEngines(1) as engines:
        trainer.attach_sender(WeightSender(bucket_mb=1, engine_factory=engines.control))
        updates = EngineUpdates(method=method, folder=str(tmp_path), control=engines.control)
        try:
            report = updates.run(engines.urls, 1, trainer.publish_weights)
            report2 = updates.run(engines.urls, 2, trainer.publish_weights)
        finally:
            trainer.close()
        got, log = engines.received(engines.urls[0])
    assert trainer.version == 2
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert report["sync/bytes"] >= sum(t.numel() * 4 for t in expected.values()) and report2["sync/bytes"] > 0
    # the rollout side opens (pause, flush, a session for a broadcast); the trainer publishes
    assert [c[0] for c in log][:4] == (["pause", "flush", "begin", "init_group"] if method == "distributed"
                                       else ["pause", "flush", "disk", "continue"])
    with pytest.raises(ValueError, match="is older"):
        trainer.publish_weights(WeightUpdate(1, ("http://x",), method))
    # every engine lost (rollout.health): nothing is sent, but the weights are version 3 and a
    # checkpoint written now must say so (it said 2 while the run's state said 3)
    assert "sync/bytes" not in trainer.publish_weights(WeightUpdate(3, (), method, str(tmp_path)))
    assert trainer.version == 3


def weights(trainer):
    return {k: v.clone() for k, v in trainer.iter_hf_weights()}


@pytest.mark.parametrize("order", [(0, 1, 2, 3, 4), (3, 0, 4, 1, 2), (4, 3, 2, 1, 0)])
def test_a_batch_streamed_in_any_order_trains_as_the_synchronous_step(tiny_qwen2_dir, order):
    """Stream mode's path (groups one by one, in arrival order) against the plain synchronous
    computation on the whole batch: the same metrics, gradients and weights."""
    from tests.train.helpers import random_groups
    from rlkit.buffers.sample import TRACE_KEY, TRACED_LOGPROBS
    from rlkit.train.batch import TrainBatch, build_batch_from_config
    from rlkit.train.stream import RolloutBatchStep

    algo = {"advantage": "grpo", "kl_coef": 0.05, "off_policy_correction": "tis"}
    a, b = make_trainer(tiny_qwen2_dir, algorithm=algo), make_trainer(tiny_qwen2_dir, algorithm=algo)
    groups = random_groups(5, 3, seed=21)
    picked = groups[order[0]].samples[1]  # saved for the viewer: the trainer scores it too
    picked.metadata[TRACE_KEY] = True

    batch = build_batch_from_config(groups, a.config.algorithm, policy_version=0)
    [traced] = [s for s in batch.samples if s.traced]
    before = a.logprobs(TrainBatch([traced], 0))[0]  # the weights the batch trains from
    batch = batch.with_logprobs(ref=a.logprobs(batch, policy="reference"))
    a.accumulate(batch)
    sync = a.step()

    stream = RolloutBatchStep(b, b.config.algorithm, policy_version=0, rollout_samples=15,
                              global_batch_size=0, micro_batch_size=4)
    for i in order:
        stream.add(groups[i])
    assert b.pending_samples == 12  # full micro-batches trained while the groups arrived
    streamed = stream.finish()
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/is_weight", "train/samples"):
        assert streamed[key] == pytest.approx(sync[key], rel=1e-5), key
    [(key, lp)] = streamed[TRACED_LOGPROBS].items()
    assert key == f"{picked.group_id}/{picked.index}"
    assert lp == pytest.approx(before.tolist(), abs=1e-4)
    wa, wb = weights(a), weights(b)
    assert all(float((wa[k] - wb[k]).abs().max()) <= 1e-6 for k in wa)
    with pytest.raises(RuntimeError, match="add after finish"):
        stream.add(groups[0])


@pytest.mark.parametrize("micro", [{"micro_batch_size": 3}, {"max_tokens_per_micro_batch": 24}],
                         ids=["by-count", "by-tokens"])
def test_several_optimizer_steps_per_rollout_batch_use_pi_old_from_before_the_first(tiny_qwen2_dir, micro):
    """global_batch_size < the rollout batch: pi_old is computed for every sample before the
    first optimizer step (the weights that generated the batch), then one step per global batch
    in arrival order; the reference computation is written out here. By tokens, the stream's
    micro-batches (arrival order, then first-fit decreasing) differ from the reference's."""
    from tests.train.helpers import random_groups
    from rlkit.train.batch import build_batch_from_config
    from rlkit.train.stream import RolloutBatchStep, logprobs_needed

    algo = {"advantage": "grpo", "off_policy_correction": "tis"}
    cfg = {"algorithm": algo, "global_batch_size": 6, **micro}
    a, b = make_trainer(tiny_qwen2_dir, **cfg), make_trainer(tiny_qwen2_dir, **cfg)
    assert logprobs_needed(a.config.algorithm, 2) == (True, False)
    groups = random_groups(4, 3, seed=22)  # 12 samples: two optimizer steps of 6

    batch = build_batch_from_config(groups, a.config.algorithm, policy_version=0)
    old = a.logprobs(batch)
    batch = batch.with_logprobs(old=old)
    ref_metrics = []
    for part in batch.micro_batches(6):
        a.accumulate(part)
        ref_metrics.append(a.step())

    stream = RolloutBatchStep.for_config(b, b.config, policy_version=0, rollout_samples=12)
    for g in groups:
        stream.add(g)
    assert b.step_count == 0  # no step before every sample has its pi_old
    m = stream.finish()
    assert b.step_count == 2 and m["train/optimizer_steps"] == 2.0
    assert m["train/loss"] == pytest.approx(ref_metrics[-1]["train/loss"], rel=1e-5)
    wa, wb = weights(a), weights(b)
    assert all(float((wa[k] - wb[k]).abs().max()) <= 1e-6 for k in wa)


def test_rlkit_export_turns_a_run_checkpoint_into_an_hf_folder(tiny_qwen2_dir, tmp_path):
    from rlkit.cli import main
    from rlkit.train.hf_io import load_hf_state_dict, read_config

    trainer = make_trainer(tiny_qwen2_dir, optimizer={"lr": 1e-2})
    trainer.accumulate(random_batch(3, seed=22))
    trainer.step()
    trainer.save(tmp_path / "checkpoints" / "step_000001" / "trainer")
    assert main(["export", str(tmp_path / "checkpoints" / "step_000001"), str(tmp_path / "out")]) == 0
    exported = load_hf_state_dict(tmp_path / "out")
    expected = dict(trainer.iter_hf_weights())
    assert sorted(exported) == sorted(expected)
    assert all(torch.equal(exported[k], v) for k, v in expected.items())
    assert read_config(tmp_path / "out")["tie_word_embeddings"] is True
    assert main(["export", str(tmp_path / "checkpoints" / "step_000001"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert load_hf_state_dict(tmp_path / "bf16")["model.norm.weight"].dtype == torch.bfloat16


def test_a_full_disk_while_saving_names_the_file_and_keeps_the_old_one(tmp_path):
    from tests.faults import run_with_file_size_limit

    file = tmp_path / "model_tp00.pt"
    torch.save({"w": torch.ones(4)}, file)
    done = run_with_file_size_limit(f"""
        import torch
        from pathlib import Path
        from rlkit.train.megatron.checkpoint import CheckpointError, _save
        try:
            _save({{"w": torch.zeros(1 << 20)}}, Path({str(file)!r}))
        except CheckpointError as e:
            print(e)
        else:
            raise SystemExit("saved")
    """, limit=64 * 1024)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"{file}: cannot write ("), done.stdout
    assert torch.equal(torch.load(file, weights_only=True)["w"], torch.ones(4))
    assert [p.name for p in tmp_path.iterdir()] == [file.name]  # no temporary file left


# A long-tail mix of response lengths (prompts 2-8 tokens): short samples and a few long ones.
TAIL = [3, 150, 8, 12, 1, 40, 5, 90, 7, 2, 25, 6]


def test_token_budget_micro_batches_train_as_the_count_split(tiny_qwen2_dir):
    """The same batch by count and by token budget (samples past the budget alone and warned
    about; a budget holding the whole batch): the same gradient sums and denominator, loss,
    gradient norm and weights after an Adam step, within fp32 tolerance."""
    import warnings

    from rlkit.train.microbatch_plan import plan_micro_batches

    lr = 1e-3
    cfg = {"optimizer": {"lr": lr}, "algorithm": {"off_policy_correction": "tis", "entropy_coef": 0.01}}
    batch = random_batch(len(TAIL), seed=40, response_lengths=TAIL)
    lengths = [s.length for s in batch.samples]
    ref = make_trainer(tiny_qwen2_dir, micro_batch_size=4, **cfg)
    ref.accumulate(batch)
    ref_grads, ref_denominator = ref.main_grads(), ref._denominator
    ref_metrics, ref_weights = ref.step(), ref.megatron_state()
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for budget in (40, 120, 4096):
        t = make_trainer(tiny_qwen2_dir, max_tokens_per_micro_batch=budget, **cfg)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stats = t.accumulate(batch)
        warned = sorted(int(str(w.message).split()[3]) for w in caught if "longer than" in str(w.message))
        assert warned == sorted(n for n in lengths if n > budget), budget
        assert stats["micro_batches"] == len(plan_micro_batches(lengths, max_tokens=budget).replicas[0])
        assert t._denominator == ref_denominator
        for name, g in t.main_grads().items():
            assert torch.allclose(g, ref_grads[name], rtol=1e-5, atol=1e-6 * scale), (budget, name)
        m = t.step()
        for key in ("train/loss", "train/grad_norm", "train/entropy", "train/is_weight"):
            assert m[key] == pytest.approx(ref_metrics[key], rel=1e-5), (budget, key)
        for key in ("train/loss_denominator", "train/samples", "train/tokens"):
            assert m[key] == ref_metrics[key], (budget, key)
        # Adam's first step is lr g / (|g| + eps): where |g| is below eps (a few layer-norm
        # entries here) float noise in g moves the weight by up to lr |dg| / eps, so weights
        # agree to a fraction of lr (measured 1.2e-2 lr, one entry of 64), not bit for bit
        w = t.megatron_state()
        assert all(float((w[k] - ref_weights[k]).abs().max()) <= 3e-2 * lr for k in w), budget
    assert stats["micro_batches"] == 1.0  # the last budget holds the whole batch


def test_empty_micro_batches_add_exactly_nothing(tiny_qwen2_dir):
    """Padding (so DP replicas run as many micro-batches): a zero-weight pass whose gradient
    contribution is exactly 0, counted apart from samples and tokens."""
    trainer = make_trainer(tiny_qwen2_dir)
    batch = random_batch(3, seed=41)  # one micro-batch of 3 by count
    trainer.accumulate(batch)
    plain = trainer.main_grads()
    trainer.discard_gradients()
    padded = batch.subset(range(3))
    padded.micro_batch_plan = [(), (0, 1, 2), ()]
    assert trainer.accumulate(padded)["micro_batches"] == 3
    assert all(torch.equal(g, plain[k]) for k, g in trainer.main_grads().items())
    m = trainer.step()
    assert (m["train/micro_batches"], m["train/empty_micro_batches"], m["train/samples"]) == (3, 2, 3)
    assert trainer.logprobs(padded)[2].shape == (batch.samples[2].response_length,)


class _Replica:
    """One DP replica's view of a shared single-process trainer (tests): the gradient buffer
    sums what every replica accumulates, as the DP all-reduce would; only one replica steps."""

    def __init__(self, trainer, steps: bool):
        self.trainer, self.steps, self.micro_batches = trainer, steps, 0
        self.attention_weight = trainer.attention_weight

    def logprobs(self, batch, policy="current"):
        return self.trainer.logprobs(batch, policy=policy)

    def accumulate(self, batch):
        stats = self.trainer.accumulate(batch)
        self.micro_batches += int(stats["micro_batches"])
        return stats

    def step(self):
        return self.trainer.step() if self.steps else {}


def test_stream_by_token_budget_over_two_replicas_trains_as_the_synchronous_count_step(tiny_qwen2_dir):
    """Stream mode, DP=2, a token budget: groups in arrival order, samples to the least-loaded
    replica by cost, micro-batches closed as they fill, the lighter replica padded with empty
    ones; the step equals one process's synchronous step by count."""
    from tests.train.helpers import random_groups
    from rlkit.train.batch import build_batch_from_config
    from rlkit.train.stream import RolloutBatchStep

    algo = {"advantage": "grpo", "off_policy_correction": "tis"}
    lengths = [2, 60, 3, 9, 1, 4, 30, 5, 2, 3, 1, 2, 80, 6, 7]
    groups = random_groups(5, 3, seed=42, response_lengths=lengths)
    a = make_trainer(tiny_qwen2_dir, algorithm=algo)
    a.accumulate(build_batch_from_config(groups, a.config.algorithm, policy_version=0))
    sync = a.step()

    b = make_trainer(tiny_qwen2_dir, algorithm=algo, max_tokens_per_micro_batch=32)
    replicas = [_Replica(b, steps=(r == 0)) for r in range(2)]
    streams = [RolloutBatchStep.for_config(rep, b.config, policy_version=0, rollout_samples=15,
                                           dp_rank=r, dp_size=2) for r, rep in enumerate(replicas)]
    with pytest.warns(UserWarning, match="longer than") as caught:
        for i in (3, 0, 4, 1, 2):
            for s in streams:
                s.add(groups[i])
        streams[1].finish()
        streamed = streams[0].finish()
    # each over-long sample warned about once, by its replica (prompts add to the lengths)
    over = [str(w.message) for w in caught if "longer than" in str(w.message)]
    assert sorted(int(m.split()[3]) for m in over) == [62, 85]
    assert replicas[0].micro_batches == replicas[1].micro_batches
    assert streamed["train/empty_micro_batches"] > 0
    for key in ("train/loss", "train/grad_norm", "train/is_weight"):
        assert streamed[key] == pytest.approx(sync[key], rel=1e-5), key
    assert (streamed["train/samples"], streamed["train/loss_denominator"]) == (sync["train/samples"], sync["train/loss_denominator"])
    wa, wb = weights(a), weights(b)
    assert all(float((wa[k] - wb[k]).abs().max()) <= 1e-6 for k in wa)

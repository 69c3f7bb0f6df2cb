"""Loss mask 0 through the real trainer: an episode's environment observations
(`Sample.append(..., trainable=False)`) add nothing to the loss, its KL, TIS and entropy terms, its
normaliser, its gradient or the step, with the MegatronTrainer's own batch -> packed tensors ->
forward -> loss -> backward -> optimizer step (tests/train/test_losses.py checks the loss alone).

Changing a masked token's *id* would change later tokens' logits through attention, so the test
changes what a token feeds into the loss directly: its pi_old, rollout (TIS) and reference (KL)
logprobs, set to wild finite values at every mask-0 position, then to NaN and +-inf (the loss
masks by selection, so neither can reach it). Advantages are per sample, not per token. The
converse, each of the three changed at one mask-1 token, must move the gradient: the trainer does
read them, so the invariance above is not vacuous. And how many mask-0 tokens there
are must not enter the normalisation (token_mean's token count, sequence_mean's per-sample length):
mask-0 tokens appended after a response's last trainable token (an episode cut short by its
budget after an observation) leave every earlier logit as it was (causal attention), so the
gradient must stay the same up to float summation order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.train.test_megatron_local import make_trainer

pytestmark = pytest.mark.integration

# Finite whatever the token's logprob (about -12..0 here): exp(lp - old) <= exp(70) and the k3
# terms stay in fp32 range, so they also move the loss when put at a mask-1 token (the converse).
WILD = {"old_logprobs": (25.0, -70.0), "rollout_logprobs": (-80.0, 30.0), "ref_logprobs": (35.0, -75.0)}
# At mask-0 positions only: a product with the mask would make these NaN; selection drops them.
NONFINITE = {"old_logprobs": (float("nan"), float("inf")), "rollout_logprobs": (float("-inf"), float("nan")),
             "ref_logprobs": (float("inf"), float("-inf"))}

CONFIGS = {
    "ppo-token_mean": {"kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01},
    "gspo-sequence_mean": {"ratio_level": "sequence", "kl_coef": 0.1, "kl_estimator": "low_var"},
}


def episode_groups(seed: int = 0):
    """Two groups of three episodes: model turn, observation (mask 0), model turn(s); one episode
    opens with the environment's words, one has two observations."""
    from rlkit.buffers.group import Group, PromptRecord

    g = torch.Generator().manual_seed(seed)

    def ids(lo, hi):
        return torch.randint(0, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    def model_turn(s, **kw):
        t = ids(2, 6)
        s.append(t, (-3.0 - 6.0 * torch.rand(len(t), generator=g)).tolist(), 0, **kw)

    def observation(s):
        t = ids(2, 6)
        s.append(t, [0.0] * len(t), 0, trainable=False)  # as rollout/episodes.py observe()

    shapes = [("m", "o", "m"), ("o", "m", "o", "m"), ("m", "o", "m", "o", "m")]
    groups = []
    for gid in range(2):
        group = Group.new(gid, PromptRecord(ids=tuple(ids(3, 7)), text=""), 3, gid * 3, version=0)
        for k, s in enumerate(group.samples):
            shape = shapes[k]
            for i, part in enumerate(shape):
                if part == "o":
                    observation(s)
                else:
                    model_turn(s, **({"finish_reason": "stop"} if i == len(shape) - 1 else {}))
            s.set_reward(float((k + gid) % 2))
        groups.append(group)
    return groups


def with_trailing_observation(batch, n: int = 5):
    """Every other sample gets `n` more response tokens with loss mask 0 (rollout logprob 0.0
    as an observation has, wild pi_old and reference)."""
    g = torch.Generator().manual_seed(2)
    samples = []
    for i, s in enumerate(batch.samples):
        if i % 2:
            samples.append(s)
            continue
        extra = {"tokens": torch.randint(0, 512, (n,), generator=g), "loss_mask": torch.zeros(n),
                 "rollout_logprobs": torch.zeros(n), "old_logprobs": torch.full((n,), -70.0),
                 "ref_logprobs": torch.full((n,), 35.0),
                 "versions": torch.full((n,), s.max_version, dtype=torch.int32)}
        samples.append(dataclasses.replace(s, **{k: torch.cat([getattr(s, k), v]) for k, v in extra.items()}))
    return dataclasses.replace(batch, samples=samples)


def with_values(batch, positions, wild: dict[str, tuple[float, float]]):
    """A copy of `batch` with the per-token inputs named in `wild` replaced at `positions(sample)`
    (a bool mask over its response), alternating between the two values given."""
    samples = []
    for s in batch.samples:
        where = positions(s)
        alt = torch.arange(s.response_length) % 2 == 0
        changes = {}
        for attr, (a, b) in wild.items():
            values = getattr(s, attr).clone()
            values[where] = torch.where(alt, a, b)[where]
            changes[attr] = values
        samples.append(dataclasses.replace(s, **changes))
    return dataclasses.replace(batch, samples=samples)


@pytest.mark.parametrize("algorithm", list(CONFIGS.values()), ids=list(CONFIGS))
def test_mask0_tokens_change_nothing_in_the_trainers_gradient_loss_or_step(tiny_qwen2_dir, tmp_path, algorithm):
    from rlkit.train.batch import build_batch_from_config

    algo = {"advantage": "grpo", "off_policy_correction": "tis", **algorithm}
    trainer = make_trainer(tiny_qwen2_dir, algorithm=algo, optimizer={"lr": 1e-3})
    batch = build_batch_from_config(episode_groups(), trainer.config.algorithm, policy_version=0)
    masks = [s.loss_mask for s in batch.samples]
    assert len(batch) == 6 and all(m.min() == 0 and m[-1] == 1 for m in masks)
    assert all(bool((m[:-1] > m[1:]).any()) for m in masks)  # a mask-0 span followed by mask 1

    # pi_old away from the current policy and a reference the policy has moved from (at the
    # reference itself the KL gradient is 0): fixed offsets, so every term has a gradient
    g = torch.Generator().manual_seed(1)
    current, reference = trainer.logprobs(batch), trainer.logprobs(batch, policy="reference")
    batch = batch.with_logprobs(
        old=[lp + 0.3 * torch.randn(lp.shape, generator=g) for lp in current],
        ref=[lp + 0.5 * torch.randn(lp.shape, generator=g) for lp in reference],
    )

    trainer.save(tmp_path / "start")

    def one_step(b):
        """From the same weights, optimizer state and RNG: accumulate (pack, forward, loss,
        backward over micro-batches of 4), the raw gradient, then the optimizer step."""
        trainer.load(tmp_path / "start")
        trainer.accumulate(b)
        grads = trainer.main_grads()
        metrics = trainer.step()
        return grads, metrics, {k: v.clone() for k, v in trainer.megatron_state().items()}

    base_grads, base_metrics, base_weights = one_step(batch)
    assert base_metrics["train/step_applied"] == 1.0 and base_metrics["train/kl"] != 0
    assert 0 < base_metrics["train/is_weight"] < 2.0
    trainable = sum(int(m.sum()) for m in masks)
    expected_denominator = trainable if trainer.config.algorithm.loss_aggregation == "token_mean" else len(batch)
    assert base_metrics["train/loss_denominator"] == expected_denominator
    assert base_metrics["train/tokens"] == batch.tokens  # every token goes through the model

    for values in (WILD, NONFINITE):
        grads, metrics, weights = one_step(with_values(batch, lambda s: s.loss_mask == 0, values))
        assert metrics == base_metrics  # loss, KL, TIS, ratio, grad norm, denominator: bit for bit
        for name, g0 in base_grads.items():
            assert torch.equal(grads[name], g0), name
            assert torch.equal(weights[name], base_weights[name]), name

    grads, metrics, _ = one_step(with_trailing_observation(batch))
    assert metrics["train/loss_denominator"] == base_metrics["train/loss_denominator"]
    assert metrics["train/tokens"] > base_metrics["train/tokens"]
    for key in ("train/loss", "train/kl", "train/is_weight", "train/grad_norm"):
        assert metrics[key] == pytest.approx(base_metrics[key], rel=1e-5), key
    scale = max(float(g.abs().max()) for g in base_grads.values())
    for name, g0 in base_grads.items():
        assert torch.allclose(grads[name], g0, rtol=1e-5, atol=1e-6 * scale), name

    # Converse: the same inputs at one mask-1 token (the first trainable token after the first
    # observation of sample 0) each change the gradient and the loss.
    first = int((masks[0][:-1] > masks[0][1:]).nonzero()[0]) + 1
    first += int(masks[0][first:].nonzero()[0])

    def at_first(s):
        where = torch.zeros(s.response_length, dtype=torch.bool)
        if s is batch.samples[0]:
            where[first] = True
        return where

    assert masks[0][first] == 1
    for attr, values in WILD.items():
        grads, metrics, _ = one_step(with_values(batch, at_first, {attr: values}))
        assert metrics["train/loss"] != base_metrics["train/loss"], attr
        assert any(not torch.equal(grads[n], g0) for n, g0 in base_grads.items()), attr

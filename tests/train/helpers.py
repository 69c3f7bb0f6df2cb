"""Tiny HF models made here (no hub) and batch helpers for the training tests."""

from __future__ import annotations

import torch

from rlkit.rollout.demo_models import TINY_ARCH, TINY_VOCAB

# The demo tiny architecture, with the tie and RoPE base left to each test.
TINY = {k: v for k, v in TINY_ARCH.items() if k not in ("tie_word_embeddings", "rope_theta")}
TINY.update(vocab_size=TINY_VOCAB, max_position_embeddings=1024)


def make_hf_model(kind: str, tie: bool, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tie))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_theta=100000.0, tie_word_embeddings=tie))
    with torch.no_grad():  # HF zero-initialises biases; make every weight matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


def hf_response_logprobs(model, tokens: torch.Tensor, prompt_length: int, temperature: float = 1.0):
    with torch.no_grad():
        logits = model(tokens[None]).logits[0].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)[prompt_length - 1 : -1]
    return lp.gather(-1, tokens[prompt_length:, None])[:, 0]


def random_batch(n: int, *, seed: int = 0, vocab: int = 512, advantages=None, policy_version: int = 0,
                 response_lengths=None, group_size: int = 0):
    """A TrainBatch of n samples with random tokens and varied prompt/response lengths
    (`response_lengths`: given per sample instead; `group_size` k > 0: samples i // k share
    one prompt, as a GRPO group's do)."""
    from rlkit.train.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    prompt = torch.empty(0, dtype=torch.long)
    for i in range(n):
        if not group_size or i % group_size == 0:
            prompt = torch.randint(0, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g)
        p = int(prompt.numel())
        r = int(torch.randint(1, 14, (1,), generator=g)) if response_lengths is None else int(response_lengths[i])
        mask = (torch.rand(r, generator=g) > 0.15).float()
        mask[0] = 1.0
        samples.append(
            TrainSample(
                index=i,
                group_id=i // (group_size or 4),
                tokens=torch.cat([prompt, torch.randint(0, vocab, (r,), generator=g)]),
                prompt_length=p,
                loss_mask=mask,
                rollout_logprobs=-3.0 - torch.rand(r, generator=g),
                advantage=float(advantages[i]) if advantages is not None else float(torch.randn(1, generator=g)),
                reward=0.0,
                min_version=policy_version,
                max_version=policy_version,
            )
        )
    return TrainBatch(samples, policy_version)


def random_groups(n_groups: int, n: int, *, seed: int = 0, vocab: int = 512, version: int = 0,
                  response_lengths=None):
    """Complete, rewarded Groups with random prompt/response tokens and 0/1 rewards
    (`response_lengths`: per sample, in group order, instead of random ones)."""
    from rlkit.buffers.group import Group, PromptRecord

    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid in range(n_groups):
        prompt = tuple(torch.randint(0, vocab, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist())
        group = Group.new(gid, PromptRecord(ids=prompt, text=""), n, gid * n, version=version)
        for k, s in enumerate(group.samples):
            r = (int(torch.randint(1, 12, (1,), generator=g)) if response_lengths is None
                 else int(response_lengths[gid * n + k]))
            s.append(torch.randint(0, vocab, (r,), generator=g).tolist(), (-2 - torch.rand(r, generator=g)).tolist(),
                     version, finish_reason="stop")
            s.set_reward(float(torch.randint(0, 2, (1,), generator=g)))
        groups.append(group)
    return groups

"""The hand-written backward of the vocab-parallel logprob/entropy against autograd (TP=1)."""

import torch

from rlkit.train.megatron.logprobs import vocab_parallel_logprobs


def test_values_and_gradients_match_autograd():
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(7, 50, generator=g, dtype=torch.float64)).requires_grad_(True)
    target = torch.randint(0, 50, (7,), generator=g)
    w_lp, w_ent = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)

    lp, ent = vocab_parallel_logprobs(logits.float(), target, with_entropy=True)
    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits, -1)
    ref_lp = logp.gather(-1, target[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(ent.double(), ref_ent, atol=1e-5)

    (w_lp.float() * lp + w_ent.float() * ent).sum().backward()
    (w_lp * ref_lp + w_ent * ref_ent).sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-5)


def test_without_entropy_only_logprob_gradient():
    logits = torch.randn(3, 10, requires_grad=True)
    target = torch.tensor([1, 5, 9])
    lp, ent = vocab_parallel_logprobs(logits, target)
    assert torch.equal(ent, torch.zeros(3))
    lp.sum().backward()
    expected = torch.nn.functional.one_hot(target, 10).float() - torch.softmax(logits.detach(), -1)
    assert torch.allclose(logits.grad, expected, atol=1e-6)

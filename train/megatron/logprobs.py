"""Log-probabilities and entropy from vocab-sharded logits, with an exact hand-written backward.

With tensor parallelism each rank holds logits for a contiguous slice of the vocabulary. The
softmax normaliser, the target logit and the entropy's sum_v p_v z_v are all-reduced across the
TP group in the forward pass; the backward is computed locally from saved shards:

  d logprob / d z_v = 1[v = target] - p_v
  d entropy / d z_v = -p_v (log p_v + H)

An autograd-aware all-reduce would instead sum the incoming gradients of every TP rank (each of
which computed the same loss) and inflate them by the TP size; Megatron's own
vocab_parallel_cross_entropy avoids that the same way. With `group=None` (TP=1) no collective runs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, with_entropy):  # type: ignore[override]
        logits = logits.float()
        vocab_local = logits.shape[-1]
        row_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            dist.all_reduce(sum_exp, group=group)
        log_z = sum_exp.log()

        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < vocab_local)
        safe_target = local_target.clamp(0, vocab_local - 1)
        target_logit = shifted.gather(-1, safe_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(in_shard, target_logit, torch.zeros_like(target_logit))
        if group is not None:
            dist.all_reduce(target_logit, group=group)
        logprob = target_logit - log_z

        probs = exp / sum_exp.unsqueeze(-1)
        if with_entropy:
            p_z = (probs * shifted).sum(dim=-1)
            if group is not None:
                dist.all_reduce(p_z, group=group)
            entropy = log_z - p_z
            ctx.save_for_backward(probs, safe_target, in_shard, shifted, log_z, entropy)
        else:
            entropy = torch.zeros_like(logprob)
            ctx.save_for_backward(probs, safe_target, in_shard)
        ctx.with_entropy = with_entropy
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):  # type: ignore[override]
        if ctx.with_entropy:
            probs, safe_target, in_shard, shifted, log_z, entropy = ctx.saved_tensors
        else:
            probs, safe_target, in_shard = ctx.saved_tensors
        grad = -probs * grad_logprob.unsqueeze(-1)
        onehot_grad = torch.where(in_shard, grad_logprob, torch.zeros_like(grad_logprob))
        grad.scatter_add_(-1, safe_target.unsqueeze(-1), onehot_grad.unsqueeze(-1))
        if ctx.with_entropy:
            log_p = shifted - log_z.unsqueeze(-1)
            grad = grad - probs * (log_p + entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_start: int = 0,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of `target`, entropy) per row of `logits` ([N, V_local] -> [N], [N]), in fp32.

    `vocab_start` is the first vocabulary id of this rank's shard. The entropy is zeros unless
    `with_entropy`.
    """
    return _VocabParallelLogprobs.apply(logits, target, vocab_start, group, with_entropy)

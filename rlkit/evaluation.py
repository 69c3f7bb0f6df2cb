"""The one way a recipe's `eval` section becomes an Evaluator (the training run's rollout actor
and `rlkit eval` both build theirs here): the held-out sets read by the data loader's rules,
and the reward plugin (the eval reward, or the training reward's score function when the
recipe names none)."""

from __future__ import annotations

from typing import Any

from rollout.config import RolloutConfig
from rollout.eval import Evaluator
from rollout.eval_config import EvalConfig
from rollout.rewards import ScoreFn


def make_evaluator(cfg: EvalConfig, rollout: RolloutConfig, tokenizer: Any,
                   train_score: ScoreFn | None = None) -> Evaluator:
    """A bad row or an unknown reward fails here, before any engine serves."""
    from rlkit.data.prompts import load_eval_sets
    from rlkit.rewards.scoring import make_score_fn

    def decode(ids: Any) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    reward = cfg.reward or rollout.reward
    score = train_score if cfg.reward is None and train_score is not None else make_score_fn(reward, decode)
    return Evaluator(cfg, load_eval_sets(cfg, tokenizer), score, rollout.sampling,
                     reward_timeout_s=reward.timeout_s)

"""The one way a recipe's `eval` section becomes an Evaluator (the training run's rollout actor
and `rlkit eval` both build theirs here): the held-out sets read by the data loader's rules,
and the reward plugin (the eval reward, or the training reward's score function when the
recipe names none), and a multi-turn recipe's episodes (every pass plays them)."""

from __future__ import annotations

from typing import Any

from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.eval_config import EvalConfig
from rlkit.rollout.evaluator import Evaluator
from rlkit.rollout.reward_scheduler import ScoreFn


def make_evaluator(cfg: EvalConfig, rollout: RolloutConfig, tokenizer: Any,
                   train_score: ScoreFn | None = None) -> Evaluator:
    """A bad row, an unknown reward, generator or environment fails here, before any engine
    serves."""
    from rlkit.data.prompts import load_eval_sets
    from rlkit.plugins import episode_runners
    from rlkit.rewards.scoring import make_score_fn, tokenizer_decode

    if cfg.reward is None:
        reward = rollout.reward
        score = train_score or make_score_fn(reward, tokenizer_decode(tokenizer))
    else:
        reward = cfg.reward
        score = make_score_fn(reward, tokenizer_decode(tokenizer), key="eval.reward")
    return Evaluator(cfg, load_eval_sets(cfg, tokenizer), score, rollout.sampling,
                     reward_timeout_s=reward.timeout_s,
                     episodes=episode_runners(rollout.episode, tokenizer))  # multi-turn: None when off

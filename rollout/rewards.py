# moved to rollout/reward_scheduler.py; importers in rollout/manager.py, rlkit/driver/rollout_service.py,
# rlkit/sim/simulate.py, rlkit/bench/rollout.py, rlkit/commands/check_reward.py, tests/manager/*.py to update
from rlkit.rollout.reward_scheduler import *  # noqa: F401,F403
from rlkit.rollout.reward_scheduler import (  # noqa: F401
    REWARD_FAILURE_KINDS, RewardFailure, RewardScheduler, ScoreFn, check_reward_value, describe_error,
)

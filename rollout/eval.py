# moved to rollout/evaluator.py; importers in rlkit/driver/rollout_service.py,
# tests/driver/test_eval_in_modes.py, tests/rollout/test_eval.py to update
from rlkit.rollout.evaluator import *  # noqa: F401,F403
from rlkit.rollout.evaluator import EvalResult, Evaluator, eval_metrics, evaluate, pass_at_k  # noqa: F401

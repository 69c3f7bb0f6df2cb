# moved to rlkit/evaluator_factory.py; importers in rlkit/driver/actors.py to update
from rlkit.evaluator_factory import *  # noqa: F401,F403
from rlkit.evaluator_factory import make_evaluator  # noqa: F401

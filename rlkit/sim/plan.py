# moved to rlkit/gpu_plan.py; importers in rlkit/sim/simulate.py to update (then delete this file)
from rlkit.gpu_plan import *  # noqa: F401,F403
from rlkit.gpu_plan import gpus_per_engine  # noqa: F401

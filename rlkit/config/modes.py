"""The one list of driver modes, as data (recipe key `mode`): the recipe schema, the loops
(rlkit.driver.modes, which must define one loop per name), the simulator, the benches and
`rlkit plan` read it. Nothing here imports a loop.

Where the modes differ is only where the driver waits (rlkit/driver/modes.py says how)."""

from __future__ import annotations

MODES: dict[str, str] = {
    "sync": "rollout step -> train on its batch -> push weights",
    "stream": "each group goes to the trainer as it completes (the same updates as sync, less "
              "idle time)",
    "async": "generation of step k+1 overlaps training on step k, at most rollout.max_staleness "
             "versions behind",
}
MODE_NAMES: tuple[str, ...] = tuple(MODES)

# Modes whose engines generate while the trainer trains (async only with max_staleness >= 1:
# with 0 it is sync, step for step). The trainer's CPU threads follow it (cluster.train_threads).
OVERLAPS_TRAINING: dict[str, bool] = {"sync": False, "stream": True, "async": True}

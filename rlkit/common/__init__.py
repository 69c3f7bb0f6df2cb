"""Leaf code every library of rlkit imports (buffers, rollout, train, and the spine): it imports
no other rlkit package, so `rollout` (which owns the engines) and `train` (which publishes
weights into them) can share it as siblings.

    errors.py         UserError: bad input, said in one line (the CLI exits 2)
    control_token.py  the per-run control token: who may change an engine's or the router's state
    fault_switch.py   the test-only fault switches' contract (engines, trainer ranks)
    engine_http.py    the one client of an engine's control and weight endpoints
    weight_update.py  the WeightUpdate the rollout side opens and hands to the trainer
"""

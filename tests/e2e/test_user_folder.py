"""rlkit installs under one import namespace (`rlkit.rollout`, `rlkit.train`, `rlkit.buffers`):
a user's own `train.py`, `rollout.py` and `buffers.py`, in the folder `rlkit train` runs from and
on the PYTHONPATH that carries their dotted-path reward into Ray workers and reward processes,
shadow nothing of rlkit's (real Ray, router, engines, megatron-core)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]

# Each of the user's modules names itself; the reward imports all three, as a user's code would.
USER_MODULE = "OWNER = 'user'\n"
USER_REWARD = '''
import buffers, rollout, train  # the user's own modules, not rlkit's

def score(sample, **kwargs):
    assert (train.OWNER, rollout.OWNER, buffers.OWNER) == ("user", "user", "user")
    return 1.0 if any(c.isdigit() for c in sample.response) else 0.0
'''


def test_nothing_of_rlkit_is_importable_under_a_generic_top_level_name(tmp_path):
    probe = ("import importlib.util as u, rlkit.rollout, rlkit.train, rlkit.buffers; "
             "print([n for n in ('rollout', 'train', 'buffers') if u.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": ""})
    assert out.stdout.strip() == "[]"


def test_rlkit_train_from_a_folder_with_users_train_rollout_buffers(tmp_path):
    user = tmp_path / "project"
    user.mkdir()
    for name in ("train", "rollout", "buffers"):
        (user / f"{name}.py").write_text(USER_MODULE)
    (user / "my_rewards.py").write_text(USER_REWARD)
    out = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(user), "RLKIT_CACHE": str(tmp_path / "cache")}
    rlkit = Path(sys.executable).with_name("rlkit")
    proc = subprocess.run(
        [str(rlkit), "train", str(ROOT / "recipes" / "grpo_tiny_ci.yaml"),
         "rollout.reward.name=my_rewards:score", "rollout.reward.kwargs={}", "run.num_steps=1",
         f"run.output_dir={out}", "tracking.progress=false", "checkpoint.every_steps=0"],
        cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(x) for x in (out / "grpo-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    # every sample was scored by the user's reward: none failed (a failed assert would count)
    assert all(r["rollout/reward_failures"] == 0 and r["buffer/balanced"] for r in rows)

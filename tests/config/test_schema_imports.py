"""The recipe schema holds names, not code: loading and printing a recipe (`rlkit config show`)
imports no Ray, no torch, no driver, no rollout manager or evaluator. Checked in a fresh
interpreter, on `sys.modules`."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from rlkit.commands import config_show
from rlkit.config import dump_recipe, load_recipe
dump_recipe(load_recipe(sys.argv[1], ["mode=async", "rollout.max_staleness=0",
                                      "rollout.policy=tail_batching"]))
print(json.dumps(sorted(sys.modules)))
"""

FORBIDDEN = ("ray", "torch", "transformers", "aiohttp", "megatron", "rlkit.driver",
             "rlkit.rollout.manager", "rlkit.rollout.evaluator", "rlkit.rollout.policies",
             "rlkit.sim", "rlkit.bench")


def test_loading_a_recipe_imports_no_runtime_code():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "recipes" / "grpo_smollm2_cpu.yaml")],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    loaded = json.loads(out.stdout.splitlines()[-1])
    heavy = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert heavy == []
    project = [m for m in loaded if m == "rlkit" or m.startswith("rlkit.")]
    assert len(project) <= 25, project  # 40 before the names moved into data-only modules

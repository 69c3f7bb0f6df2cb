#!/usr/bin/env bash
# The main job: GRPO with active partial rollouts on the default CPU recipe.
#
#   bash recipes/run_grpo.sh                         # recipes/grpo_smollm2_cpu.yaml
#   bash recipes/run_grpo.sh recipes/x.yaml k.p=v    # another recipe, with overrides
#   bash recipes/run_grpo.sh run.num_steps=3         # the default recipe, with overrides
#
# Sets up .venv on first use (CPU torch on machines without CUDA), then runs `rlkit train`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"

recipe="$ROOT/recipes/grpo_smollm2_cpu.yaml"
if [[ $# -gt 0 && "$1" != *=* ]]; then
    recipe="$1"
    shift
fi
exec "$VENV/bin/rlkit" train "$recipe" "$@"

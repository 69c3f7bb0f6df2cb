#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment if needed, then run pytest.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not slow" -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
# --durations: the slowest tests, so CI time (kept under 20 minutes) is watched where it goes
exec "$VENV/bin/python" -m pytest --durations=25 "$@"

#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment if needed, then run pytest.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not slow" -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"

#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment if needed, then run pytest.
# Extra arguments go to pytest, e.g. `bash tools/test.sh -m "not slow" -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/tools/setup_env.sh"
cd "$ROOT"
# The viewer's browser tests (tests/view/browser.py) drive Debian's Chromium: installed here when
# missing and this machine can (root, apt); elsewhere they skip, in CI they fail.
if [[ ! -x /usr/bin/chromium ]] && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    echo "[rlkit test] installing Debian's chromium for the viewer's browser tests" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends chromium; } >/dev/null 2>&1 \
        || echo "[rlkit test] chromium could not be installed: the browser tests will say so" >&2
fi
# --durations: the slowest tests, so CI time (kept under 20 minutes) is watched where it goes
exec "$VENV/bin/python" -m pytest --durations=25 "$@"

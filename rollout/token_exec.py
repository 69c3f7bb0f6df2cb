"""Run a Python module's command line with the control token added to its arguments.

    python -m rlkit.rollout.token_exec FLAG VALUE_TEMPLATE MODULE [ARGS...]

runs MODULE as __main__ with `ARGS FLAG VALUE` where VALUE is VALUE_TEMPLATE with '{token}'
replaced by $RLKIT_CONTROL_TOKEN. Why: sglang-router and SGLang take their keys only as
command-line flags, and a process's command line is readable by every local user
(/proc/PID/cmdline, ps) and quoted in rlkit's start-up errors; the environment is not (only the
same user reads /proc/PID/environ). Rewriting sys.argv here changes what the program parses,
not what the kernel shows.
"""

from __future__ import annotations

import runpy
import sys

from rlkit.rollout.auth import CONTROL_TOKEN_ENV, control_token_from_env


def main() -> None:
    if len(sys.argv) < 4:
        raise SystemExit(__doc__)
    flag, template, module, *args = sys.argv[1:]
    token = control_token_from_env()
    if token is None:
        raise SystemExit(f"rlkit.rollout.token_exec: {CONTROL_TOKEN_ENV} is not set; nothing to pass "
                         f"to {module} as {flag}")
    sys.argv = [module, *args, flag, template.replace("{token}", token)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

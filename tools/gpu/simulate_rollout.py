"""Re-run the simulated side of a `rlkit bench rollout` result (the rollout.json in its `--out`
folder) with an engine profile, on any machine (the simulator is pure Python): the same trace,
policies and step counts.

    python tools/gpu/simulate_rollout.py RESULT.json --trace TRACE.jsonl \
        --profile docs/profiles/h100-smollm2-t1.json [--out SIMULATED.json]

Used for docs/gpu.md: the real side ran on the GPU (with `--trace-out`), the simulated side can
be repeated here without device time. Prints the bench's table with both ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="rollout.json that rlkit bench rollout wrote into its --out folder")
    p.add_argument("--trace", required=True, help="the trace the real run replayed (--trace-out)")
    p.add_argument("--profile", required=True, help="engine profile file or packaged name")
    p.add_argument("--out", help="write the result with its new 'simulated' part here")
    args = p.parse_args(argv)
    from rlkit.bench.rollout import format_table, simulate_same

    result = json.loads(Path(args.result).read_text())
    bench_args = argparse.Namespace(**result["config"])
    bench_args.trace, bench_args.simulate = args.trace, args.profile
    # a result recorded before tail batching's adaptive over-launch ran the fixed eta_prompts
    bench_args.tail_fixed = result["config"].get("tail_fixed", True)
    result["simulated"] = simulate_same(bench_args, result)
    print(format_table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

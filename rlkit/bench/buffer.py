"""`rlkit bench buffer`: RolloutBuffer group operations per second.

Groups of 8 samples carrying 4k-token responses (tokens, logprobs, versions, mask) move through
every queue operation a step performs: acquire fresh, requeue (abort), resume from the partial
queue, put (complete -> ready), take (blocking API), stream (async API). The buffer moves
references, so the figure should not depend on response length; the bench checks that by
using full-size responses. Target: >= 50,000 group operations per second for put, requeue,
take and stream.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Callable

from rlkit.bench.report import add_out_argument, out_folder, write_report

TARGET_OPS_PER_S = 50_000
# The operations the target is stated for (issue 2); acquire/resume are reported beside them.
TARGET_OPS = ("put", "requeue", "take", "stream")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--groups", type=int, default=2000, help="groups per round")
    parser.add_argument("--samples", type=int, default=8, help="samples per group")
    parser.add_argument("--tokens", type=int, default=4096, help="response tokens per sample")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_out_argument(parser, "buffer")


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out)
    result = bench_buffer(args.groups, args.samples, args.tokens, args.rounds)
    table = format_table(result)
    print(json.dumps(result, indent=2) if args.json else table)
    write_report(out, "buffer", result, table)
    return 0


def bench_buffer(groups: int, samples: int, tokens: int, rounds: int) -> dict:
    from rlkit.buffers import ListPromptSource, RolloutBuffer, SampleStatus
    from rlkit.buffers.source import records_from_token_lists

    # One set of full-size per-token lists, shared by every sample (the buffer never copies
    # them; sharing keeps the bench's memory at a few MB instead of gigabytes).
    ids, lps, vers, mask = [7] * tokens, [-0.5] * tokens, [0] * tokens, [1] * tokens

    def fill(group_list, done: bool) -> None:
        """Give every sample a full response: aborted mid-way (partial) or finished and rewarded."""
        for g in group_list:
            for s in g.samples:
                s.response_ids, s.logprobs, s.versions, s.loss_mask = ids, lps, vers, mask
                if done:
                    s.status, s.finish_reason, s.reward = SampleStatus.DONE, "stop", 1.0
                else:
                    s.status, s.finish_reason, s.reward = SampleStatus.RUNNING, None, None

    def timed(fn: Callable[[], object], count: int) -> float:
        t0 = time.perf_counter()
        fn()
        return count / (time.perf_counter() - t0)

    per_op: dict[str, list[float]] = {k: [] for k in
                                       ("acquire", "requeue", "resume", "put", "take", "stream")}
    for _ in range(rounds):
        # One row per group: all `groups` are out at once (in flight, then partial), and the
        # buffer never hands out a row that is already out (a prompt is never out twice), so
        # fewer rows than groups would leave `acquire` with nothing to give.
        source = ListPromptSource(records_from_token_lists([[1, 2, 3]] * groups), seed=0)
        buf = RolloutBuffer(source, n_samples_per_prompt=samples)
        box: dict = {}

        def acquire_one_by_one() -> None:
            box["g"] = [g for _ in range(groups) for g in buf.acquire(1)]
            if len(box["g"]) != groups:
                raise RuntimeError(f"bench buffer: acquired {len(box['g'])} of {groups} groups")

        per_op["acquire"].append(timed(acquire_one_by_one, groups))  # fresh prompts
        fill(box["g"], done=False)
        per_op["requeue"].append(timed(lambda: [buf.requeue(g) for g in box["g"]], groups))
        per_op["resume"].append(timed(acquire_one_by_one, groups))  # from the partial queue
        fill(box["g"], done=True)
        per_op["put"].append(timed(lambda: [buf.complete(g) for g in box["g"]], groups))
        per_op["take"].append(timed(lambda: [buf.take(1) for _ in range(groups)], groups))

        box["g"] = buf.acquire(groups)
        if len(box["g"]) != groups:  # stream(groups) below would wait for the rest forever
            raise RuntimeError(f"bench buffer: acquired {len(box['g'])} of {groups} groups")
        fill(box["g"], done=True)
        for g in box["g"]:
            buf.complete(g)

        async def drain() -> None:
            async for _ in buf.stream(groups):
                pass

        per_op["stream"].append(timed(lambda: asyncio.run(drain()), groups))
        assert buf.stats()["balanced"]

    medians = {k: statistics.median(v) for k, v in per_op.items()}
    overall = len(medians) / sum(1 / v for v in medians.values())  # mixed sequence of all ops
    return {
        "groups": groups,
        "samples_per_group": samples,
        "tokens_per_sample": tokens,
        "ops_per_s": medians,
        "overall_ops_per_s": overall,
        "target_ops_per_s": TARGET_OPS_PER_S,
        "meets_target": min(medians[k] for k in TARGET_OPS) >= TARGET_OPS_PER_S,
    }


def format_table(r: dict) -> str:
    lines = [
        f"RolloutBuffer: {r['groups']} groups x {r['samples_per_group']} samples x "
        f"{r['tokens_per_sample']} tokens, median of rounds",
        "",
        "| operation | group ops/s |",
        "|---|---:|",
    ]
    lines += [f"| {k} | {v:,.0f} |" for k, v in r["ops_per_s"].items()]
    lines += [
        f"| all (harmonic mean) | {r['overall_ops_per_s']:,.0f} |",
        "",
        f"target >= {r['target_ops_per_s']:,} ops/s for {', '.join(TARGET_OPS)}: "
        f"{'met' if r['meets_target'] else 'NOT met'}",
        "(acquire builds a fresh group of new samples: its cost is object creation and "
        "Python's GC, not queueing)",
    ]
    return "\n".join(lines)

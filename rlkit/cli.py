"""`rlkit` command line.

Each command lives in its own module, which defines `add_arguments(parser)` and `run(args) -> int`
and keeps heavy imports (torch, ray, transformers) inside `run`, so `rlkit --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command words, module, one-line help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("train",), "rlkit.commands.train", "run a training job from a recipe"),
    (("config", "show"), "rlkit.commands.config_show", "print the resolved recipe"),
    (("config", "docs"), "rlkit.commands.config_docs", "regenerate docs/recipe-reference.md"),
    (("prepare-model",), "rlkit.commands.prepare_model", "build a demo model (tiny, tiny-llama, smollm2) into the cache"),
    (("check-reward",), "rlkit.commands.check_reward", "check a reward plugin against the contract"),
    (("export",), "rlkit.commands.export", "write a trainer checkpoint as an HF model folder"),
    (("eval",), "rlkit.commands.eval", "evaluate a model or checkpoint on held-out prompts (pass@k)"),
    (("plot", "metrics"), "rlkit.commands.plot_metrics", "per-step metric curves of a run as a PNG"),
    (("plot", "timeline"), "rlkit.commands.plot_timeline", "per-engine Gantt chart of a step"),
    (("view",), "rlkit.commands.view", "a web page over a run (steps, engines, groups, samples, advice); --export-trace"),
    (("plan",), "rlkit.commands.plan", "split GPUs between generation and training (StreamRL Alg. 1), or colocate them"),
    (("bench", "buffer"), "rlkit.bench.buffer", "buffer group operations per second"),
    (("bench", "engine"), "rlkit.bench.engine", "engine tokens/s through the router vs model.generate; PTL profile"),
    (("bench", "train"), "rlkit.bench.train", "trainer tokens/s (TP=1, TP=2) and weight-sync s/GB"),
    (("bench", "rollout"), "rlkit.bench.rollout", "rollout throughput of policies on the real engines"),
    (("bench", "suite"), "rlkit.bench.suite", "policies and modes side by side on a simulated cluster"),
    (("bench", "e2e"), "rlkit.bench.e2e", "a recipe's whole job in each driver mode, on this machine"),
    (("bench", "faults"), "rlkit.bench.faults", "engine faults injected vs survived vs data lost, simulated"),
    (("bench", "ranker"), "rlkit.bench.ranker", "length rankers' recall of the long tail"),
    (("bench", "learn"), "rlkit.bench.learn", "held-out accuracy of off-policy modes vs sync, same samples, over seeds"),
    (("bench", "peer"), "rlkit.bench.peer", "the same GRPO job in TRL's GRPOTrainer and in rlkit, side by side"),
    (("bench", "view"), "rlkit.bench.view", "page load times of `rlkit view` on a large (simulated) run, in headless Chromium"),
    (("bench", "lora"), "rlkit.bench.lora", "LoRA's trainer memory and weight syncs (adapter, merged, full) to an engine"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlkit", description=__doc__.splitlines()[0])
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    }
    for words, module, help_text in COMMANDS:
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in groups:
                p = groups[words[: depth - 1]].add_parser(words[depth - 1], help=f"{words[0]} ...")
                groups[prefix] = p.add_subparsers(
                    dest=f"command_{depth}", metavar="COMMAND", required=True
                )
        p = groups[words[:-1]].add_parser(words[-1], help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rlkit.common.errors import find_user_error

    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("rlkit: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # The one place errors a user can fix (recipe, data, model, reward, checkpoint, port)
        # are reported: the message names what and where; a traceback (through Ray's wrapper,
        # unwrapped here) adds nothing. Anything else is a bug and keeps its traceback.
        user = find_user_error(e)
        if user is None:
            raise
        print(f"rlkit: {user}", file=sys.stderr)
        return user.exit_code


if __name__ == "__main__":
    sys.exit(main())

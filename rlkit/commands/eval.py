"""`rlkit eval MODEL_OR_CHECKPOINT RECIPE_OR_DATA`: evaluate a model on held-out prompts, on
engines this command starts and stops (docs/evaluation.md, "As a command").

MODEL_OR_CHECKPOINT: an HF model folder, a demo model name (tiny, tiny-llama, smollm2), a
trainer checkpoint folder, a run checkpoint (`<run>/checkpoints/step_N`) or a run folder (its
latest checkpoint). A checkpoint is exported to a temporary HF folder first; the version
reported is its step (0 for a model folder).

RECIPE_OR_DATA: a recipe YAML, whose `eval` section is run as is (or, when it lists no
datasets, its `data` section as one dataset named after the recipe file); or a data path
(.jsonl, .parquet, a datasets folder, `builtin:...`), evaluated as one dataset with the
default recipe's loader options and the default `eval` section (a greedy pass). `--set k=v`
overrides either recipe (`--set eval.n_samples=8 --set eval.k=4` adds a sampled pass with
pass@4).

The same evaluation as the training run's (rollout.evaluator.Evaluator), so its numbers compare
with RUN/eval.jsonl. `plan(args)` resolves the arguments without starting anything.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlkit.common.errors import UserError

DATA_SUFFIXES = (".jsonl", ".parquet")
RECIPE_SUFFIXES = (".yaml", ".yml")


class EvalArgumentError(UserError, ValueError):
    """A MODEL_OR_CHECKPOINT or RECIPE_OR_DATA argument that names nothing usable."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", metavar="MODEL_OR_CHECKPOINT",
        help="HF model folder, demo model (tiny, smollm2), trainer or run checkpoint, or run folder",
    )
    parser.add_argument(
        "source", metavar="RECIPE_OR_DATA",
        help="recipe YAML (its eval section, else its data) or prompts: .jsonl, .parquet, "
        "a datasets folder, builtin:NAME[?k=v&...]",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="recipe override, repeatable (e.g. --set eval.n_samples=8 --set eval.k=4)",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="evaluate at most the first N rows of each dataset")
    parser.add_argument("--out", type=Path, default=Path("eval.json"),
                        help="JSON file to write (default: ./eval.json)")
    parser.add_argument("--engines", type=int, default=None, metavar="N",
                        help="engines to start (default: the recipe's rollout.engine.num_engines)")


# -- resolving the arguments ---------------------------------------------------------------------
@dataclass
class Plan:
    """What an evaluation will do, resolved from the arguments without starting anything."""

    model: str  # the argument as given
    kind: str  # "hf" | "demo" | "checkpoint"
    path: Path | None  # the HF folder ("hf"), the trainer checkpoint folder ("checkpoint")
    version: int
    eval: Any  # rollout.eval_config.EvalConfig, with its datasets listed
    recipe: Any  # rlkit.config.Recipe
    num_engines: int


def plan(args: argparse.Namespace) -> Plan:
    if args.limit is not None and args.limit < 1:
        raise EvalArgumentError(f"--limit must be >= 1, got {args.limit}")
    if args.engines is not None and args.engines < 1:
        raise EvalArgumentError(f"--engines must be >= 1, got {args.engines}")
    kind, path, version = resolve_model(str(args.model))
    recipe, eval_cfg = resolve_source(str(args.source), list(args.overrides), args.limit)
    engines = args.engines or recipe.rollout.engine.num_engines
    return Plan(str(args.model), kind, path, version, eval_cfg, recipe, engines)


def resolve_model(arg: str) -> tuple[str, Path | None, int]:
    """(kind, path, version) of MODEL_OR_CHECKPOINT: a run folder becomes its latest checkpoint."""
    from rlkit.checkpoint import STATE, latest_checkpoint
    from rlkit.rollout.demo_models import DEMO_MODELS

    path = Path(arg).expanduser()
    if not path.exists():
        if arg in DEMO_MODELS:
            return "demo", None, 0
        raise EvalArgumentError(
            f"MODEL_OR_CHECKPOINT {arg!r}: no such file or folder, and not a demo model "
            f"({', '.join(DEMO_MODELS)})"
        )
    if path.is_dir() and not (path / "meta.json").is_file() and not (path / "trainer").is_dir():
        if (path / "config.json").is_file():
            return "hf", path, 0
        latest = latest_checkpoint(path)
        if latest is not None:
            path = latest.path
    try:
        if (path / STATE).is_file():  # a run checkpoint: state.json names its step
            return "checkpoint", path, _step(path / STATE)
        if (path / "meta.json").is_file():  # a trainer checkpoint
            return "checkpoint", path, _step(path / "meta.json")
        if (path / "trainer" / "meta.json").is_file():
            return "checkpoint", path, _step(path / "trainer" / "meta.json")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise EvalArgumentError(f"MODEL_OR_CHECKPOINT {arg!r}: unreadable checkpoint step ({e})") from None
    raise EvalArgumentError(
        f"MODEL_OR_CHECKPOINT {arg!r}: neither an HF model folder (config.json), a trainer or run "
        "checkpoint (meta.json, state.json), a run folder with checkpoints, nor a demo model "
        f"({', '.join(DEMO_MODELS)})"
    )


def _step(file: Path) -> int:
    return int(json.loads(file.read_text())["step"])


def is_data_path(arg: str) -> bool:
    return arg.startswith("builtin:") or arg.endswith(DATA_SUFFIXES) or Path(arg).is_dir()


def dataset_name(text: str) -> str:
    """A metrics name (letters, digits, '_', '.', '-') for a data path or recipe file."""
    if text.startswith("builtin:"):
        stem = text[len("builtin:"):].split("?", 1)[0]
    else:
        p = Path(text.rstrip("/"))
        stem = p.stem if p.suffix else p.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_") or "data"


def resolve_source(arg: str, overrides: Sequence[str], limit: int | None = None) -> tuple[Any, Any]:
    """(recipe, EvalConfig with its datasets listed) for RECIPE_OR_DATA and the --set overrides."""
    from pydantic import ValidationError

    from rlkit.config import RecipeError, load_recipe
    from rlkit.config.loader import resolve_raw
    from rlkit.rollout.eval_config import EvalConfig, EvalDatasetConfig

    if arg.endswith(RECIPE_SUFFIXES):
        if not Path(arg).is_file():
            raise EvalArgumentError(f"RECIPE_OR_DATA {arg!r}: recipe file not found")
        recipe = load_recipe(arg, overrides)
        data_path = None
        if not recipe.eval.datasets:
            raw, _ = resolve_raw(arg, overrides)
            data = raw.get("data")
            if not isinstance(data, dict) or not data.get("path"):
                raise EvalArgumentError(
                    f"RECIPE_OR_DATA {arg!r}: the recipe lists no eval.datasets and sets no "
                    "data.path: nothing to evaluate"
                )
            data_path, name = recipe.data.path, dataset_name(arg)
    elif is_data_path(arg):
        if not arg.startswith("builtin:") and not Path(arg).exists():
            raise EvalArgumentError(f"RECIPE_OR_DATA {arg!r}: data file not found")
        recipe = load_recipe(None, overrides)
        data_path, name = arg, dataset_name(arg)
    else:
        raise EvalArgumentError(
            f"RECIPE_OR_DATA {arg!r}: neither a recipe ({', '.join(RECIPE_SUFFIXES)}) nor prompts "
            f"({', '.join(DATA_SUFFIXES)}, a datasets folder, builtin:NAME)"
        )

    if data_path is None:
        datasets = list(recipe.eval.datasets)
    else:
        # the loader options an eval data set shares with the recipe's data (PromptDataConfig)
        loader = recipe.data.model_dump(include=set(EvalDatasetConfig.model_fields) - {"name"})
        datasets = [EvalDatasetConfig(**{**loader, "path": data_path, "name": name})]
    if limit is not None:
        datasets = [d.model_copy(update={"limit": min(limit, d.limit or limit)}) for d in datasets]
    try:
        cfg = EvalConfig.model_validate({**recipe.eval.model_dump(), "datasets": [
            d.model_dump() for d in datasets]})
    except ValidationError as e:
        msg = "; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())
        raise RecipeError(f"RECIPE_OR_DATA {arg!r}: eval: {msg}") from None
    return recipe, cfg


# -- running --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    import tempfile

    p = plan(args)
    with tempfile.TemporaryDirectory(prefix="rlkit-eval-") as tmp:
        if p.kind == "demo":
            from rlkit.rollout.demo_models import resolve_model_path

            model_path = resolve_model_path(p.model)
        elif p.kind == "checkpoint":
            from rlkit.commands.export import export_checkpoint, trainer_checkpoint_dir

            assert p.path is not None
            ckpt = trainer_checkpoint_dir(p.path)
            print(f"rlkit eval: exporting {ckpt} (step {p.version}) to a temporary HF folder")
            model_path = str(export_checkpoint(ckpt, Path(tmp) / "model"))
        else:
            model_path = str(p.path)
        results = evaluate_model(model_path, p)
    report = build_report(p.model, p.version, results)
    print_table(results, p.model, p.version)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    print(f"rlkit eval: wrote {args.out}")
    return 0


def evaluate_model(model_path: str, p: Plan) -> list[Any]:
    """Load the prompts and the reward (a bad row or reward name fails before any engine
    starts), then start the engines, evaluate, and stop them (also on error or Ctrl-C)."""
    import asyncio

    from transformers import AutoTokenizer

    from rlkit.evaluator_factory import make_evaluator
    from rlkit.rollout.engines.fleet import EngineFleet

    r = p.recipe
    evaluator = make_evaluator(p.eval, r.rollout, AutoTokenizer.from_pretrained(model_path))
    engine_cfg = r.rollout.engine.model_copy(update={"num_engines": p.num_engines})
    print(f"rlkit eval: {p.model} (version {p.version}), {len(evaluator.passes)} pass(es), "
          f"starting {p.num_engines} {engine_cfg.kind} engine(s)")

    async def go(fleet: Any) -> list[Any]:
        async with fleet.client() as client:
            return await evaluator.run(client, p.version)

    with EngineFleet(model_path, engine_cfg, r.rollout.router) as fleet:
        return asyncio.run(go(fleet))


# -- reporting ------------------------------------------------------------------------------------
def result_row(r: Any) -> dict[str, Any]:
    """One EvalResult as JSON (NaN, e.g. no length when every sample failed, as null)."""
    from rlkit.tracking import json_safe

    row = {
        "name": r.name, "version": r.version, "prompts": r.prompts, "n": r.n, "k": r.k,
        "samples": r.samples, "scored": r.scored, "generated": r.generated,
        "pass@1": r.pass_at_1, "pass@k": r.pass_at_k, f"pass@{r.k}": r.pass_at_k,
        "mean_reward": r.mean_reward, "mean_response_length": r.mean_response_length,
        "max_response_length": r.max_response_length, "truncation_rate": r.truncation_rate,
        "failures": r.engine_failures + r.reward_failures,
        "engine_failures": r.engine_failures, "reward_failures": r.reward_failures,
        "reward_failures_by_kind": dict(r.reward_failures_by_kind),
        "seconds": r.seconds, "correct": list(r.correct), "errors": list(r.errors),
    }
    return json_safe(row)


def build_report(model: str, version: int, results: Sequence[Any]) -> dict[str, Any]:
    from rlkit.tracking import json_safe
    from rlkit.rollout.evaluator import eval_metrics

    return {
        "model": model,
        "version": version,
        "results": [result_row(r) for r in results],
        "metrics": json_safe(eval_metrics(results)),
    }


def print_table(results: Sequence[Any], model: str, version: int) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x: float, digits: int = 3) -> str:
        return "-" if not math.isfinite(x) else f"{x:.{digits}f}"

    table = Table(title=f"rlkit eval: {model} (version {version})")
    table.add_column("dataset/pass", no_wrap=True)
    for col in ("prompts", "n", "k", "pass@1", "pass@k", "reward", "mean len", "max len",
                "trunc", "fail", "s"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in results:
        table.add_row(
            r.name, str(r.prompts), str(r.n), str(r.k), f(r.pass_at_1), f(r.pass_at_k),
            f(r.mean_reward), f(r.mean_response_length, 1), str(r.max_response_length),
            f(r.truncation_rate, 2), str(r.engine_failures + r.reward_failures), f(r.seconds, 1),
        )
    console = Console()
    if not console.is_terminal:  # a log file or pipe: rich would squeeze it into 80 columns
        console = Console(width=max(console.width, 120))
    console.print(table)
    for r in results:
        for e in r.errors[:3]:
            print(f"  {r.name}: {e}")

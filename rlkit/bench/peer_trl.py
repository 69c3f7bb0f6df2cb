"""The TRL side of `rlkit bench peer`: one GRPO job in Hugging Face TRL's GRPOTrainer, run as
its own process (`python -m rlkit.bench.peer_trl CONFIG`, with the TRL folder first on
PYTHONPATH, never installed into the venv).

CONFIG is the JSON file `rlkit bench peer` writes: the model folder, the prompts file (rows in
rlkit's own order: step s trains on rows P(s-1)..Ps-1, as rlkit sync does), the batch and the
settings taken from the resolved sync recipe. The worker writes into the config's `out` folder:

- `steps.json`: one row per optimizer step (seconds, rollout and generation seconds, reward,
  mean completion length, completions) and the settings TRL ran with;
- `model/`: the trained model and tokenizer (save_pretrained), for `rlkit eval`;
- or, when TRL or one of its dependencies cannot be imported, `steps.json` with a `skipped`
  line naming the module, and exit code 3.

How each figure is taken (docs/bench/peer.md):
- step seconds: the time between successive `on_step_end` calls of a TrainerCallback (step 1
  from `on_train_begin`), so it includes TRL's per-step logging;
- rollout seconds: `trainer._generate_and_score_completions` wrapped (generation, reward,
  advantages), generation alone: `trainer._generate` wrapped;
- reward and `completions/mean_length`: TRL's own log of each step (`logging_steps=1`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SKIPPED_EXIT = 3


def trl_batch_layout(completions: int, micro_batch: int) -> dict[str, int]:
    """GRPOConfig batch fields for one optimizer step per generation batch of `completions`
    completions, in micro-batches of at most `micro_batch` (the largest divisor of
    `completions` that fits, so no micro-batch is ragged)."""
    mb = max(d for d in range(1, min(micro_batch, completions) + 1) if completions % d == 0)
    steps = completions // mb
    return {"per_device_train_batch_size": mb, "gradient_accumulation_steps": steps,
            "steps_per_generation": steps}


def _import_trl() -> tuple[Any, Any, Any, str]:
    """(GRPOConfig, GRPOTrainer, TrainerCallback, version); raises ImportError naming the module."""
    try:
        import trl
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # TRL's lazy modules re-raise a missing dependency as RuntimeError
        missing = None
        err: BaseException | None = e
        while err is not None:
            if isinstance(err, ModuleNotFoundError) and err.name:
                missing = err.name
                break
            err = err.__cause__ or err.__context__
        what = f"missing module {missing!r}" if missing else f"{type(e).__name__}: {e}"
        raise ImportError(what) from e
    return GRPOConfig, GRPOTrainer, TrainerCallback, getattr(trl, "__version__", "?")


def reward_function(name: str, kwargs: dict[str, Any]):
    """TRL's reward signature `(prompts, completions, label, **_) -> list[float]` around rlkit's
    own reward (rollout.reward.name, e.g. `math`): the same function rlkit scores with."""
    import asyncio

    from rlkit.rewards import RewardInput, is_async, resolve_reward

    fn = resolve_reward(name)

    def text(x: Any) -> str:
        return x[-1]["content"] if isinstance(x, list) else str(x)

    def reward(prompts: list, completions: list, label: list, **_: Any) -> list[float]:
        out = []
        for p, c, lab in zip(prompts, completions, label):
            sample = RewardInput(prompt=text(p), response=text(c), label=lab)
            value = fn(sample, **kwargs)
            if is_async(fn):
                value = asyncio.run(value)
            out.append(float(value))
        return out

    reward.__name__ = name.replace(".", "_").replace(":", "_")
    return reward


def main(argv: list[str]) -> int:
    cfg = json.loads(Path(argv[0]).read_text())
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    threads = int(cfg["threads"])
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))

    try:
        GRPOConfig, GRPOTrainer, TrainerCallback, version = _import_trl()
    except ImportError as e:
        (out / "steps.json").write_text(json.dumps({"skipped": f"trl cannot be imported ({e})"}))
        print(f"peer_trl: trl cannot be imported ({e})", file=sys.stderr)
        return SKIPPED_EXIT

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    rows = [json.loads(x) for x in Path(cfg["prompts"]).read_text().splitlines() if x.strip()]
    dataset = datasets.Dataset.from_list(rows)
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)

    completions = cfg["prompts_per_step"] * cfg["samples"]
    layout = trl_batch_layout(completions, cfg["micro_batch"])
    settings = dict(
        max_steps=cfg["steps"], seed=cfg["seed"], **layout,
        num_generations=cfg["samples"], max_completion_length=cfg["max_new_tokens"],
        temperature=cfg["temperature"], top_p=cfg["top_p"], top_k=cfg["top_k"],
        learning_rate=cfg["lr"], lr_scheduler_type="constant",
        adam_beta1=cfg["betas"][0], adam_beta2=cfg["betas"][1], adam_epsilon=cfg["eps"],
        weight_decay=cfg["weight_decay"], max_grad_norm=cfg["grad_clip"],
        beta=0.0, epsilon=cfg["clip_low"], epsilon_high=cfg["clip_high"], loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False,
        bf16=False, fp16=False, use_cpu=True,
        logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
    )
    # off (GRPOConfig defaults it on): rlkit's trainer does no activation recompute. transformers
    # 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    settings["activation_checkpointing" if "activation_checkpointing" in fields
             else "gradient_checkpointing"] = False
    args = GRPOConfig(output_dir=str(out / "trainer"), **settings)

    steps: list[dict[str, Any]] = []
    clock: dict[str, Any] = {"last": None, "rollout": {}, "generate": {}}

    class Timing(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            clock["last"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            steps.append({"step": state.global_step, "seconds": now - clock["last"]})
            clock["last"] = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1]["reward"] = logs.get("reward")
                steps[-1]["mean_length"] = logs.get("completions/mean_length")
                steps[-1]["loss"] = logs.get("loss")

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_function(cfg["reward"], cfg.get("reward_kwargs") or {}),
        args=args, train_dataset=dataset, processing_class=tok, callbacks=[Timing()],
    )

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            step = trainer.state.global_step + 1  # the step this generation batch trains
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[name][step] = clock[name].get(step, 0.0) + time.perf_counter() - t0
        return wrapper

    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    trainer._generate = timed("generate", trainer._generate)

    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    for row in steps:
        row["rollout_seconds"] = clock["rollout"].get(row["step"])
        row["generate_seconds"] = clock["generate"].get(row["step"])
        row["completions"] = completions
        if row.get("mean_length") is not None:
            row["tokens_generated"] = row["mean_length"] * completions

    model_dir = out / "model"
    trainer.model.save_pretrained(model_dir, safe_serialization=True)
    tok.save_pretrained(model_dir)
    (out / "steps.json").write_text(json.dumps({
        "trl_version": version, "torch_threads": torch.get_num_threads(),
        "train_wall_s": train_wall, "settings": settings, "steps": steps,
        "model": str(model_dir),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

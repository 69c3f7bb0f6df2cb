"""SFT (train.algorithm.loss: sft) end to end on the real stack (Ray, megatron-core), no engine:
the loss falls on a fixed data set, a resumed run continues at its data position, and the
warm-up path holds: `rlkit export` of its checkpoint is an HF model that gives the trained
responses more likelihood than the base did, and an RL run starts from it."""

import json
from pathlib import Path

import pytest
import torch

from rlkit.cli import main
from rlkit.config import load_recipe
from rlkit.driver.run import train
from tests.e2e.test_train_tiny import processes_with, rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]

# the same 8 rows every step (one batch is the whole data set): the loss must fall
TINY_SFT = ["model.path=tiny", "data.path=builtin:arithmetic?rows=8", "rollout.batch_size=8",
            "train.micro_batch_size=4", "train.optimizer.lr=1e-3", "tracking.progress=false",
            "checkpoint.every_steps=1"]


@pytest.fixture(scope="module")
def shared_ray():
    """One local Ray for the test's three runs (each would start and stop its own: ~4 s each);
    a run on a Ray it did not start leaves it running."""
    from rlkit.driver.local_ray import local_ray

    with local_ray(2):
        yield


def response_logprob(model_dir, tokenizer, record) -> float:
    from transformers import AutoModelForCausalLM

    from rlkit.data.sft import sft_sample

    sample, _ = sft_sample(record, tokenizer, 0, 64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(sample.tokens[None]).logits[0, :-1].log_softmax(-1)
    lp = logits.gather(1, sample.tokens[1:, None])[:, 0]
    return float(lp[sample.prompt_length - 1:].sum())


def test_sft_learns_resumes_and_warms_up_an_rl_run(tmp_path, monkeypatch, shared_ray):
    from transformers import AutoTokenizer

    from rlkit.data.sft import load_sft_source
    from rlkit.rollout.demo_models import resolve_model_path

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    recipe = ROOT / "recipes" / "sft_smollm2_cpu.yaml"
    r = load_recipe(recipe, [*TINY_SFT, f"run.output_dir={out}", "run.num_steps=3"])
    state = train(r)
    run_dir = out / r.run.name
    assert (state.step, state.version) == (3, 0)  # no engine: no weight sync, no version
    first = rows(run_dir)
    losses = [m["train/loss"] for m in first]
    assert losses[0] > losses[1] > losses[2], losses  # the same rows, learned step by step
    assert all(m["sft/rows"] == 8 and m["sft/truncated"] == 0 and m["train/samples"] == 8
               for m in first)
    assert [m["sft/epoch"] for m in first] == [0, 1, 2]  # one batch per pass over the data
    # resume: the fourth step continues from the checkpoint at the next epoch
    r4 = load_recipe(recipe, [*TINY_SFT, f"run.output_dir={out}", "run.num_steps=4"])
    assert train(r4).step == 4
    last = rows(run_dir)
    assert [m["step"] for m in last] == [1, 2, 3, 4] and last[3]["sft/epoch"] == 3
    assert last[3]["train/loss"] < losses[2]
    # the warm-up path: export, more likelihood for the trained responses, an RL run from it
    export = tmp_path / "sft-model"
    assert main(["export", str(run_dir), str(export)]) == 0
    base = resolve_model_path("tiny")
    tokenizer = AutoTokenizer.from_pretrained(base)
    record = load_sft_source(r.data, tokenizer, seed=0).next_prompt()
    assert response_logprob(export, tokenizer, record) > response_logprob(base, tokenizer, record) + 1.0
    rl = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [
        f"model.path={export}", f"run.output_dir={out}", "run.name=rl-after-sft",
        "run.num_steps=1", "rollout.engine.num_engines=1", "tracking.progress=false"])
    assert train(rl).step == 1
    assert json.loads((out / "rl-after-sft" / "metrics.jsonl").read_text())["train/samples"] > 0
    assert processes_with(str(tmp_path / "cache" / "models" / "tiny")) == []


def test_an_sft_recipe_refuses_what_needs_an_engine():
    with pytest.raises(ValueError, match="data.response_key"):
        load_recipe(None, ["train.algorithm.loss=sft"])
    with pytest.raises(ValueError, match="eval needs engines"):
        load_recipe(ROOT / "recipes" / "sft_smollm2_cpu.yaml", [
            "eval.datasets=[{name: h, path: 'builtin:arithmetic?split=test&rows=4'}]",
            "eval.every_steps=1"])
    with pytest.raises(ValueError, match="kl_coef and entropy_coef must be 0"):
        load_recipe(ROOT / "recipes" / "sft_smollm2_cpu.yaml", ["train.algorithm.kl_coef=0.1"])


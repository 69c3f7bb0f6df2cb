"""Supervised fine-tuning data (train.algorithm.loss: sft): each row's prompt, rendered exactly
as an RL run renders it (chat template, system prompt), followed by its response
(data.response_key) and the tokenizer's EOS, as a trainer sample whose response tokens are
trained (loss mask 1). The rows are a prompt source like an RL run's (seeded epochs, the
position saved with each checkpoint), whose labels are the responses."""

from __future__ import annotations

import json
from typing import Any

import torch

from rlkit.buffers.group import PromptRecord
from rlkit.config.schema import DataConfig
from rlkit.data.errors import DataError
from rlkit.data.prompts import DatasetPromptSource, load_prompts
from rlkit.train.batch import TrainSample


def load_sft_source(cfg: DataConfig, tokenizer: Any, seed: int) -> DatasetPromptSource:
    """The rows as a prompt source labelled with their responses; a row without the column is a
    bad row (data.on_bad_row), one whose response is not a non-empty string an error naming it."""
    if not cfg.response_key:
        raise DataError("train.algorithm.loss 'sft' needs data.response_key: the column with "
                        "each row's response (builtin:arithmetic has 'response')")
    dataset = load_prompts(cfg.model_copy(update={"label_key": cfg.response_key}), tokenizer)
    for row, cell in zip(dataset.table["row"], dataset.table["label"]):  # JSON, one column read
        response = json.loads(cell)
        if not isinstance(response, str) or not response.strip():
            raise DataError(f"{dataset.name}: row {row}: data.response_key {cfg.response_key!r} "
                            f"must hold a non-empty string, got {response!r:.60}")
    return DatasetPromptSource(dataset, seed=seed, shuffle=cfg.shuffle)


def sft_sample(record: PromptRecord, tokenizer: Any, index: int,
               max_response_tokens: int) -> tuple[TrainSample, bool]:
    """The trainer sample of one row (its response cut to `max_response_tokens`, EOS
    included), and whether it was cut."""
    ids = list(tokenizer(record.label, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    cut = len(ids) > max_response_tokens
    ids = ids[:max_response_tokens]
    n = len(ids)
    return TrainSample(
        index=index, group_id=index, tokens=torch.tensor([*record.ids, *ids], dtype=torch.long),
        prompt_length=len(record.ids), loss_mask=torch.ones(n), rollout_logprobs=torch.zeros(n),
        advantage=0.0, reward=0.0, min_version=0, max_version=0), cut

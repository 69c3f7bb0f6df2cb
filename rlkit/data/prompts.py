"""Prompt data: load, validate and tokenize once, then serve prompts in a seeded epoch order.

Every row is checked at load time, before the first step: a malformed row (missing prompt or
label key, empty or non-string prompt, malformed chat messages, over-long prompt, a jsonl line
that is not JSON) is either an error naming the file and row (`data.on_bad_row: error`) or
skipped and counted by reason (`skip`). Rows are kept tokenized in an Arrow table
(datasets.Dataset), so a large data set costs a few bytes per token, not a Python list each.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from rlkit.buffers.group import PromptRecord
from rlkit.buffers.source import EpochOrder
from rlkit.config.schema import DataConfig
from rlkit.data.errors import DataError
from rlkit.rollout.config import PromptDataConfig
from rlkit.rollout.eval_config import EvalConfig

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
TOKENIZE_CHUNK = 1024


class Tokenizer(Protocol):
    """The slice of a transformers tokenizer the prompt loader uses."""

    chat_template: Any

    def __call__(self, text: list[str], add_special_tokens: bool = ...) -> Any: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass
class PromptDataset:
    """Validated, tokenized prompts (one Arrow table) and what was skipped on the way."""

    name: str
    table: Any  # datasets.Dataset with columns row, text, prompt_ids, label, metadata (JSON)
    skipped: Counter[str] = field(default_factory=Counter)
    digest: str = ""

    def __len__(self) -> int:
        return len(self.table)

    def record(self, position: int, epoch: int = 0) -> PromptRecord:
        row = self.table[position]
        return PromptRecord(
            ids=tuple(row["prompt_ids"]),
            text=row["text"],
            label=json.loads(row["label"]),
            metadata=json.loads(row["metadata"]),
            source_index=row["row"],
            epoch=epoch,
        )


class DatasetPromptSource:
    """A PromptSource over a PromptDataset: cycles epochs in a seeded shuffle."""

    def __init__(self, dataset: PromptDataset, seed: int, shuffle: bool = True) -> None:
        self.dataset = dataset
        self._order = EpochOrder(len(dataset), seed, shuffle)

    def __len__(self) -> int:
        return len(self.dataset)

    def next_prompt(self) -> PromptRecord:
        position, epoch = self._order.next()
        return self.dataset.record(position, epoch)

    @property
    def epoch(self) -> int:
        return self._order.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"order": self._order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._order.load_state_dict(state["order"])

    def fingerprint(self) -> dict[str, Any]:
        return {"source": self.dataset.name, "rows": len(self.dataset), "digest": self.dataset.digest}

    def stats(self) -> dict[str, Any]:
        return {
            "epoch": self._order.epoch,
            "position": self._order.position,
            "rows": len(self.dataset),
            "skipped_rows": dict(self.dataset.skipped),
        }


# -- loading ---------------------------------------------------------------------------------
def load_eval_sets(cfg: EvalConfig, tokenizer: Tokenizer) -> dict[str, list[PromptRecord]]:
    """Every held-out dataset of the `eval` section, read by the `data` section's rules: a bad
    row fails here, before the run starts, naming the key, the file and the row. In file
    order (eval never shuffles), cut to each dataset's `limit`."""
    out = {}
    for i, d in enumerate(cfg.datasets):
        try:
            ds = load_prompts(d, tokenizer, key=f"eval.datasets[{i}]")
        except DataError as e:
            raise DataError(f"eval.datasets[{i}] ({d.name}): {e}") from None
        n = len(ds) if d.limit is None else min(d.limit, len(ds))
        out[d.name] = [ds.record(j) for j in range(n)]
    return out


def load_prompt_source(cfg: DataConfig, tokenizer: Tokenizer, seed: int) -> DatasetPromptSource:
    return DatasetPromptSource(load_prompts(cfg, tokenizer), seed=seed, shuffle=cfg.shuffle)


def load_prompts(cfg: PromptDataConfig, tokenizer: Tokenizer, key: str = "data") -> PromptDataset:
    """Read, validate and tokenize the prompts named by `cfg.path` (the recipe section at
    `key`, named in errors)."""
    import datasets

    name, rows = _read_rows(cfg.path)
    bad = _BadRows(name, cfg.on_bad_row, rows.where if isinstance(rows, _JsonlRows) else None, key)
    has_template = cfg.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
    kept: list[tuple[int, Any, Any, dict[str, Any]]] = []  # (row, prompt, label, metadata)
    for i, row in rows:
        if isinstance(row, _Unreadable):
            bad.add(i, "unreadable", row.reason)
            continue
        problem = _check_row(row, cfg, has_template)
        if problem is not None:
            bad.add(i, *problem)
            continue
        label = row.get(cfg.label_key) if cfg.label_key else None
        kept.append((i, row[cfg.prompt_key], label, {k: row[k] for k in cfg.metadata_keys}))

    columns: dict[str, list] = {"row": [], "text": [], "prompt_ids": [], "label": [], "metadata": []}
    digest = hashlib.sha256()
    for chunk_start in range(0, len(kept), TOKENIZE_CHUNK):
        chunk = kept[chunk_start : chunk_start + TOKENIZE_CHUNK]
        texts = [_render(p, has_template, cfg.system_prompt, tokenizer) for _, p, _, _ in chunk]
        ids = _encode(texts, has_template, tokenizer)
        for (i, _, label, meta), text, prompt_ids in zip(chunk, texts, ids):
            if len(prompt_ids) > cfg.max_prompt_tokens:
                bad.add(
                    i, "too_long",
                    f"prompt has {len(prompt_ids)} tokens > data.max_prompt_tokens "
                    f"({cfg.max_prompt_tokens})",
                )
                continue
            label_json = _json_cell(label, i, "label", bad)
            meta_json = _json_cell(meta, i, "metadata", bad)
            if label_json is None or meta_json is None:
                continue
            columns["row"].append(i)
            columns["text"].append(text)
            columns["prompt_ids"].append(prompt_ids)
            columns["label"].append(label_json)
            columns["metadata"].append(meta_json)
            digest.update(text.encode())
            digest.update(label_json.encode())
    if not columns["row"]:
        detail = f" (skipped: {dict(bad.counts)})" if bad.counts else ""
        raise DataError(f"{name}: no usable prompt rows{detail}")
    features = datasets.Features(
        {
            "row": datasets.Value("int64"),
            "text": datasets.Value("string"),
            "prompt_ids": datasets.Sequence(datasets.Value("int32")),
            "label": datasets.Value("string"),
            "metadata": datasets.Value("string"),
        }
    )
    table = datasets.Dataset.from_dict(columns, features=features)
    return PromptDataset(name, table, bad.counts, digest.hexdigest()[:16])


class _BadRows:
    def __init__(
        self, name: str, on_bad_row: str, where: Callable[[int], str] | None = None,
        key: str = "data",
    ) -> None:
        self.name, self.on_bad_row, self.key = name, on_bad_row, key
        self.where = where or (lambda row: f"row {row}")  # how a row is named to the user
        self.counts: Counter[str] = Counter()

    def add(self, row: int, reason: str, message: str) -> None:
        if self.on_bad_row == "error":
            raise DataError(
                f"{self.name}: {self.where(row)}: {message} "
                f"(set {self.key}.on_bad_row=skip to skip and count such rows)"
            )
        self.counts[reason] += 1


@dataclass
class _Unreadable:
    reason: str


def _read_rows(path: str) -> tuple[str, Iterable[tuple[int, Any]]]:
    """(display name, iterator of (row number, row dict or _Unreadable))."""
    if path.startswith("builtin:"):
        from rlkit.data.builtin import builtin_rows

        return path, enumerate(builtin_rows(path.removeprefix("builtin:")))
    p = Path(path)
    if not p.exists():
        raise DataError(f"{path}: prompt data not found")
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # datasets raises several types for a folder it cannot read
            raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise DataError(f"{path}: a DatasetDict without a 'train' split ({list(ds)})")
            ds = ds["train"]
        return path, enumerate(_iter_table(ds))
    if p.suffix in (".jsonl", ".json"):
        return path, _JsonlRows(p)
    if p.suffix == ".parquet":
        import datasets

        try:
            ds = datasets.Dataset.from_parquet(str(p), keep_in_memory=True)
        except Exception as e:
            raise DataError(f"{path}: cannot read as parquet ({e})") from None
        return path, enumerate(_iter_table(ds))
    raise DataError(f"{path}: unknown data format (expected .jsonl, .parquet or a dataset folder)")


def _iter_table(ds: Any) -> Iterator[dict[str, Any]]:
    for batch in ds.iter(batch_size=1024):
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys)):
            yield dict(zip(keys, values))


class _JsonlRows:
    """(row, parsed line) of a jsonl file, blank lines skipped; `where(row)` names a row by its
    line, which is what an editor shows. Parsed line by line (not by Arrow's JSON reader) so a
    bad line is reported where it is and a mixed-type column cannot fail the whole file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        # (first row after a run of blank lines, blank lines before it in all): a row's line is
        # row + 1 + its blanks, kept per run of blanks rather than per row
        self._blank_runs: list[tuple[int, int]] = []

    def where(self, row: int) -> str:
        k = bisect.bisect_right(self._blank_runs, (row, math.inf))
        return f"line {row + 1 + (self._blank_runs[k - 1][1] if k else 0)}"

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        with self.path.open(encoding="utf-8") as f:
            row = blanks = 0
            for line in f:
                if not line.strip():
                    blanks += 1
                    continue
                if blanks and (not self._blank_runs or self._blank_runs[-1][1] != blanks):
                    self._blank_runs.append((row, blanks))
                try:
                    yield row, json.loads(line)
                except json.JSONDecodeError as e:
                    yield row, _Unreadable(f"not valid JSON ({e.msg} at column {e.colno})")
                row += 1


def _check_row(row: Any, cfg: DataConfig, has_template: bool) -> tuple[str, str] | None:
    """(reason, message) for a malformed row, or None."""
    if not isinstance(row, dict):
        return "not_an_object", f"a row must be a JSON object, got {type(row).__name__}"
    if cfg.prompt_key not in row:
        return "missing_prompt", f"missing key {cfg.prompt_key!r} (data.prompt_key)"
    if cfg.label_key is not None and cfg.label_key not in row:
        return "missing_label", f"missing key {cfg.label_key!r} (data.label_key)"
    for key in cfg.metadata_keys:
        if key not in row:
            return "missing_metadata", f"missing key {key!r} (data.metadata_keys)"
    prompt = row[cfg.prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return "empty_prompt", "empty prompt"
        return None
    if isinstance(prompt, list):
        if not prompt:
            return "empty_prompt", "empty list of chat messages"
        for j, msg in enumerate(prompt):
            if not (
                isinstance(msg, dict)
                and msg.get("role") in CHAT_ROLES
                and isinstance(msg.get("content"), str)
            ):
                return "bad_messages", (
                    f"chat message {j} must be {{'role': one of {sorted(CHAT_ROLES)}, "
                    f"'content': str}}, got {msg!r:.80}"
                )
        if not has_template:
            return "bad_messages", (
                "chat messages need data.apply_chat_template: true and a tokenizer with a "
                "chat template"
            )
        return None
    return "non_string_prompt", (
        f"prompt must be a non-empty string or a list of chat messages, got "
        f"{type(prompt).__name__} {prompt!r:.40}"
    )


def _render(
    prompt: str | list[dict], has_template: bool, system_prompt: str | None, tokenizer: Tokenizer
) -> str:
    """The exact prompt text the model sees (chat template applied if asked and available)."""
    if not has_template:
        assert isinstance(prompt, str)  # _check_row refused messages without a template
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _encode(texts: Sequence[str], has_template: bool, tokenizer: Tokenizer) -> list[list[int]]:
    # A rendered chat template already holds its special tokens.
    encoded = tokenizer(list(texts), add_special_tokens=not has_template)["input_ids"]
    return [list(ids) for ids in encoded]


def _json_cell(value: Any, row: int, what: str, bad: _BadRows) -> str | None:
    try:
        return json.dumps(value)
    except (TypeError, ValueError) as e:
        bad.add(row, f"bad_{what}", f"{what} is not JSON-serialisable ({e})")
        return None

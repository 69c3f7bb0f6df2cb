"""Prompt data: bad rows are an error naming file and row, or skipped and counted; jsonl,
parquet and dataset folders load; the epoch order is seeded and resumable."""

import json

import datasets
import pytest

from rlkit.config.schema import DataConfig
from rlkit.data.prompts import DataError, load_prompt_source, load_prompts


class CharTokenizer:
    """One id per character: enough to test loading without a model."""

    chat_template = None

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[ord(c) % 256 for c in t] for t in texts]}


class TemplateTokenizer(CharTokenizer):
    chat_template = "{role}: {content}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": "1+1?", "label": "2"},
    {"question": "no prompt key", "label": "x"},
    {"prompt": "", "label": "x"},
    {"prompt": 42, "label": "x"},
    {"prompt": "no label"},
    "{not json",
    {"prompt": "2+2?", "label": "4"},
]


def test_bad_row_is_an_error_naming_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = DataConfig(path=str(f), apply_chat_template=False)
    with pytest.raises(DataError, match=r"p\.jsonl: line 2: missing key 'prompt'"):
        load_prompts(cfg, CharTokenizer())
    f2 = write_jsonl(tmp_path / "q.jsonl", [ROWS[0], ROWS[3]])
    with pytest.raises(DataError, match=r"q\.jsonl: line 2: prompt must be a non-empty string"):
        load_prompts(DataConfig(path=str(f2), apply_chat_template=False), CharTokenizer())
    # blank lines are skipped, and the line reported is still the one an editor shows
    f3 = tmp_path / "r.jsonl"
    f3.write_text('{"prompt": "a", "label": "1"}\n\n   \n{"prompt": ""}\n')
    with pytest.raises(DataError, match=r"r\.jsonl: line 4: "):
        load_prompts(DataConfig(path=str(f3), apply_chat_template=False), CharTokenizer())


def test_skip_mode_counts_bad_rows_by_reason(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = load_prompts(DataConfig(path=str(f), on_bad_row="skip", apply_chat_template=False),
                      CharTokenizer())
    assert len(ds) == 2
    assert dict(ds.skipped) == {
        "missing_prompt": 1, "empty_prompt": 1, "non_string_prompt": 1,
        "missing_label": 1, "unreadable": 1,
    }
    assert [ds.record(i).source_index for i in range(2)] == [0, 6]


def test_over_long_prompt_and_all_rows_bad(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * 50, "label": "1"}])
    cfg = DataConfig(path=str(f), apply_chat_template=False, max_prompt_tokens=10)
    with pytest.raises(DataError, match="line 1: prompt has 50 tokens > data.max_prompt_tokens"):
        load_prompts(cfg, CharTokenizer())
    with pytest.raises(DataError, match="no usable prompt rows"):
        load_prompts(cfg.model_copy(update={"on_bad_row": "skip"}), CharTokenizer())


def test_chat_messages_and_template(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "hi"}], "label": None},
        {"prompt": [{"role": "wizard", "content": "hi"}], "label": None},
        {"prompt": "plain", "label": None, "difficulty": 3},
    ]
    f = write_jsonl(tmp_path / "c.jsonl", rows)
    cfg = DataConfig(path=str(f), on_bad_row="skip", system_prompt="be brief")
    ds = load_prompts(cfg, TemplateTokenizer())
    assert dict(ds.skipped) == {"bad_messages": 1}
    assert ds.record(0).text == "<system>be brief<user>hi<assistant>"
    with pytest.raises(DataError, match="line 1: chat messages need"):
        load_prompts(cfg.model_copy(update={"on_bad_row": "error"}), CharTokenizer())
    meta = load_prompts(
        DataConfig(path=str(f), on_bad_row="skip", metadata_keys=["difficulty"]), TemplateTokenizer()
    )
    assert len(meta) == 1 and meta.record(0).metadata == {"difficulty": 3}


def test_parquet_and_dataset_folder(tmp_path):
    table = datasets.Dataset.from_list(
        [{"prompt": "a?", "label": "1"}, {"prompt": None, "label": "2"}, {"prompt": "b?", "label": "3"}]
    )
    table.to_parquet(str(tmp_path / "p.parquet"))
    table.save_to_disk(str(tmp_path / "folder"))
    for path in (tmp_path / "p.parquet", tmp_path / "folder"):
        cfg = DataConfig(path=str(path), apply_chat_template=False)
        with pytest.raises(DataError, match="row 1: prompt must be a non-empty string"):
            load_prompts(cfg, CharTokenizer())
        ds = load_prompts(cfg.model_copy(update={"on_bad_row": "skip"}), CharTokenizer())
        assert [ds.record(i).label for i in range(len(ds))] == ["1", "3"]


def test_unknown_paths_and_formats(tmp_path):
    with pytest.raises(DataError, match="prompt data not found"):
        load_prompts(DataConfig(path=str(tmp_path / "none.jsonl")), CharTokenizer())
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown data format"):
        load_prompts(DataConfig(path=str(tmp_path / "x.csv")), CharTokenizer())
    with pytest.raises(DataError, match="unknown built-in data set"):
        load_prompts(DataConfig(path="builtin:nope"), CharTokenizer())


def test_builtin_arithmetic_has_exact_answers():
    ds = load_prompts(DataConfig(path="builtin:arithmetic?rows=50&max_operand=9",
                                 apply_chat_template=False), CharTokenizer())
    assert len(ds) == 50
    for i in range(50):
        r = ds.record(i)
        a, op, b = r.text.split("?")[0].removeprefix("What is ").split()
        assert str(eval(f"{a}{op}{b}")) == r.label


def test_source_order_is_seeded_and_resumable(tmp_path):
    cfg = DataConfig(path="builtin:arithmetic?rows=5", apply_chat_template=False)
    tok = CharTokenizer()
    a = load_prompt_source(cfg, tok, seed=3)
    first = [(a.next_prompt().source_index, a.epoch) for _ in range(7)]
    assert sorted(i for i, e in first if e == 0) == [0, 1, 2, 3, 4]  # a whole epoch, shuffled
    state = a.state_dict()
    rest = [a.next_prompt().source_index for _ in range(6)]
    b = load_prompt_source(cfg, tok, seed=3)
    b.load_state_dict(state)
    assert [b.next_prompt().source_index for _ in range(6)] == rest
    assert a.fingerprint() == b.fingerprint()


def test_the_arithmetic_split_holds_out_problems_never_trained_on():
    from rlkit.data.builtin import builtin_rows

    train = [r["prompt"] for r in builtin_rows("arithmetic?split=train&rows=3000")]
    test = [r["prompt"] for r in builtin_rows("arithmetic?split=test&rows=1000")]
    assert len(train) == 3000 and len(set(test)) == len(test) > 20  # distinct held-out problems
    assert not set(train) & set(test)
    # the held-out part depends on the problem only: any seed or size trains around it
    other = {r["prompt"] for r in builtin_rows("arithmetic?split=train&rows=500&seed=7")}
    assert not other & set(test)
    assert [r["prompt"] for r in builtin_rows("arithmetic?split=test&rows=5")] == test[:5]
    # 'all' (the default) is the data set it always was: training and held-out problems alike
    every = {r["prompt"] for r in builtin_rows("arithmetic?rows=3000")}
    assert every & set(test) and every & set(train)
    for bad, words in (("split=dev", "split must be"), ("rows=x", "'rows' needs an integer"),
                       ("holdout=0", "holdout is a percent")):
        with pytest.raises(DataError, match=words):
            builtin_rows(f"arithmetic?{bad}")


def test_eval_sets_load_by_the_data_rules_and_a_bad_row_names_the_eval_key(tmp_path):
    from rlkit.data.prompts import load_eval_sets
    from rlkit.rollout.eval_config import EvalConfig

    good = write_jsonl(tmp_path / "good.jsonl", [{"q": f"{i}+1?", "a": str(i + 1)} for i in range(5)])
    cfg = EvalConfig(every_steps=1, datasets=[
        {"name": "a", "path": str(good), "prompt_key": "q", "label_key": "a",
         "apply_chat_template": False, "limit": 3},
        {"name": "b", "path": "builtin:arithmetic?split=test&rows=4", "apply_chat_template": False},
    ])
    sets = load_eval_sets(cfg, CharTokenizer())
    assert [r.label for r in sets["a"]] == ["1", "2", "3"]  # file order, cut to the limit
    assert len(sets["b"]) == 4
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1?", "label": "1"}, {"prompt": ""}])
    cfg = EvalConfig(every_steps=1, datasets=[
        {"name": "a", "path": str(good), "prompt_key": "q", "label_key": "a"},
        {"name": "broken", "path": str(bad), "apply_chat_template": False},
    ])
    with pytest.raises(DataError, match=r"eval\.datasets\[1\] \(broken\): .*bad\.jsonl: line 2: .*"
                                        r"eval\.datasets\[1\]\.on_bad_row=skip"):
        load_eval_sets(cfg, CharTokenizer())

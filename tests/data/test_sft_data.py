"""SFT rows (rlkit/data/sft.py): the prompt rendered as for RL, the response and EOS after it,
trained whole; a response cut at the cap is said so; a row without a usable response is named."""

import pytest

from rlkit.config.schema import DataConfig
from rlkit.data.prompts import DataError
from rlkit.data.sft import load_sft_source, sft_sample
from tests.data.test_prompts import CharTokenizer, write_jsonl


class EosTokenizer(CharTokenizer):
    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=True):  # one text: one list, as HF's
        if isinstance(texts, str):
            return {"input_ids": super().__call__([texts])["input_ids"][0]}
        return super().__call__(texts, add_special_tokens)


def test_a_row_is_its_prompt_then_its_response_and_eos(tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1?", "response": "2"}])
    source = load_sft_source(DataConfig(path=str(data), response_key="response"), EosTokenizer(), 0)
    sample, cut = sft_sample(source.next_prompt(), EosTokenizer(), 7, max_response_tokens=8)
    assert sample.tokens.tolist() == [ord(c) for c in "1+1?"] + [ord("2"), 0] and not cut
    assert (sample.prompt_length, sample.loss_mask.tolist(), sample.index) == (4, [1.0, 1.0], 7)
    short, cut = sft_sample(source.next_prompt(), EosTokenizer(), 0, max_response_tokens=1)
    assert short.tokens.tolist()[4:] == [ord("2")] and cut


def test_a_row_without_a_usable_response_is_named(tmp_path):
    data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "response": "b"},
                                                {"prompt": "c", "response": ""}])
    with pytest.raises(DataError, match=r"row 1: data.response_key 'response' must hold a non-empty"):
        load_sft_source(DataConfig(path=str(data), response_key="response"), EosTokenizer(), 0)
    with pytest.raises(DataError, match="needs data.response_key"):
        load_sft_source(DataConfig(path=str(data)), EosTokenizer(), 0)
    missing = write_jsonl(tmp_path / "none.jsonl", [{"prompt": "a"}])
    with pytest.raises(DataError, match="missing key 'response'"):
        load_sft_source(DataConfig(path=str(missing), response_key="response"), EosTokenizer(), 0)

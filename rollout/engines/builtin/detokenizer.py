"""Text for the HTTP process: the tokenizer, and incremental detokenization for streams.

`load_tokenizer` is transformers' AutoTokenizer, exactly what the trainer and the data side use:
transformers may replace parts of a tokenizer.json by model-specific logic (Qwen2's pre-tokenizer,
added BOS), so reading tokenizer.json directly would tokenize some text prompts differently.

`IncrementalDetokenizer`: O(1) work per token instead of decoding the whole output at every
chunk. The window technique of vLLM/SGLang's detokenizers: decode a few tokens before the unread
ones as context (so merges across the boundary are right), emit only what the new tokens add,
and hold back text that ends in an incomplete UTF-8 sequence until the next token completes it.
"""

from __future__ import annotations

from typing import Any


class TextCodec:
    """encode/decode over a transformers tokenizer."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str) -> TextCodec:
    return TextCodec(path)


_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, ids: list[int]) -> str:
        """Feed the full output so far; return the text it adds since the last call."""
        if len(ids) <= self._read_offset:
            return ""
        prefix = self._decode(ids[self._prefix_offset:self._read_offset])
        full = self._decode(ids[self._prefix_offset:])
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more tokens
            return ""
        new = full[len(prefix):] if full.startswith(prefix) else full
        self.text += new
        self._prefix_offset = max(0, len(ids) - _CONTEXT_TOKENS)
        self._read_offset = len(ids)
        return new

    def finish(self, ids: list[int]) -> str:
        """The last piece: whatever a full decode of the output has beyond what was emitted
        (text held back for an incomplete character, or a merge the window missed)."""
        full = self._decode(ids)
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        self._read_offset = len(ids)
        return rest

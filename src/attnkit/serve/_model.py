"""Loading a Hugging Face model directory (config, safetensors weights, tokenizer files) from local disk as an
attnkit :class:`~attnkit.nn.DecoderLM` with its tokenizer, and writing a small one for demos and tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ServedModel", "load_model_dir", "make_demo_model"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class ServedModel:
    """A converted model ready to serve: the attnkit ``model``, the HF ``tokenizer``, the ``name`` clients ask
    for, the end-of-sequence ids and the longest prompt plus output (``max_context``) the model takes."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    eos_ids: tuple[int, ...]
    max_context: int
    family: str


def _eos_ids(path: Path, hf_config, tokenizer) -> tuple[int, ...]:
    """The ids that end a generation: ``generation_config.json``'s, else the config's, else the tokenizer's."""
    from transformers import GenerationConfig

    found = None
    if (path / "generation_config.json").is_file():
        found = GenerationConfig.from_pretrained(path).eos_token_id
    if found is None:
        found = getattr(hf_config, "eos_token_id", None)
    if found is None:
        found = tokenizer.eos_token_id
    if found is None:
        return ()
    return tuple(int(t) for t in (found if isinstance(found, (list, tuple)) else [found]))


def load_model_dir(
    path, *, name: str | None = None, dtype: str = "float32", device: str = "cpu", backend: str = "auto"
) -> ServedModel:
    """Load the Hugging Face model directory ``path`` (no downloads) and convert it with
    :func:`attnkit.integrations.hf.from_hf`; ``name`` (default: the folder's name) is the model id clients
    use.  A ValueError names what is wrong: no such folder, no tokenizer, a family attnkit does not convert
    (with the list of those it does)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..integrations.hf import FAMILIES
    from ..integrations.hf import from_hf

    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"model directory {str(path)!r} does not exist (give a folder holding config.json, the "
            f"safetensors weights and the tokenizer files)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} holds no config.json: it is not a Hugging Face model directory")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {', '.join(_DTYPES)}")
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(
            f"{str(path)!r} holds a {family!r} model, which attnkit does not convert; supported "
            f"families (config.json's model_type): {', '.join(FAMILIES)}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r}: no tokenizer could be loaded from the folder ({e})") from None
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], local_files_only=True)
    model = from_hf(hf_model.to(device).eval(), backend=backend).eval()
    del hf_model
    return ServedModel(
        model,
        tokenizer,
        name or path.resolve().name,
        _eos_ids(path, hf_config, tokenizer),
        int(model.config.max_seq_len),
        family,
    )


# ------------------------------------------------------------------------------ a demo model directory

_CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _words(n: int) -> list[str]:
    """``n`` distinct lowercase words made of consonant-vowel syllables (``ba``, ``be``, ... ``bab`` ...)."""
    cons, vows = "bdfgklmnprstvz", "aeiou"
    syll = [c + v for c in cons for v in vows]
    out = list(syll)
    for a in syll:
        for b in syll:
            out.append(a + b)
    return out[:n]


def make_demo_model(
    path,
    *,
    vocab_words: int = 250,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    """Write a small random-weight Llama model directory to ``path`` (config, safetensors weights, generation
    config and a word-level tokenizer with a chat template, all built here): something to serve without a
    download.  Its text is made-up words; returns the folder.

    Example::

        >>> import tempfile
        >>> from attnkit.serve import load_model_dir, make_demo_model
        >>> served = load_model_dir(make_demo_model(tempfile.mkdtemp() + "/tiny"))
        >>> served.family, served.tokenizer.decode(served.tokenizer("ba be bi").input_ids)
        ('llama', 'ba be bi')
    """
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<user>", "<assistant>", "<system>"]
    vocab = {w: i for i, w in enumerate(specials + _words(vocab_words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(path)
    return path

"""The shared flag check and every bool option of the public API that takes it: a string such as "no" is
truthy, so each option refuses it (and None, and numbers) with a TypeError naming the option, before any work."""

import numpy as np
import pytest
import torch

import attnkit
from attnkit import bias, masks, nn
from attnkit._checks import flag
from attnkit.cache import PagedCache
from attnkit.quantization import BF16Linear, Int8Linear

NONE_MEANS_DEFAULT = ("out_bias", "qkv_bias", "ffn_bias", "grad")  # None: follow bias / whatever requires grad
NAMED_CHOICES = ("qk_norm",)  # a flag or a named layout ("head", "all"): another string is a ValueError
BOOL_FIELDS = (
    "rope_interleaved",
    "norm_first",
    "qkv_bias",
    "out_bias",
    "ffn_bias",
    "qk_norm",
    "post_norms",
    "tie_embeddings",
)


def test_flag_takes_bools_and_refuses_the_rest():
    assert flag("x", True) is True and flag("x", False) is False
    assert flag("x", np.bool_(True)) is True and flag("x", torch.tensor(False)) is False
    for bad in ("no", "False", "", None, 1, 0, 1.0, np.int64(1), [True], torch.tensor([True, False]), torch.tensor(1)):
        with pytest.raises(TypeError, match=r"^x must be True or False, got "):
            flag("x", bad)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return nn.DecoderLM(nn.DecoderConfig.preset("tiny"))


def _entries(model):
    """(flag name, call with the flag set to the given value) for every bool option; an option whose name is
    in NONE_MEANS_DEFAULT takes None too."""
    x = torch.randn(1, 3, 8)
    mha, single = nn.MultiHeadAttention(8, 2), nn.SingleHeadAttention(8, 4)
    additive = nn.AdditiveAttention(8, 8, 4)
    table = torch.zeros(2, 8)
    q = torch.randn(1, 1, 2, 4, dtype=torch.float64)
    yield "stream", lambda f: attnkit.generate(model, [[1]], 1, stream=f)
    yield "compile", lambda f: attnkit.generate(model, [[1]], 1, compile=f)
    yield "relayout", lambda f: attnkit.generate(model, [[1]], 1, relayout=f)
    for name in ("preempt", "prefix_caching", "relayout"):
        yield name, lambda f, n=name: attnkit.Engine(model, 8, 4, 2, **{n: f})
    yield "prefix_caching", lambda f: PagedCache(1, 4, 4, n_kv_heads=1, d_head=2, prefix_caching=f)
    yield "prefix_caching", lambda f: PagedCache.for_model(model, 4, 4, prefix_caching=f)
    for name in ("bias", "qk_norm", "out_bias"):
        yield name, lambda f, n=name: nn.MultiHeadAttention(8, 2, **{n: f})
    yield "need_weights", lambda f: mha(x, need_weights=f)
    yield "need_weights", lambda f: single(x, need_weights=f)
    yield "need_weights", lambda f: additive(x, x, need_weights=f)
    for name in ("norm_first", "cross_attention", "bias", "qkv_bias", "out_bias", "ffn_bias", "qk_norm", "post_norms"):
        yield name, lambda f, n=name: nn.TransformerBlock(8, 2, **{n: f})
    yield "cross_attention", lambda f: nn.Decoder(8, 1, 2, cross_attention=f)
    yield "interleaved", lambda f: nn.RotaryEmbedding(8, interleaved=f)
    yield "bidirectional", lambda f: nn.T5RelativeBias(2, bidirectional=f)
    yield "bias", lambda f: nn.Linear(4, 3, bias=f)
    yield "bias", lambda f: nn.FeedForward(4, 8, bias=f)
    yield "distinct", lambda f: nn.tasks.copy_task(1, distinct=f)
    for name in BOOL_FIELDS:
        yield name, lambda f, n=name: nn.DecoderConfig.preset("tiny", **{n: f})
    yield "bidirectional", lambda f: bias.t5_bucket(torch.arange(-3, 3), bidirectional=f)
    yield "bidirectional", lambda f: bias.relative_buckets(table, bidirectional=f)
    yield "bias", lambda f: Int8Linear(4, 3, bias=f)
    yield "bias", lambda f: BF16Linear(4, 3, bias=f)
    yield "return_lse", lambda f: attnkit.attention(q, q, q, return_lse=f)
    yield "grad", lambda f: attnkit.testing.check_against_oracle(attnkit.attention, q, q, q, grad=f)
    yield "causal", lambda f: masks.strided(2, causal=f)


def test_every_bool_option_refuses_strings_none_and_numbers(tiny):
    entries = list(_entries(tiny))
    wrong = []
    for i, (name, call) in enumerate(entries):
        for bad in ("no", 1) if name in NONE_MEANS_DEFAULT else ("no", None, 1):
            try:
                call(bad)
                wrong.append(f"entry {i} ({name}={bad!r}): accepted")
            except ValueError as e:
                if not (
                    name in NAMED_CHOICES and isinstance(bad, str) and str(e).startswith(f"{name}={bad!r} must be")
                ):
                    wrong.append(f"entry {i} ({name}={bad!r}): {e}")
            except TypeError as e:
                if not str(e).startswith(f"{name} must be True or False, got "):
                    wrong.append(f"entry {i} ({name}={bad!r}): {e}")
    assert not wrong, "\n".join(wrong)
    for _name, call in entries:  # and each takes a real bool (here False, as numpy's)
        call(np.bool_(False))


def test_a_refused_flag_changes_nothing(tiny):
    """Checked before any work: the model's mode and weights' layout stay as they were."""
    tiny.train()
    strides = [p.stride() for p in tiny.parameters()]
    with pytest.raises(TypeError, match="preempt"):
        attnkit.Engine(tiny, 8, 4, 4, preempt="no")
    with pytest.raises(TypeError, match="stream"):
        attnkit.generate(tiny, [[1], [2], [3], [4]], 2, stream="yes")
    assert tiny.training and [p.stride() for p in tiny.parameters()] == strides
    tiny.eval()

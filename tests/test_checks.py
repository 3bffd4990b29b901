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


def test_scalar_arguments_are_checked_by_the_shared_checks_with_name_value_and_fix():
    """Inline checks of scalar arguments moved to attnkit._checks: each message names the argument, the value
    and what to pass, and integral numbers (numpy's too) are taken as ints."""
    from attnkit.backends.flash import flash_attention
    from attnkit.cache import quantize_groups
    from attnkit.decoding import SamplingParams, Speculation
    from attnkit.diagnostics import Thresholds, probe

    q = torch.randn(1, 1, 4, 8)
    cases = [
        (lambda: SamplingParams(temperature=-1), r"temperature=-1 must be >= 0.0 \(0 is greedy\)"),
        (lambda: SamplingParams(temperature=float("nan")), r"temperature=nan must be a finite number \(0 is greedy\)"),
        (lambda: SamplingParams(top_k=0), r"top_k=0 must be an int >= 1 or None"),
        (lambda: SamplingParams(top_p=0), r"top_p=0 must be > 0.0 \(a probability mass\) or None"),
        (lambda: SamplingParams(top_p=1.5), r"top_p=1.5 must be <= 1.0 \(a probability mass\) or None"),
        (lambda: SamplingParams(eos_id=-1), r"eos_id=-1 must be an int >= 0 \(a token id\), a list of them, or None"),
        (lambda: SamplingParams(logprobs=-1), r"logprobs=-1 must be an int >= 0 \(the number of most likely"),
        (lambda: Speculation(prompt_lookup=True, num_tokens=0), r"num_tokens=0 must be an int >= 1 \(tokens proposed"),
        (lambda: flash_attention(q, q, q, block_q=0), r"block_q=0 must be an int >= 1 \(or None for the default 128\)"),
        (lambda: flash_attention(q, q, q, block_k=2.0), r"block_k=2.0 must be an int >= 1 \(or None for the default"),
        (
            lambda: quantize_groups(q, dim=4, bits=8),
            r"quantize_groups: dim=4 must be an int in \[-4, 4\) for x of shape",
        ),
        (lambda: Thresholds(sharp_heads=0), r"sharp_heads=0 must be > 0.0 \(a fraction in \(0, 1\]\)"),
        (lambda: Thresholds(vanishing_ratio=1.0), r"vanishing_ratio=1.0 must be < 1.0"),
        (lambda: probe(torch.nn.Linear(2, 2), max_elements=-1).__enter__(), r"max_elements=-1 must be an int >= 0 \(w"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    params = SamplingParams(top_k=np.int64(3), eos_id=np.int32(2), logprobs=np.int64(1))
    assert (params.top_k, params.eos_id, params.logprobs) == (3, 2, 1)
    assert all(type(x) is int for x in (params.top_k, params.logprobs))
    assert Speculation(prompt_lookup=True, num_tokens=np.int64(2)).num_tokens == 2

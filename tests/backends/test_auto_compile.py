"""``backend="auto"`` under ``torch.compile``: while dynamo traces, auto makes the eager choice (math for
decode-sized CPU calls), and flash runs as its custom operators, so a model with the default backend compiles
to one graph (``fullgraph=True``) and computes what it computes eagerly."""

from __future__ import annotations

import functools

import pytest
import torch

import attnkit
from attnkit import backends
from attnkit import masks as M
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.testing import check_against_oracle, random_qkv


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # traced from scratch, one thread


def _qkv(L, *, grad=True):
    return random_qkv(1, 4, 2, L, L, 16, requires_grad=grad)


# Each case: DecoderConfig overrides, sequence length, what eager auto picks, what auto picks while tracing.
CASES = {
    "default": (dict(), 24, "sdpa", "sdpa"),
    "sliding_window": (dict(mask=M.sliding_window(15)), 256, "flash", "flash"),
    "softcap": (dict(softcap=5.0), 256, "flash", "flash"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_default_backend_model_compiles_to_one_graph_and_matches_eager(case):
    overrides, L, eager_pick, traced_pick = CASES[case]
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, **overrides)
    assert cfg.backend == "auto"
    model = DecoderLM(cfg).double().eval()  # float64: eager and compiled may run different backends
    ids = torch.randint(0, 32, (1, L), generator=torch.Generator().manual_seed(1))

    # what a layer's attention call looks like: (1, 4, L, 8) queries against (1, 2, L, 8) keys
    q = torch.randn(1, 4, L, 8, dtype=torch.float64)
    k = torch.randn(1, 2, L, 8, dtype=torch.float64)
    kw = dict(
        mask=M.causal() & overrides["mask"] if "mask" in overrides else M.causal(), softcap=overrides.get("softcap")
    )
    text = backends.explain(q, k, k, **kw)
    assert text.startswith(f"auto picks {eager_pick!r}"), text
    assert text.splitlines()[-1].startswith(f"under torch.compile auto picks {traced_pick!r}"), text

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: any graph break raises
    with torch.no_grad():
        expected = model(ids)
        got = compiled(ids)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    # eager decisions are unaffected by tracing
    assert backends.explain(q, k, k, **kw).startswith(f"auto picks {eager_pick!r}")


def test_compiled_attention_with_gradients_against_the_oracle():
    """attnkit.attention itself, compiled with fullgraph=True where eager auto would pick flash: forward
    and backward under the numerical rule."""
    q, k, v = _qkv(256)
    mask = M.causal() & M.sliding_window(15)
    assert backends.explain(q, k, v, mask=mask).startswith("auto picks 'flash'")
    compiled = torch.compile(attnkit.attention, fullgraph=True, backend="aot_eager")
    report = check_against_oracle(compiled, q, k, v, mask=mask)
    assert set(report) == {"out", "dq", "dk", "dv"}, report


def test_compiled_sdpa_with_rows_that_see_no_key():
    """Lq > Lk with a causal mask: the first rows see nothing (output 0, zero gradients), also when traced."""
    q, k, v = _qkv(8)
    q = q[:, :, :, :].detach().repeat(1, 1, 2, 1).requires_grad_()  # (1, 4, 16, 16) against 8 keys
    assert "under torch.compile auto picks 'sdpa'" in backends.explain(q, k, v, mask=M.causal())
    compiled = torch.compile(attnkit.attention, fullgraph=True, backend="aot_eager")
    check_against_oracle(compiled, q, k, v, mask=M.causal())
    out = compiled(q, k, v, mask=M.causal())
    assert out[:, :, :8].abs().max() == 0 and out[:, :, 8:].abs().min() > 0


def test_explain_names_the_pick_under_compile_only_for_auto():
    q, k, v = _qkv(32, grad=False)
    last = backends.explain(q, k, v, mask=M.causal()).splitlines()[-1]
    assert last == "under torch.compile auto picks 'sdpa' too"
    decode = backends.explain(q[:, :, -1:], k, v, mask=M.causal()).splitlines()[-1]
    assert decode == "under torch.compile auto picks 'math' (a decode-sized CPU call, which Inductor fuses)"
    q.requires_grad_()  # training: the fused kernel's backward, not traced math
    assert backends.explain(q[:, :, -1:], k, v).splitlines()[-1].startswith("under torch.compile auto picks 'sdpa'")
    assert backends.explain(q, k, v, softcap=3.0).splitlines()[-1] == "under torch.compile auto picks 'math' too"
    assert "under torch.compile" not in backends.explain(q, k, v, backend="flash")


def test_named_backend_is_kept_under_compile():
    """Only auto changes while tracing: a named backend still runs (math here, which traces)."""
    q, k, v = _qkv(16, grad=False)
    compiled = torch.compile(functools.partial(attnkit.attention, backend="math"), fullgraph=True, backend="aot_eager")
    check_against_oracle(compiled, q, k, v, softcap=3.0, grad=False)
    # (dynamo reports the ValueError raised while tracing as Unsupported, with the message)
    with pytest.raises(
        (ValueError, torch._dynamo.exc.Unsupported), match="backend='sdpa' cannot take this call: SDPA has no softcap"
    ):
        torch.compile(functools.partial(attnkit.attention, backend="sdpa"), fullgraph=True, backend="aot_eager")(
            q, k, v, softcap=3.0
        )


def test_a_key_padding_mask_traces_into_one_graph():
    """Its length check reads tensor values: an assertion in the graph while traced (eager calls raise)."""
    q, k, v = _qkv(16, grad=False)
    q, k, v = (t.expand(2, -1, -1, -1) for t in (q, k, v))
    mask = M.key_padding(torch.tensor([16, 9]))
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attnkit.attention(q, k, v, mask=mask, backend="math"))


def test_rotary_stacks_and_layers_compile_to_one_graph():
    """Encoder, Decoder, EncoderDecoder and a lone MultiHeadAttention with rotary positions: default positions
    are offset + arange(L), so the rotary tables are gathered without reading the positions tensor (its
    min/max broke the graph)."""
    from attnkit.nn import Decoder, Encoder, EncoderDecoder, MultiHeadAttention, RotaryEmbedding

    torch.manual_seed(0)
    ed = EncoderDecoder(DecoderConfig.preset("tiny", d_model=32, n_heads=4, n_layers=2)).eval()
    src, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 5))
    x, ctx = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    calls = [
        (ed, (src, tgt)),
        (Encoder(32, 2, 4, positions=RotaryEmbedding(8)).eval(), (x,)),
        (Decoder(32, 2, 4, cross_attention=True, positions=RotaryEmbedding(8)).eval(), (x, ctx)),
        (MultiHeadAttention(32, 4, positions=RotaryEmbedding(8)).eval(), (x,)),
    ]
    with torch.no_grad():
        for module, args in calls:
            torch._dynamo.reset()
            got = torch.compile(module, fullgraph=True, backend="aot_eager")(*args)
            torch.testing.assert_close(got, module(*args), rtol=1e-5, atol=1e-5)

"""attnkit inside ``torch.compile`` and ``torch.export``: the flash backend as custom operators (opcheck; the
triton backend's operators are tested under Triton's interpreter in ``test_triton_ops.py``), auto
making the eager choice while traced, each mask family compiled with ``fullgraph=True`` through each backend
that takes it (forward and backward against the float64 oracle), no recompiles and no replanning in a
fixed-shape loop.  The functions are compiled with ``backend="aot_eager"`` (the graph capture and autograd
of torch.compile without Inductor's code generation) except one Inductor run; shapes are small."""

from __future__ import annotations

import functools

import pytest
import torch
import torch._dynamo.testing

import attnkit
from attnkit import backends
from attnkit import bias as B
from attnkit import masks as M
from attnkit.backends import operators as O
from attnkit.backends.flash import custom_ops as C
from attnkit.backends.flash import plan as _flash_plan
from attnkit.testing import check_against_oracle
from attnkit.testing import random_qkv


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # traced from scratch, one thread


def _qkv(L=96, *, hq=4, hkv=2, d=16, dtype=torch.float64, grad=True, seed=0):
    return random_qkv(1, hq, hkv, L, L, d, dtype=dtype, requires_grad=grad, seed=seed)


def _graph_ops(fn, *args, **kwargs) -> str:
    """The code of the graph(s) dynamo captures for ``fn(*args, **kwargs)`` (fullgraph)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    torch.compile(fn, fullgraph=True, backend=capture)(*args, **kwargs)
    return "\n".join(graphs)


# ------------------------------------------------------------------------------ operators


def test_opcheck_forward_and_backward():
    q, k, v = _qkv(40)
    mask_key = O.intern(O.describe(M.causal() & M.sliding_window(9))[0])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64, requires_grad=True)
    mod_desc, mod_tensors = O.describe(B.alibi(slopes))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(
        C.flash_forward, (q, k, v, mask_key, [], None, O.intern(mod_desc), mod_tensors, sinks, 0.3, 0.0, 0.0, None)
    )
    doc = M.document(torch.tensor([0] * 15 + [1] * 25))
    doc_desc, doc_tensors = O.describe(doc)
    fwd = (q, k, v, O.intern(doc_desc), doc_tensors, None, "", [], None, 0.3, 2.0, 0.0, None)
    torch.library.opcheck(C.flash_forward, fwd)
    out, lse, bare = C.flash_forward(*fwd)
    detached = [t.detach() for t in (q, k, v, out, lse, bare)]
    torch.library.opcheck(
        C.flash_backward,
        (
            torch.randn_like(out),
            None,
            *detached,
            O.intern(doc_desc),
            doc_tensors,
            None,
            "",
            [],
            None,
            0.3,
            2.0,
            0.0,
            None,
            False,
            False,
            [],
        ),
    )


def test_constant_results_are_marked_as_dynamo_marks_them():
    def probe():
        return 0

    assert (
        vars(torch._dynamo.assume_constant_result(probe))
        == vars(O.constant_result(lambda: 0))
        == {"_dynamo_marked_constant": True}
    )


def test_describe_and_rebuild_round_trip():
    ids = torch.tensor([0, 0, 1, 1, 1])
    mask = (M.causal() & M.document(ids)) | ~M.sliding_window(2)
    desc, tensors = O.describe(mask)
    assert len(tensors) == 1 and tensors[0].data_ptr() == ids.data_ptr()  # (a view of ids)
    key = O.intern(desc)
    assert key == O.intern(O.describe((M.causal() & M.document(ids)) | ~M.sliding_window(2))[0])  # by value
    rebuilt = O.rebuild(key, tensors)
    assert rebuilt is O.rebuild(key, tensors)  # kept: the eager plan cache finds its plans
    torch.testing.assert_close(rebuilt.to_dense(5, 5), mask.to_dense(5, 5))
    with pytest.raises(RuntimeError, match="traced in another process"):
        O.rebuild("no such key", [])


# ------------------------------------------------------------------- masks through backends


MASKS = {
    "causal": lambda L: M.causal(),
    "sliding_window": lambda L: M.causal() & M.sliding_window(15),
    "document": lambda L: M.causal() & M.document(torch.arange(L) * 3 // L),
    "block_sparse": lambda L: M.random_blocks(16, 2, seed=3) | M.block_local(16),
    "prefix_global": lambda L: M.prefix_lm(20) | M.global_tokens(torch.tensor([0, 5])),
    "key_padding": lambda L: M.key_padding(torch.tensor([L - 7])) & M.dilated(8, 2),
    "dense_tensor": lambda L: torch.rand(L, L, generator=torch.Generator().manual_seed(1)) > 0.4,
}


@functools.lru_cache(maxsize=None)
def _compiled(backend: str):
    return torch.compile(functools.partial(attnkit.attention, backend=backend), fullgraph=True, backend="aot_eager")


@pytest.mark.parametrize("family", sorted(MASKS))
def test_each_mask_family_compiles_through_flash_forward_and_backward(family):
    q, k, v = _qkv()
    mask = MASKS[family](q.shape[2])
    check_against_oracle(_compiled("flash"), q, k, v, mask=mask)
    assert "attnkit.flash_forward" in _graph_ops(
        functools.partial(attnkit.attention, backend="flash"), q, k, v, mask=mask
    )


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("family", ["sliding_window", "document"])
def test_mask_families_compile_through_the_traced_backends(backend, family):
    q, k, v = _qkv(48)
    check_against_oracle(_compiled(backend), q, k, v, mask=MASKS[family](48))


# Each case: attention keyword arguments (auto under compile must run the eager pick, with gradients).
def _modifier_cases():
    slopes = torch.tensor(B.alibi_slopes(4).tolist(), dtype=torch.float64, requires_grad=True)
    table = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    temps = torch.tensor([2.0, 1.0, 0.5, 1.5], dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    bias = torch.randn(1, 4, 96, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    return {
        "alibi": dict(mask=M.causal() & M.sliding_window(31), bias=B.alibi(slopes)),
        "t5": dict(mask=M.causal(), bias=B.relative_buckets(table)),
        "temperature": dict(mask=M.sliding_window(20), bias=B.temperature(temps)),
        "tensor_bias": dict(mask=M.causal() & M.sliding_window(31), bias=bias),
        "softcap_lse": dict(mask=M.causal() & M.sliding_window(31), softcap=3.0, return_lse=True),
        "sinks": dict(mask=M.causal() & M.sliding_window(31), sinks=sinks, return_lse=True),
    }


@pytest.mark.parametrize("case", ["alibi", "t5", "temperature", "tensor_bias", "softcap_lse", "sinks"])
def test_modifiers_softcap_lse_sinks_gqa_through_the_operator_match_eager_with_gradients(case):
    """Built-in modifiers (their learnable tensors too), tensor biases, softcap, return_lse, sinks and grouped
    query heads are arguments of the operator: compiled flash matches eager flash, gradients included."""
    kw = _modifier_cases()[case]
    q, k, v = _qkv()  # grouped-query: 4 query heads on 2 key/value heads
    assert "attnkit.flash_forward" in _graph_ops(functools.partial(attnkit.attention, backend="flash"), q, k, v, **kw)
    got = _compiled("flash")(q, k, v, **kw)
    want = attnkit.attention(q, k, v, **kw, backend="flash")
    leaves = [q, k, v] + [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    bias = kw.get("bias")
    if bias is not None and not isinstance(bias, torch.Tensor):
        leaves += [t for t in vars(bias).values() if isinstance(t, torch.Tensor) and t.requires_grad]
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    loss = sum((x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum() for x in got)
    ref = sum((x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum() for x in want)
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_dropout_through_the_operator():
    """Dropout's seed is drawn in the graph; the backward regenerates the forward's pattern (gradients match
    the mask that the output shows: dv of a call with v = I is the kept weights' pattern)."""
    torch.manual_seed(0)
    q, k, _ = _qkv(64, hq=2, hkv=2, d=64, dtype=torch.float32)
    v = torch.eye(64).expand(1, 2, 64, 64).clone().requires_grad_()
    out = _compiled("flash")(q, k, v, mask=M.causal(), dropout_p=0.5)
    weights = out.detach()  # with v = I the output is the dropped, rescaled weights
    assert 0.3 < float((weights == 0).float().mean()) < 0.8
    (out * 2).sum().backward()
    # d out / d v[j] sums the kept weights of column j: the same pattern as the forward's
    torch.testing.assert_close(v.grad[0, :, :, 0], 2 * weights.sum(-2)[0], rtol=1e-5, atol=1e-5)


AUTO_CASES = {
    "causal": dict(mask=M.causal()),
    "sliding_window": dict(mask=M.causal() & M.sliding_window(15)),
    "document_or_global": dict(mask=M.document(torch.arange(96) // 40) | M.global_tokens(torch.tensor([3]))),
    "strided_fixed": dict(mask=M.strided(16) & M.causal()),
    "dense_tensor": dict(mask=torch.ones(96, 96, dtype=torch.bool).tril()),
    "softcap": dict(softcap=5.0),
    "dropout_no_mask": dict(dropout_p=0.1),
    "alibi": dict(bias=B.alibi(B.alibi_slopes(4))),
}


def test_auto_picks_under_compile_what_it_picks_eagerly():
    """For each case, the backend in the traced graph is the one explain names for eager auto, and explain's
    last line says so."""
    q, k, v = _qkv(96, dtype=torch.float32, grad=False)
    for name, kw in AUTO_CASES.items():
        text = backends.explain(q, k, v, **kw)
        pick = text.splitlines()[0].split("'")[1]
        assert text.splitlines()[-1].startswith(f"under torch.compile auto picks {pick!r} too"), (name, text)
        torch._dynamo.reset()
        code = _graph_ops(attnkit.attention, q, k, v, **kw)
        traced = (
            "flash" if "attnkit.flash_forward" in code else "sdpa" if "scaled_dot_product_attention" in code else "math"
        )
        assert traced == pick, (name, text, code)


def test_from_fn_modifier_with_closure_parameters_is_refused_by_flash_under_compile():
    """A ``bias.from_fn`` function reading a learnable tensor from its closure: the operator could not give it
    a gradient, so flash refuses it while traced (auto takes math, and explain says so)."""
    q, k, v = _qkv(512, hq=2, d=8, dtype=torch.float32)
    w = torch.tensor(0.5, requires_grad=True)
    mod = B.from_fn(lambda s, b, h, qi, ki: s - w * (qi - ki).abs())
    text = backends.explain(q, k, v, bias=mod, mask=M.sliding_window(31))
    assert text.startswith("auto picks 'flash'"), text
    assert "under torch.compile auto picks 'math': flash cannot take it (under torch.compile" in text
    out = torch.compile(attnkit.attention, fullgraph=True, backend="aot_eager")(
        q, k, v, bias=mod, mask=M.sliding_window(31)
    )
    (dw,) = torch.autograd.grad(out.sum(), w)
    (want,) = torch.autograd.grad(attnkit.attention(q, k, v, bias=mod, mask=M.sliding_window(31)).sum(), w)
    torch.testing.assert_close(dw, want, rtol=1e-4, atol=1e-4)
    # (dynamo reports the ValueError raised while tracing as Unsupported, with the message)
    with pytest.raises(
        (ValueError, torch._dynamo.exc.Unsupported), match="pass a tensor bias instead, or use backend='math'"
    ):
        _compiled("flash")(q, k, v, bias=mod, mask=M.sliding_window(31))


def test_flash_attention_itself_is_one_operator_node():
    from attnkit.backends.flash import flash_attention

    q, k, v = _qkv(64)
    code = _graph_ops(lambda q, k, v: flash_attention(q, k, v, mask=M.sliding_window(9), return_lse=True), q, k, v)
    assert code.count("attnkit.flash_forward") == 1
    check_against_oracle(
        torch.compile(flash_attention, fullgraph=True, backend="aot_eager"), q, k, v, mask=M.sliding_window(9)
    )


def test_from_fn_mask_traces_through_the_operator():
    q, k, v = _qkv(64)
    mask = M.from_fn(lambda b, h, qi, ki: (qi - ki).abs() < 9)
    check_against_oracle(_compiled("flash"), q, k, v, mask=mask)


# ------------------------------------------------------------------- recompiles and plans


def test_fixed_shape_loop_neither_recompiles_nor_replans(monkeypatch):
    """Five steps of one shape: one compiled frame, and the tile plan built on the first step only; new
    document ids (same shape) reach the operator as inputs: no recompile, and the new layout is computed."""
    builds = []
    real_build = _flash_plan.build
    monkeypatch.setattr(_flash_plan, "build", lambda *a, **kw: builds.append(a[4:6]) or real_build(*a, **kw))
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    window = M.causal() & M.sliding_window(15)

    def step(q, k, v, ids):
        a = attnkit.attention(q, k, v, mask=window, backend="flash")
        return a + attnkit.attention(q, k, v, mask=M.causal() & M.document(ids), backend="flash")

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    ids = torch.arange(96) // 30
    for i in range(5):
        q, k, v = _qkv(96, seed=i, dtype=torch.float32)
        out = compiled(q, k, v, ids)
        out.sum().backward()
        if i == 0:
            first = len(builds)
    assert counter.frame_count == 1
    assert len(builds) == first  # planned on the first step only (forward and backward tilings)
    new_ids = torch.arange(96) // 50
    q, k, v = _qkv(96, seed=9, dtype=torch.float32)
    torch.testing.assert_close(compiled(q, k, v, new_ids), step(q, k, v, new_ids), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_a_new_length_compiles_once_and_is_reused():
    """Dynamo makes the length dynamic at the second size, and the flash operator plans each length when the
    graph runs: a frame for the first length and one for every later length."""
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda q, k, v: attnkit.attention(q, k, v, mask=M.sliding_window(15), backend="flash"),
        fullgraph=True,
        backend=counter,
    )
    for L, frames in ((64, 1), (80, 2), (96, 2), (80, 2), (64, 2)):
        q, k, v = _qkv(L, dtype=torch.float32)
        out = compiled(q, k, v)
        torch.testing.assert_close(out, attnkit.attention(q, k, v, mask=M.sliding_window(15), backend="flash"))
        assert counter.frame_count == frames, (L, counter.frame_count)


def test_inductor_compiles_the_operator_forward_and_backward():
    q, k, v = _qkv(64, dtype=torch.float32)
    mask = M.causal() & M.sliding_window(15)
    compiled = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True)
    out = compiled(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = attnkit.attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------ modules


def _flash_in_graph(fn, *args) -> bool:
    return "attnkit.flash_forward" in _graph_ops(fn, *args)


def _eager_picks(fn, *args) -> set:
    """The backends eager auto runs for ``fn(*args)``."""
    picks, real = set(), backends.select

    def spy(call, backend):
        chosen = real(call, backend)
        picks.add(chosen.name)
        return chosen

    backends.select = spy
    try:
        with torch.no_grad():
            fn(*args)
    finally:
        backends.select = real
    return picks


def _compile_recording(fn, codes: list):
    """``torch.compile(fn, fullgraph=True)`` through aot_eager, appending each captured graph's code to ``codes``."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return aot_eager(gm, example_inputs)

    return torch.compile(fn, fullgraph=True, backend=backend)


MODEL_MASKS = {
    "causal": dict(),
    "sliding_window": dict(mask=M.sliding_window(31)),
    "block_sparse": dict(mask=M.random_blocks(32, 2, seed=0, causal=True) | M.block_local(32)),
}


@pytest.mark.parametrize("family", ["causal", "sliding_window", "document", "block_sparse"])
def test_decoder_lm_compiles_to_one_graph_forward_and_backward(family):
    """DecoderLM with each mask family (a document mask passed at the call), float64: compiled with
    fullgraph=True, zero graph breaks, flash in the graph where eager auto picks it, logits and every
    parameter's gradient equal to eager's."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, **MODEL_MASKS.get(family, {}))
    model = DecoderLM(cfg).double()
    ids = torch.randint(0, 32, (1, 320), generator=torch.Generator().manual_seed(1))
    call = (ids, M.document(torch.arange(320) // 100)) if family == "document" else (ids,)
    fn = (lambda ids, mask: model(ids, mask=mask)) if family == "document" else model
    assert torch._dynamo.explain(fn)(*call).graph_break_count == 0
    torch._dynamo.reset()
    codes: list = []
    got = _compile_recording(fn, codes)(*call)
    assert len(codes) == 1
    assert ("attnkit.flash_forward" in codes[0]) == ("flash" in _eager_picks(fn, *call))
    assert ("attnkit.flash_forward" in codes[0]) == (family != "causal")  # a plain causal mask: sdpa
    grads = torch.autograd.grad(got.square().mean(), list(model.parameters()))
    want = fn(*call)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    for a, b in zip(grads, torch.autograd.grad(want.square().mean(), list(model.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("family", ["sliding_window", "document", "block_sparse"])
def test_multi_head_attention_compiles_to_one_graph(family):
    from attnkit.nn import MultiHeadAttention

    torch.manual_seed(0)
    masks = {
        "sliding_window": M.causal() & M.sliding_window(31),
        "document": M.document(torch.arange(256) // 60),
        "block_sparse": M.random_blocks(32, 2, seed=1),
    }
    mha = MultiHeadAttention(32, 4, n_kv_heads=2, mask=masks[family]).double()
    x = torch.randn(1, 256, 32, dtype=torch.float64, requires_grad=True)
    assert torch._dynamo.explain(mha)(x).graph_break_count == 0
    torch._dynamo.reset()
    codes: list = []
    got = _compile_recording(mha, codes)(x)
    assert len(codes) == 1
    assert ("attnkit.flash_forward" in codes[0]) == ("flash" in _eager_picks(mha, x))
    assert "attnkit.flash_forward" in codes[0] or family != "sliding_window"  # (the others: sdpa at this size)
    (dx,) = torch.autograd.grad(got.sum(), x)
    want = mha(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dx, torch.autograd.grad(want.sum(), x)[0], rtol=1e-8, atol=1e-9)


def test_export_decoder_lm_with_a_sliding_window_runs_and_matches_eager():
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(
        DecoderConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, mask=M.sliding_window(15))
    ).eval()
    ids = torch.randint(0, 32, (1, 256), generator=torch.Generator().manual_seed(1))
    program = torch.export.export(model, (ids,))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("attnkit.flash_forward.default") == 2  # one node per layer
    other = torch.randint(0, 32, (1, 256), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for x in (ids, other):
            torch.testing.assert_close(program.module()(x), model(x), rtol=1e-5, atol=1e-5)


def test_export_with_document_ids_as_an_input():
    """Under torch.export the ids are fake while traced: flash takes the call (auto cannot weigh a structure it
    cannot read), and the program reads the ids it is given when it runs."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2)).eval()

    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = model

        def forward(self, ids, doc):
            return self.lm(ids, mask=M.document(doc))

    ids = torch.randint(0, 32, (1, 256), generator=torch.Generator().manual_seed(1))
    program = torch.export.export(Packed(), (ids, torch.arange(256) // 100))
    with torch.no_grad():
        for doc in (torch.arange(256) // 100, torch.arange(256) // 37):
            torch.testing.assert_close(program.module()(ids, doc), Packed()(ids, doc), rtol=1e-5, atol=1e-5)


@pytest.mark.hf
def test_hugging_face_llama_keeps_attnkit_kernels_under_compile(attnkit_llama):
    """A small Llama with attn_implementation="attnkit" and a padded batch: eager auto picks flash for its
    ``causal() & key_padding`` mask, and so does the compiled model (one graph, same logits)."""
    model = attnkit_llama
    ids = torch.randint(0, 64, (2, 384), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 384, dtype=torch.long)
    keep[1, 300:] = 0

    def logits(ids, keep):
        return model(input_ids=ids, attention_mask=keep).logits

    codes: list = []
    with torch.no_grad():
        got = _compile_recording(logits, codes)(ids, keep)
        want = logits(ids, keep)
    assert len(codes) == 1 and "attnkit.flash_forward" in codes[0]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :300], want[1, :300], rtol=1e-5, atol=1e-5)

"""Compiled attention where values, tables and lengths move: score modifiers that are not additive with a
gradient of the lse, masks built from tensor values inside the compiled function (key padding, varlen,
``attention_varlen``), value checks that become assertions in the graph (sinks, lengths, cu_seqlens), the
rotary table cache (no recompile on the second call) and dynamic sequence lengths (one graph for many).

Graphs and recompiles are counted with ``CompileCounterWithBackend``; results are compared with eager and with
the float64 oracle.  Compiled with ``backend="aot_eager"`` (graph capture and autograd without Inductor's code
generation) or ``"eager"`` where no backward runs; shapes are tiny."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import attnkit
from attnkit import bias as B
from attnkit import masks as M
from attnkit.testing import check_against_oracle, random_qkv, reference

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # traced from scratch, one thread


def _counter(backend: str = "aot_eager"):
    return torch._dynamo.testing.CompileCounterWithBackend(backend)


def _grads(outs, leaves):
    """Gradients of a fixed weighted sum of ``outs`` (outputs and lse) with respect to ``leaves``."""
    loss = sum((x * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum() for x in outs)
    return torch.autograd.grad(loss, leaves)


# ------------------------------------------------- 4: non-additive modifiers with a gradient of the lse


def _temperature_cases():
    return {
        "scalar": B.temperature(2.0),
        "per_head_constant": B.temperature(torch.tensor([2.0, 1.0, 0.5, 1.5])),
        "alibi_and_temperature": B.compose(B.alibi(B.alibi_slopes(4)), B.temperature(1.5)),
    }


@pytest.mark.parametrize("case", ["scalar", "per_head_constant", "alibi_and_temperature"])
def test_flash_with_a_temperature_and_return_lse_compiles_forward_and_backward(case):
    """A temperature scales the scores (not additive): the operator's backward differentiates it with autograd
    also when none of its tensors needs a gradient (it raised 'element 0 of tensors does not require grad')."""
    mod = _temperature_cases()[case]
    q, k, v = random_qkv(1, 4, 2, 24, 24, 8, dtype=torch.float32, requires_grad=True, seed=1)
    counter = _counter()
    fn = torch.compile(
        lambda q, k, v, **kw: attnkit.attention(q, k, v, backend="flash", **kw), fullgraph=True, backend=counter
    )
    got = fn(q, k, v, mask=M.causal(), bias=mod, return_lse=True)
    want = attnkit.attention(q, k, v, mask=M.causal(), bias=mod, return_lse=True, backend="flash")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    check_against_oracle(fn, q, k, v, mask=M.causal(), bias=mod, return_lse=True)  # out, lse and gradients
    assert counter.frame_count == 1


_FIRST_COMPILED = """
import torch, torch._dynamo.testing, attnkit
counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
fn = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, backend="flash"), fullgraph=True, backend=counter)
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
    q = torch.randn(1, 2, 5, 8, dtype=dtype)
    fn(q, q, q)
    attnkit.attention(q, q, q, backend="flash")  # the first eager call of this dtype in the process
    fn(q, q, q)
print(counter.frame_count)
"""


def test_a_function_compiled_before_any_eager_call_does_not_recompile_after_one():
    """In a fresh process: compiled first, then eager, then compiled again, for each dtype: one graph per dtype.
    (A table of scale limits filled on first use made the compiled function recompile after the eager call.)"""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _FIRST_COMPILED], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "4"


# ------------------------------------------------- 6: masks that read tensor values, attention_varlen


@pytest.mark.parametrize("backend", ["flash", "math", "sdpa"])
def test_key_padding_built_inside_the_compiled_function_is_one_graph(backend):
    q, k, v = random_qkv(2, 2, 2, 16, 16, 8, dtype=torch.float32, requires_grad=True, seed=2)
    counter = _counter()
    fn = torch.compile(
        lambda q, k, v, n: attnkit.attention(q, k, v, mask=M.key_padding(n), backend=backend),
        fullgraph=True,
        backend=counter,
    )
    for lengths in ([9, 16], [3, 12]):  # new lengths, same shape: no recompile
        n = torch.tensor(lengths)
        check_against_oracle(lambda q, k, v, mask: fn(q, k, v, n), q, k, v, mask=M.key_padding(n))
    assert counter.frame_count == 1
    with pytest.raises(RuntimeError, match="key_padding: lengths must be >= 0"):  # eagerly: ValueError
        fn(q, k, v, torch.tensor([-1, 4]))
    with pytest.raises(RuntimeError, match="exceeds the key length"):
        fn(q, k, v, torch.tensor([17, 4]))
    assert counter.frame_count == 1


def _packed(lengths, hq=4, hkv=2, d=8, dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q = torch.randn(T, hq, d, generator=g, dtype=dtype).requires_grad_()
    k, v = (torch.randn(T, hkv, d, generator=g, dtype=dtype).requires_grad_() for _ in range(2))
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return q, k, v, cu


def _heads_first(t):  # (T, H, D) -> (1, H, T, D)
    return t.transpose(0, 1)[None]


@pytest.mark.parametrize("where, backend", [("inside", "flash"), ("passed", "flash"), ("inside", "math")])
def test_varlen_mask_compiles_to_one_graph(where, backend):
    q, k, v, cu = _packed([5, 0, 9, 2])
    counter = _counter()
    if where == "inside":
        fn = torch.compile(
            lambda q, k, v, cu: attnkit.attention(q, k, v, mask=M.varlen(cu, cu, M.causal()), backend=backend),
            fullgraph=True,
            backend=counter,
        )

        def run(q, k, v, mask):
            return fn(q, k, v, cu)
    else:
        fn = torch.compile(
            lambda q, k, v, mask: attnkit.attention(q, k, v, mask=mask, backend=backend),
            fullgraph=True,
            backend=counter,
        )
        run = fn
    check_against_oracle(run, *(_heads_first(t) for t in (q, k, v)), mask=M.varlen(cu, cu, M.causal()))
    assert counter.frame_count == 1


def _per_sequence(q, k, v, cu, mask, dtype):
    """attention_varlen by the textbook formula in ``dtype`` (float64: the oracle), each sequence alone,
    packed back: (T, Hq, D)."""
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            one, _ = reference(*(_heads_first(t[a:b].detach()).to(dtype) for t in (q, k, v)), mask=mask, dtype=dtype)
            outs.append(one[0].transpose(0, 1))
    return torch.cat(outs)


def test_attention_varlen_compiles_to_one_graph_with_gradients():
    """attention_varlen under torch.compile: one packed call under masks.varlen, zero graph breaks (it had 18),
    new cu_seqlens of the same shape without a recompile; forward and gradients against eager and the
    per-sequence float64 oracle."""
    q, k, v, cu = _packed([5, 0, 9, 2])

    def step(q, k, v, cu):
        return attnkit.attention_varlen(q, k, v, cu, cu, mask=M.causal())

    assert torch._dynamo.explain(step)(q, k, v, cu).graph_break_count == 0
    torch._dynamo.reset()
    counter = _counter()
    fn = torch.compile(step, fullgraph=True, backend=counter)
    for lengths in ([5, 0, 9, 2], [1, 7, 8, 0]):
        cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        got, want = fn(q, k, v, cu), step(q, k, v, cu)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        oracle = _per_sequence(q, k, v, cu, M.causal(), torch.float64)
        naive = _per_sequence(q, k, v, cu, M.causal(), torch.float32)
        assert (got.double() - oracle).abs().max() <= 2 * (naive.double() - oracle).abs().max() + 1e-6
        for a, b in zip(_grads([got], (q, k, v)), _grads([want], (q, k, v))):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert counter.frame_count == 1


def test_attention_varlen_value_checks_are_assertions_in_the_graph():
    q, k, v, cu = _packed([5, 0, 9, 2])
    fn = torch.compile(
        lambda q, k, v, cu: attnkit.attention_varlen(q, k, v, cu, cu, mask=M.causal()), fullgraph=True, backend="eager"
    )
    fn(q, k, v, cu)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q must not decrease"):
        fn(q, k, v, torch.tensor([0, 9, 5, 14, 16], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[0\] must be 0"):
        fn(q, k, v, torch.tensor([1, 5, 5, 14, 16], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"cu_seqlens_q\[-1\] must equal the number of packed queries"):
        fn(q, k, v, torch.tensor([0, 5, 5, 14, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="must not decrease"):  # eagerly: the ValueError with the values
        attnkit.attention_varlen(q, k, v, *[torch.tensor([0, 9, 5, 14, 16], dtype=torch.int32)] * 2)


# ------------------------------------------------------------------- 7: a NaN sink under compile


def test_a_non_finite_sink_raises_in_the_compiled_graph():
    """Eagerly refused with a ValueError; compiled, the finiteness check is an assertion in the graph (it was
    skipped, and the rows came out NaN)."""
    q, k, v = random_qkv(1, 4, 2, 16, 16, 8, dtype=torch.float32, seed=4)
    counter = _counter("eager")
    fn = torch.compile(
        lambda q, k, v, s: attnkit.attention(q, k, v, mask=M.causal(), sinks=s), fullgraph=True, backend=counter
    )
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    torch.testing.assert_close(fn(q, k, v, sinks), attnkit.attention(q, k, v, mask=M.causal(), sinks=sinks))
    bad = torch.tensor([0.5, float("nan"), 2.0, 0.0])
    with pytest.raises(ValueError, match="sinks holds a non-finite value"):
        attnkit.attention(q, k, v, mask=M.causal(), sinks=bad)
    with pytest.raises(RuntimeError, match="sinks holds a non-finite value"):
        fn(q, k, v, bad)
    assert counter.frame_count == 1


# ------------------------------------------------------------------- 8: the rotary table cache


def _same_in_one_graph(module, x, atol):
    """Three calls of the compiled ``module`` equal eager ones and compile one frame (no recompilation)."""
    counter = _counter("eager")
    fn = torch.compile(module, fullgraph=True, backend=counter)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fn(x), module(x), rtol=1e-5, atol=atol)
    assert counter.frame_count == 1


def test_rotary_module_and_model_do_not_recompile_on_the_second_call():
    """The rotary table is computed in the graph while traced, not stored in (or read from) the module's
    cache: a dict filled during the first call put a guard on its keys that the second call failed."""
    from attnkit.nn import DecoderConfig, DecoderLM, MultiHeadAttention, RotaryEmbedding

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 2, positions=RotaryEmbedding(8), mask=M.causal())
    x = torch.randn(1, 10, 16)
    _same_in_one_graph(mha, x, atol=1e-6)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    ids = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(1))
    _same_in_one_graph(model, ids, atol=1e-5)


# ------------------------------------------------------------------- 9: dynamic sequence lengths


@pytest.mark.parametrize(
    "backend, mask",
    [("math", None), ("sdpa", None), ("math", "causal"), ("sdpa", "causal"), ("flash", "causal"), ("auto", "causal")],
)
def test_mark_dynamic_length_is_one_graph_for_many_lengths(backend, mask):
    """``mark_dynamic`` on the sequence length: one graph serves every length (it raised
    ConstraintViolationError: the backend decision specialised the length), forward and gradients against the
    float64 oracle at each length."""
    counter = _counter()
    fn = torch.compile(
        lambda q, k, v, mask: attnkit.attention(q, k, v, mask=mask, backend=backend), fullgraph=True, backend=counter
    )

    def dynamic(q, k, v, mask):  # (check_against_oracle passes copies: mark those)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        return fn(q, k, v, mask)

    for L in (24, 40):
        q, k, v = random_qkv(1, 4, 2, L, L, 8, dtype=torch.float32, requires_grad=True, seed=L)
        check_against_oracle(dynamic, q, k, v, mask=None if mask is None else M.causal())
    assert counter.frame_count == 1


def test_dynamic_true_serves_new_lengths_without_recompiling():
    """``torch.compile(dynamic=True)``: auto on CPU takes flash for a call of symbolic length (its operator
    plans each length when the graph runs): one graph for three lengths, a sliding window included."""
    counter = _counter()
    mask = M.causal() & M.sliding_window(7)
    fn = torch.compile(
        lambda q, k, v, mask: attnkit.attention(q, k, v, mask=mask), fullgraph=True, dynamic=True, backend=counter
    )
    frames = []
    for L in (24, 40, 33):
        q, k, v = random_qkv(1, 4, 2, L, L, 8, dtype=torch.float32, requires_grad=True, seed=L)
        check_against_oracle(fn, q, k, v, mask=mask)
        frames.append(counter.frame_count)
    # (the first trace may count twice: dynamo restarts it once to turn symbolic floats into tensors)
    assert frames[0] >= 1 and frames[1:] == [frames[0]] * 2, frames

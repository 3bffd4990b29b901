"""The ``triton`` backend as the custom operators ``attnkit::triton_forward`` / ``attnkit::triton_backward``:
``torch.library.opcheck`` on both, ``attention(..., backend="triton")`` compiled with ``fullgraph=True`` (one
operator node, zero graph breaks, forward and backward equal to eager and within the numerical rule), no
recompile and no replanning over a fixed-shape loop, and ``auto`` / ``explain`` naming the operators when
triton is the pick.

The cases run on CPU tensors under Triton's interpreter, in the child process of the ``interpreted`` fixture
(``tests/backends/conftest.py``); graphs are captured with ``backend="aot_eager"`` (dynamo and AOTAutograd,
without Inductor's code generation).  Shapes are tiny (16 x 16 tiles, a few tiles per side): the interpreter
runs every kernel program in Python.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch._dynamo.testing

import attnkit
from attnkit import backends
from attnkit import bias as B
from attnkit import masks as M
from attnkit.backends.call import make_call
from attnkit.testing import check_against_oracle, random_qkv

CASES: dict = {}  # name -> case, run by the interpreter child


def case(name: str):
    """Register the decorated function as the case ``name``."""
    return lambda fn: CASES.setdefault(name, fn)


def _qkv(L=40, *, hq=2, hkv=1, d=16, seed=0, grad=True):
    """Grouped-query q (1, 2, L, 16) on k, v (1, 1, L, 16), float32."""
    return random_qkv(1, hq, hkv, L, L, d, dtype=torch.float32, requires_grad=grad, seed=seed)


def _ids(L):
    """Document ids of three packed documents."""
    return torch.arange(L) * 3 // L


def _op_args(q, k, v, sinks=None, **kwargs):
    """The forward operator's arguments for an ``attention`` call's keywords."""
    from attnkit.backends.operators import op_arguments

    call = make_call(q, k, v, sinks=sinks, **kwargs)
    mask_key, mask_tensors, bias_t, mod_key, mod_tensors = op_arguments(call)
    return (
        q,
        k,
        v,
        mask_key,
        mask_tensors,
        bias_t,
        mod_key,
        mod_tensors,
        call.sinks,
        float(call.scale),
        float(call.softcap or 0.0),
    )


# ------------------------------------------------------------------------------------------ opcheck

# each: a mask and the features its opcheck also covers (grouped-query heads in all)
_OPCHECK = {
    "causal-sinks": lambda L: dict(mask=M.causal(), sinks=torch.randn(2).requires_grad_()),
    "sliding-window-alibi": lambda L: dict(mask=M.causal() & M.sliding_window(9), bias=B.alibi(B.alibi_slopes(2))),
    "document-softcap": lambda L: dict(mask=M.document(_ids(L)) & M.causal(), softcap=3.0),
    "tensor-mask-and-bias": lambda L: dict(
        mask=torch.rand(L, L, generator=torch.Generator().manual_seed(1)) > 0.4, bias=torch.randn(1, 2, L, L)
    ),
}


def _opcheck_forward(name):
    def run():
        q, k, v = _qkv()
        torch.library.opcheck(torch.ops.attnkit.triton_forward.default, _op_args(q, k, v, **_OPCHECK[name](40)))

    return run


for _name in _OPCHECK:
    CASES[f"opcheck-forward-{_name}"] = _opcheck_forward(_name)


@case("opcheck-backward-lse-and-sinks")
def _():
    """The backward with an lse gradient (return_lse) and the sinks' gradient, and without either."""
    q, k, v = _qkv(grad=False)
    sinks = torch.randn(2)
    args = _op_args(q, k, v, mask=M.causal() & M.sliding_window(12), sinks=sinks)
    out, lse = torch.ops.attnkit.triton_forward(*args)
    g = torch.Generator().manual_seed(3)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    for dl, sinks_grad in ((dlse, True), (None, False)):
        torch.library.opcheck(
            torch.ops.attnkit.triton_backward.default, (dout, dl, q, k, v, out, lse, *args[3:], sinks_grad)
        )


# --------------------------------------------------------------------------------- torch.compile


@functools.lru_cache(maxsize=None)
def _compiled():
    return torch.compile(functools.partial(attnkit.attention, backend="triton"), fullgraph=True, backend="aot_eager")


def _graph_code(fn, *args, **kwargs) -> str:
    """The code of the one graph dynamo captures for ``fn(*args, **kwargs)``, checked to have no graph break."""
    explained = torch._dynamo.explain(fn)(*args, **kwargs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained
    return explained.graphs[0].code


def _leaves(kw):
    return [t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def _compiled_matches_eager(kw, L=40, oracle=False):
    """Compiled triton: one graph with one operator node and no graph break; out (and lse) and every
    gradient equal to eager triton's (the same kernels); with ``oracle``, also within the numerical rule
    against the float64 oracle."""
    torch._dynamo.reset()
    q, k, v = _qkv(L)
    call = functools.partial(attnkit.attention, backend="triton")
    code = _graph_code(call, q, k, v, **kw)
    assert code.count("attnkit.triton_forward") == 1, code
    got, want = _compiled()(q, k, v, **kw), call(q, k, v, **kw)
    got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    leaves = [q, k, v, *_leaves(kw)]
    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(x.shape, generator=g) for x in got]
    loss, ref = (sum((x * w).sum() for x, w in zip(xs, weights)) for xs in (got, want))
    for a, b in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref, leaves)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if oracle:
        check_against_oracle(_compiled(), *_qkv(L, seed=1), **kw)


_COMPILE = {
    "causal": lambda L: dict(mask=M.causal()),
    "sliding-window": lambda L: dict(mask=M.causal() & M.sliding_window(9)),
    "document": lambda L: dict(mask=M.document(_ids(L)) & M.causal()),
    "tensor-mask": lambda L: dict(mask=torch.rand(L, L, generator=torch.Generator().manual_seed(2)) > 0.4),
    "sinks-return-lse": lambda L: dict(mask=M.causal(), sinks=torch.randn(2).requires_grad_(), return_lse=True),
    "alibi": lambda L: dict(mask=M.causal(), bias=B.alibi(B.alibi_slopes(2))),
    "tensor-bias-softcap": lambda L: dict(mask=M.sliding_window(11), bias=torch.randn(1, 1, L, L), softcap=4.0),
}

for _name in _COMPILE:
    CASES[f"compile-{_name}"] = (
        lambda name: lambda: _compiled_matches_eager(_COMPILE[name](40), oracle=name == "sinks-return-lse")
    )(_name)


@case("fixed-shape-loop-neither-recompiles-nor-replans")
def _():
    """Five forward+backward steps of one shape: one compiled frame, the tile plans built on the first step
    only; new document ids of the same shape reach the operator as an input (no recompile, new layout)."""
    from attnkit.backends.triton import ops as tb

    torch._dynamo.reset()
    builds = []
    real_build = tb._build_plan
    tb._build_plan = lambda *a, **kw: builds.append(a[1:3]) or real_build(*a, **kw)
    try:
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        window = M.causal() & M.sliding_window(9)

        def step(q, k, v, ids):
            a = attnkit.attention(q, k, v, mask=window, backend="triton")
            return a + attnkit.attention(q, k, v, mask=M.causal() & M.document(ids), backend="triton")

        compiled = torch.compile(step, fullgraph=True, backend=counter)
        ids = _ids(40)
        for i in range(5):
            q, k, v = _qkv(seed=i)
            compiled(q, k, v, ids).sum().backward()
            if i == 0:
                first = len(builds)
        assert counter.frame_count == 1, counter.frame_count
        assert 0 < first == len(builds), (first, builds)  # planned on the first step only
        new_ids = torch.arange(40) // 7
        q, k, v = _qkv(seed=9)
        torch.testing.assert_close(compiled(q, k, v, new_ids), step(q, k, v, new_ids), rtol=1e-6, atol=1e-6)
        assert counter.frame_count == 1
    finally:
        tb._build_plan = real_build


@case("auto-picking-triton-runs-its-operators-and-explain-says-so")
def _():
    """Where auto picks triton (on a GPU; here its cost is made 0 to make it the pick under the interpreter),
    explain's last line names its operators and the compiled graph holds one triton_forward node."""
    torch._dynamo.reset()
    real = backends._REGISTRY["triton"]
    backends.register(dataclasses.replace(real, cost=lambda call: 0.0))
    try:
        q, k, v = _qkv()
        kw = dict(mask=M.causal() & M.sliding_window(9))
        lines = backends.explain(q, k, v, **kw).splitlines()
        assert lines[0].startswith("auto picks 'triton'"), lines
        assert lines[-1] == (
            "under torch.compile auto picks 'triton' too (as the custom operators attnkit::triton_forward/backward)"
        ), lines
        assert _graph_code(attnkit.attention, q, k, v, **kw).count("attnkit.triton_forward") == 1
        compiled = torch.compile(attnkit.attention, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q, k, v, **kw), attnkit.attention(q, k, v, backend="triton", **kw))
    finally:
        backends.register(real)


@case("what-triton-refuses-is-refused-while-traced-too")
def _():
    """A bias that requires grad: the eager ValueError, raised while the compiled call is traced."""
    torch._dynamo.reset()
    q, k, v = _qkv()
    bias = torch.randn(1, 2, 40, 40, requires_grad=True)
    try:
        _compiled()(q, k, v, bias=bias)
    except Exception as e:  # noqa: BLE001 (dynamo wraps the ValueError raised while tracing
        assert "the Triton kernels do not compute the bias gradient" in str(e), e
    else:
        raise AssertionError("a bias requiring grad went through the triton operators")


@case("mask-changed-in-place-before-backward-is-an-error")
def _():
    """The operator saves the mask's tensors: the backward refuses to run on key lengths changed in place."""
    torch._dynamo.reset()
    q, k, v = _qkv()
    lengths = torch.tensor([33])
    out = _compiled()(q, k, v, mask=M.key_padding(lengths))
    lengths[0] = 5
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e), e
    else:
        raise AssertionError("the backward ran on a changed mask")


@pytest.mark.parametrize("name", sorted(CASES))
def test_operator_case(name, interpreted):
    verdict = interpreted[name]
    if verdict is not None:
        pytest.fail(f"case {name!r} failed under the Triton interpreter:\n{verdict}", pytrace=False)

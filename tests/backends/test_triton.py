"""The Triton backend, run by Triton's interpreter on the CPU, against the float64 oracle.

How the interpreter is had: the kernel cases (``CASES``) run in one child Python started with
``TRITON_INTERPRET=1`` by the ``interpreted`` fixture (``tests/backends/conftest.py`` says why), and each test
here fails with the child's traceback when its case failed.  A second child imports triton for the GPU
compiler and compiles every kernel for an H100 (no GPU needed) to catch what the interpreter lets through.
Tests of the host-side planning (pure PyTorch) run in this process.

Shapes are tiny (the interpreter runs every program instance in Python): 16 x 16 tiles, lengths of a few
tiles, odd on purpose, so full, partial and empty tiles and ragged edges all occur.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkit
from attnkit import bias as biases
from attnkit import masks
from attnkit.backends.triton import ops as tb_ops
from attnkit.backends.triton import plan
from attnkit.backends import sdpa as sdpa_backend
from attnkit.backends import triton as tb
from attnkit.backends.call import make_call
from attnkit.testing import check_against_oracle, max_err, random_qkv, reference

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# ----------------------------------------------------------------------------- cases run by the child

CASES: dict = {}


def case(name: str):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def _qkv(B=1, Hq=2, Hkv=1, Lq=37, Lk=37, D=24, Dv=None, dtype=torch.float32, seed=0):
    return tuple(random_qkv(B, Hq, Hkv, Lq, Lk, D, Dv, dtype=dtype, requires_grad=True, seed=seed))


def _triton(q, k, v, **kwargs):
    return attnkit.attention(q, k, v, backend="triton", **kwargs)


def _ids(lengths, batch=1):
    """Document ids (B, sum(lengths)) for documents of the given lengths, rolled per batch row."""
    row = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return torch.stack([row.roll(7 * b) for b in range(batch)])


# (mask factory, B, Hq, Lq, Lk, dtype): one dtype per mask, rotating, so every path sees every dtype
_MASKS = {
    "none": (lambda: None, 1, 1, 37, 37, "fp16"),
    "causal": (lambda: masks.causal(), 1, 1, 37, 37, "bf16"),
    "causal-decode-Lq<Lk": (lambda: masks.causal(), 1, 1, 5, 41, "fp32"),
    "causal-top-left": (lambda: masks.causal(align="top_left"), 1, 1, 21, 45, "fp16"),
    "sliding-window": (lambda: masks.sliding_window(6, 2), 1, 1, 45, 45, "fp32"),
    "sliding-window-left-unbounded": (lambda: masks.sliding_window(None, 3), 1, 1, 33, 40, "bf16"),
    "document-causal-batched": (
        lambda: masks.document(_ids([9, 20, 11], batch=2)) & masks.causal(),
        2,
        1,
        40,
        40,
        "fp32",
    ),
    "document-cross": (lambda: masks.document(_ids([10, 13]), _ids([20, 17])), 1, 1, 23, 37, "bf16"),
    "prefix-lm": (lambda: masks.prefix_lm(11), 1, 1, 37, 37, "fp16"),
    "key-padding-lengths": (lambda: masks.key_padding([30, 12]) & masks.causal(), 2, 1, 33, 33, "fp32"),
    "key-padding-bool": (
        lambda: masks.key_padding(torch.rand(2, 35, generator=torch.Generator().manual_seed(1)) > 0.3),
        2,
        1,
        20,
        35,
        "bf16",
    ),
    "strided": (lambda: masks.strided(4), 1, 1, 37, 37, "fp16"),
    "random-blocks": (lambda: masks.random_blocks(8, 2, seed=3), 1, 1, 40, 40, "fp32"),
    "from-fn": (lambda: masks.from_fn(lambda b, h, q, k: (q + 2 * k) % 3 != 0, name="mod3"), 1, 1, 30, 35, "bf16"),
    "from-dense-per-head": (
        lambda: masks.from_dense(torch.rand(1, 2, 29, 35, generator=torch.Generator().manual_seed(2)) > 0.5),
        1,
        2,
        29,
        35,
        "fp16",
    ),
    "not-causal": (lambda: ~masks.causal(), 1, 1, 33, 33, "fp32"),
    "window-or-global": (lambda: masks.sliding_window(3, 3) | masks.global_tokens([0, 20]), 1, 1, 37, 37, "bf16"),
    "causal-and-strided": (lambda: masks.causal() & masks.strided(5, causal=False), 1, 1, 37, 37, "fp16"),
    "fixed": (lambda: masks.fixed(8, 2), 1, 1, 40, 40, "fp32"),
}


def _mask_case(name):
    make, B, Hq, Lq, Lk, dt = _MASKS[name]

    def run():
        q, k, v = _qkv(B=B, Hq=Hq, Lq=Lq, Lk=Lk, dtype=DTYPES[dt])
        check_against_oracle(_triton, q, k, v, mask=make())

    return run


for _name in _MASKS:
    CASES[f"mask-{_name}"] = _mask_case(_name)


@case("varlen-per-sequence-causal")
def _():
    # packed sequences (a zero-length one, one without keys, Lq != Lk): the varlen mask's bitmap path
    cu_q = torch.tensor([0, 9, 9, 29, 35], dtype=torch.int32)
    cu_k = torch.tensor([0, 12, 16, 36, 36], dtype=torch.int32)
    q, k, v = _qkv(Hq=4, Hkv=2, Lq=35, Lk=36, D=16, dtype=torch.float32)

    def packed(q, k, v, mask):  # (1, H, T, D) views of the packed (T, H, D) tensors
        out = attnkit.attention_varlen(
            q[0].transpose(0, 1),
            k[0].transpose(0, 1),
            v[0].transpose(0, 1),
            cu_q,
            cu_k,
            mask=masks.causal(),
            backend="triton",
        )
        return out.transpose(0, 1)[None]

    check_against_oracle(packed, q, k, v, mask=masks.varlen(cu_q, cu_k, masks.causal()))


@case("gqa-6-query-heads-on-2")
def _():
    q, k, v = _qkv(Hq=6, Hkv=2, Lq=20, Lk=35, dtype=torch.bfloat16)
    check_against_oracle(_triton, q, k, v, mask=masks.causal())


@case("mqa-4-query-heads-on-1-windowed")
def _():
    q, k, v = _qkv(Hq=3, Hkv=1, Lq=17, Lk=40, dtype=torch.float16)
    check_against_oracle(_triton, q, k, v, mask=masks.sliding_window(7, 7))


@case("odd-lengths-and-head-dims")
def _():
    q, k, v = _qkv(Hq=1, Lq=19, Lk=53, D=40, Dv=24, dtype=torch.float32)
    check_against_oracle(_triton, q, k, v, mask=masks.causal())


def _head_dim(D):
    q, k, v = _qkv(Hq=1, Lq=20, Lk=20, D=D, dtype=torch.float16)
    check_against_oracle(_triton, q, k, v, mask=masks.causal())


def _sinks_case(dtype, mask, Hq, Hkv, return_lse):
    q, k, v = _qkv(Hq=Hq, Hkv=Hkv, Lq=21, Lk=37, dtype=dtype)
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    report = check_against_oracle(_triton, q, k, v, mask=mask, sinks=sinks, return_lse=return_lse)
    assert report["dsinks"]["ok"]


CASES["sinks-gqa-causal-fp32-lse"] = lambda: _sinks_case(torch.float32, masks.causal(), 4, 2, True)
CASES["sinks-window-fp16"] = lambda: _sinks_case(torch.float16, masks.sliding_window(5), 2, 1, False)
CASES["sinks-empty-rows-bf16"] = lambda: _sinks_case(
    torch.bfloat16, masks.causal(align="top_left") & masks.key_padding([12]), 2, 2, True
)


for _D in (16, 256):  # and D=40, Dv=24 in "odd-lengths-and-head-dims"
    CASES[f"head-dim-{_D}"] = (lambda D: lambda: _head_dim(D))(_D)


@case("softcap-fp32")
def _():
    q, k, v = _qkv(Hq=1, Lq=33, Lk=33, dtype=torch.float32)
    check_against_oracle(_triton, q * 4, k, v, mask=masks.causal(), softcap=5.0)


@case("softcap-bf16-document")
def _():
    q, k, v = _qkv(Hq=1, Lq=40, Lk=40, dtype=torch.bfloat16)
    check_against_oracle(_triton, q, k, v, mask=masks.document(_ids([15, 25])), softcap=2.0)


@case("alibi-causal")
def _():
    q, k, v = _qkv(Hq=2, Hkv=1, Lq=30, Lk=30, dtype=torch.float32)
    check_against_oracle(_triton, q, k, v, mask=masks.causal(), bias=biases.alibi(biases.alibi_slopes(2)))


@case("alibi-top-left-Lq<Lk-fp16")
def _():
    q, k, v = _qkv(Hq=2, Hkv=2, Lq=17, Lk=40, dtype=torch.float16)
    check_against_oracle(_triton, q, k, v, bias=biases.alibi(biases.alibi_slopes(2), align="top_left"))


@case("temperature-and-scale")
def _():
    q, k, v = _qkv(Hq=1, Lq=30, Lk=30, dtype=torch.float32)
    check_against_oracle(_triton, q, k, v, mask=masks.causal(), bias=biases.temperature(2.0), scale=0.3)


@case("tensor-bias-broadcast")
def _():
    q, k, v = _qkv(B=2, Hq=2, Lq=21, Lk=35, dtype=torch.float16)
    bias = torch.randn(1, 2, 1, 35) + torch.randn(21, 1)  # (1, H, Lq, Lk) from two broadcast parts
    check_against_oracle(_triton, q, k, v, mask=masks.causal(), bias=bias.expand(1, 2, 21, 35)[..., :, :])


@case("views-with-model-strides")
def _():
    # q from a (B, L, H, D) projection viewed as (B, H, L, D): rows are not contiguous, as in a model
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 35, 3 * 2 * 16, generator=g)
    q, k, v = x.view(1, 35, 3, 2, 16).permute(2, 0, 3, 1, 4)  # each (B, H, L, D), strided
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    check_against_oracle(_triton, q, k, v, mask=masks.sliding_window(10))


@case("fully-masked-rows")
def _():
    # bottom-right causal with Lq > Lk: the first Lq - Lk query rows see no key
    q, k, v = _qkv(Hq=1, Lq=40, Lk=23, dtype=torch.float16)
    check_against_oracle(_triton, q, k, v, mask=masks.causal())
    out, lse = _triton(q, k, v, mask=masks.causal(), return_lse=True)
    assert lse.dtype == torch.float32
    assert torch.equal(out[:, :, :17], torch.zeros_like(out[:, :, :17]))
    assert torch.isneginf(lse[:, :, :17]).all() and torch.isfinite(lse[:, :, 17:]).all()
    out.float().pow(2).sum().backward()
    assert torch.equal(q.grad[:, :, :17], torch.zeros_like(q.grad[:, :, :17]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@case("lse-and-its-gradient")
def _():
    # lse against the oracle by the numerical rule; then a loss that uses lse (as merging partial results
    # does) differentiated through the kernels, against the float64 oracle with factor 3
    for dt in (torch.bfloat16,):
        q, k, v = _qkv(Hq=2, Hkv=1, Lq=20, Lk=35, dtype=dt)
        mask = masks.causal() & masks.sliding_window(12)
        out, lse = _triton(q, k, v, mask=mask, return_lse=True)
        _, lse64 = reference(q.double(), k.double(), v.double(), mask=mask)
        _, lse_naive = reference(q, k, v, mask=mask)
        assert max_err(lse, lse64) <= 2 * max_err(lse_naive, lse64) + 1e-6
        g = torch.Generator().manual_seed(5)
        go, gl = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
        grads = {}
        for name, dtype, backend in (
            ("kernel", dt, "triton"),
            ("oracle", torch.float64, "math"),
            ("naive", dt, "math"),
        ):
            leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
            o, ls = attnkit.attention(*leaves, mask=mask, return_lse=True, backend=backend)
            ((o.double() * go.double()).sum() + (ls.double() * gl.double()).sum()).backward()
            grads[name] = [t.grad for t in leaves]
        for kern, orac, naive in zip(grads["kernel"], grads["oracle"], grads["naive"]):
            assert max_err(kern, orac) <= 3 * max_err(naive, orac) + 1e-6


@case("auto-never-picks-the-interpreter")
def _():
    q, k, v = _qkv(Lq=20, Lk=20)
    call = make_call(q, k, v, mask=masks.causal())
    assert tb.check(call) is None  # the interpreter takes it...
    assert attnkit.backends.select(call, "auto").name != "triton"  # ...but auto does not choose it
    assert "triton  takes it" in attnkit.backends.explain(q, k, v, mask=masks.causal())


@case("empty-tiles-are-never-read")
def _():
    # keys in tiles that no query tile lists hold NaN: had a kernel loaded them, NaN would reach the output
    # (0 * NaN) or dk/dv; the results must equal those of the same call on clean keys, and dk, dv be 0 there
    for mask in (masks.key_padding([20]), masks.from_dense((torch.arange(64) < 20).view(1, 64))):  # predicate, bitmap
        q, k, v = _qkv(Hq=1, Lq=20, Lk=64, dtype=torch.float16)
        dirty_k, dirty_v = (t.detach().clone() for t in (k, v))
        dirty_k[:, :, 32:], dirty_v[:, :, 32:] = float("nan"), float("nan")  # key tiles 2 and 3
        runs = []
        for kk, vv in ((k.detach(), v.detach()), (dirty_k, dirty_v)):
            leaves = [q.detach().clone().requires_grad_(True), kk.requires_grad_(True), vv.requires_grad_(True)]
            out = _triton(*leaves, mask=mask)
            out.float().sum().backward()
            runs.append([out, *(t.grad for t in leaves)])
        for clean, dirty in zip(*runs):
            assert torch.equal(
                clean[..., :32, :] if clean.shape[-2] == 64 else clean,
                dirty[..., :32, :] if dirty.shape[-2] == 64 else dirty,
            )
        assert (runs[1][2][:, :, 32:] == 0).all() and (runs[1][3][:, :, 32:] == 0).all()


@case("plan-reused-until-ids-change")
def _():
    ids = _ids([10, 27])
    m = masks.document(ids) & masks.causal()
    q, k, v = _qkv(Hq=1, Lq=37, Lk=37)
    p1 = tb_ops._plans(make_call(q, k, v, mask=m)).forward()
    p2 = tb_ops._plans(make_call(q, k, v, mask=m)).forward()
    assert p1 is p2
    ids[0, 5:] = 1  # edited in place: the plan must follow
    p3 = tb_ops._plans(make_call(q, k, v, mask=m)).forward()
    assert p3 is not p1
    check_against_oracle(_triton, q, k, v, mask=m)


# paged decode: the same keys as a dense tensor (oracle) and scattered over shuffled pages (kernel)


def _paged_case(dtype, B=3, Hq=4, Hkv=2, D=24, Dv=16, page=8, lens=(37, 1, 20), splits=None, **kwargs):
    lens = torch.tensor(lens, dtype=torch.int32)
    n_pages = -(-int(lens.max()) // page) + 1  # one page more than the longest needs: never read
    g = torch.Generator().manual_seed(6)
    table = torch.randperm(B * n_pages + 3, generator=g)[: B * n_pages].view(B, n_pages).to(torch.int32)
    q = torch.randn(B, Hq, 1, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, n_pages * page, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, n_pages * page, Dv, generator=g).to(dtype)

    def paged(q, k, v, mask, bias=None, softcap=None):
        k_pool = torch.zeros(B * n_pages + 3, Hkv, page, D, dtype=dtype)  # (num_blocks, Hkv, block_size, D)
        v_pool = torch.zeros(B * n_pages + 3, Hkv, page, Dv, dtype=dtype)
        for b in range(B):
            for j in range(n_pages):
                k_pool[table[b, j]] = k[b, :, j * page : (j + 1) * page]
                v_pool[table[b, j]] = v[b, :, j * page : (j + 1) * page]
        if splits is None:
            return tb.paged_decode(q, k_pool, v_pool, table, lens, bias=bias, softcap=softcap)
        slopes = bias.slopes if isinstance(bias, biases.ScoreMod) else None
        return tb._paged_decode(
            q,
            k_pool,
            v_pool,
            table,
            lens,
            scale=D**-0.5,
            softcap=softcap,
            slopes=slopes,
            bias=bias if isinstance(bias, torch.Tensor) else None,
            num_splits=splits,
        )

    out = paged(q, k, v, None, **kwargs)
    assert out.shape == (B, Hq, 1, Dv) and out.dtype == dtype
    # keys past a sequence's length are padding in the dense oracle; its query sits at the end of the
    # padded row, which shifts ALiBi by a constant per row: the softmax does not see it
    check_against_oracle(paged, q, k, v, mask=masks.key_padding(lens.long()), grad=False, **kwargs)
    return out


@case("paged-fp32-one-split")
def _():
    _paged_case(torch.float32, splits=1)


@case("paged-fp16-three-splits-gqa")
def _():
    _paged_case(torch.float16, Hq=8, Hkv=2, splits=3)


@case("paged-bf16-page-6-mqa")
def _():
    _paged_case(torch.bfloat16, Hq=3, Hkv=1, page=6, lens=(31, 17, 4), splits=2)


@case("paged-empty-sequence")
def _():
    out = _paged_case(torch.float32, lens=(0, 25, 9), splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@case("paged-softcap-and-alibi")
def _():
    _paged_case(torch.float32, softcap=3.0, bias=biases.alibi(biases.alibi_slopes(4)), splits=2)


@case("paged-tensor-bias-public-entry")
def _():
    _paged_case(torch.float16, lens=(40, 3, 22), bias=torch.randn(3, 1, 1, 48))


@case("paged-non-contiguous-table-and-lengths")
def _():
    g = torch.Generator().manual_seed(2)
    q, k_pool, v_pool = (torch.randn(*s, generator=g) for s in ((2, 4, 1, 16), (6, 2, 16, 16), (6, 2, 16, 16)))
    table = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    wide = torch.stack([table, torch.zeros_like(table)], -1).view(2, 6)[:, ::2]  # equal values, stride 2
    lens2 = torch.stack([lens, torch.zeros_like(lens)], -1)[:, 0]
    want = tb.paged_decode(q, k_pool, v_pool, table, lens)
    assert torch.equal(tb.paged_decode(q, k_pool, v_pool, wide, lens2), want)


@case("key-padding-one-length-broadcast-over-the-batch")
def _():
    q, k, v = _qkv(B=3, Hq=1, Lq=16, Lk=16, D=16)
    check_against_oracle(_triton, q, k, v, mask=masks.key_padding([9]))


def _backward_is_refused(out, match: str, changed: str) -> None:
    """The backward of ``out`` raises a RuntimeError saying ``match``: ``changed`` was changed in place after the
    forward."""
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert match in str(e)
    else:
        raise AssertionError(f"the backward ran on a changed {changed}")


@case("in-place-change-between-forward-and-backward-is-an-error")
def _():
    q, k, v = _qkv(B=2, Hq=1, Lq=20, Lk=20, D=16)
    lengths = torch.tensor([20, 12])
    out = _triton(q, k, v, mask=masks.key_padding(lengths))
    lengths[0] = 5
    _backward_is_refused(out, "modified in place between the forward and the backward", "mask")
    bias = torch.randn(1, 1, 20, 20)
    out = _triton(q, k, v, bias=bias)
    bias.mul_(5.0)
    _backward_is_refused(out, "modified in place", "bias")


def _garbage_case(mask_fn, fill, softcap=None):
    """NaN or inf in the keys and values no query may see changes nothing: the result (and the gradients)
    of the same call with zeros there, and zero gradients for the hidden slots."""
    B, Hq, Hkv, L, D = 2, 4, 2, 35, 16
    lengths = [21, 35]
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(B, Hq, L, D, generator=g),
        torch.randn(B, Hkv, L, D, generator=g),
        torch.randn(B, Hkv, L, D, generator=g),
    )
    junk = (torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None])[:, None, :, None].expand(B, Hkv, L, D)
    k, v = k.masked_fill(junk, 0.0), v.masked_fill(junk, 0.0)
    results = []
    for kk, vv in ((k, v), (k.masked_fill(junk, fill), v.masked_fill(junk, -fill if fill == fill else fill))):
        leaves = [t.clone().requires_grad_() for t in (q, kk, vv)]
        out = _triton(*leaves, mask=mask_fn(lengths), softcap=softcap)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        results.append([out.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b)
    for grad in results[1][2:]:
        assert torch.equal(grad[junk], torch.zeros_like(grad[junk]))


for _fill in ("nan", "inf", "-inf"):
    CASES[f"garbage-{_fill}-key-padding"] = (lambda f: lambda: _garbage_case(masks.key_padding, float(f)))(_fill)
CASES["garbage-nan-bool-key-mask-causal-softcap"] = lambda: _garbage_case(
    lambda n: masks.key_padding(torch.arange(35)[None, :] < torch.tensor(n)[:, None]) & masks.causal(),
    float("nan"),
    softcap=4.0,
)


# ------------------------------------------------------------------------- run by the interpreter child


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_case(name, interpreted):
    verdict = interpreted[name]
    if verdict is not None:
        pytest.fail(f"case {name!r} failed under the Triton interpreter:\n{verdict}", pytrace=False)


# The GPU compiler's checks, without a GPU: a second child imports triton for the compiler (no
# TRITON_INTERPRET), compiles every kernel for an H100 (sm_90) through Triton's front end and its GPU layout
# passes (TTIR, TTGIR), which reject what the interpreter lets through (types that differ between branches,
# non-constexpr shapes, ...), and then asks the backend about CPU tensors with TRITON_INTERPRET set too late.

_POINTERS = {
    "Lse": "*fp32",
    "Delta": "*fp32",
    "DQ": "*fp32",
    "DK": "*fp32",
    "DV_": "*fp32",
    "Count": "*i32",
    "Index": "*i32",
    "TileId": "*i32",
    "Bitmap": "*i32",
    "Slopes": "*fp32",
    "Bias": "*fp32",
    "QDoc": "*i64",
    "KDoc": "*i64",
    "KeyLen": "*i64",
    "BlockTable": "*i32",
    "SeqLens": "*i32",
    "PartOut": "*fp32",
    "PartLse": "*fp32",
    "scale": "fp32",
    "softcap": "fp32",
}
_FLAGS = (
    "HAS_SOFTCAP",
    "HAS_ALIBI",
    "HAS_BIAS",
    "HAS_LO",
    "HAS_HI",
    "HAS_PREFIX",
    "HAS_DOC",
    "HAS_KEYLEN",
    "HAS_BITMAP",
    "EVEN_N",
    "ALIBI_AT_END",
    "SPLIT",
)


def _compile_main(out_path: str) -> None:
    import triton  # noqa: F401  (first import, for the compiler)
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    K = tb_ops._kernels()
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    results = {"interpreted": K.INTERPRETED}
    meta = dict(
        D=64,
        DV=64,
        BLOCK_D=64,
        BLOCK_DV=64,
        BLOCK_M=64,
        BLOCK_N=64,
        WORDS=2,
        BLOCK_G=16,
        BLOCK_S=16,
        EMULATE_BF16=False,
        PRECISION="tf32",
    )
    for name in ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv", "_paged_decode", "_paged_combine"):
        fn = getattr(K, name)
        for on in (False, True):
            constexprs = {a: (on if a in _FLAGS else meta[a]) for a in fn.arg_names if a in _FLAGS or a in meta}
            data = {a: "*bf16" for a in ("Q", "K", "V", "Out", "DO", "KPool", "VPool")}
            signature = {
                a: "constexpr" if a in constexprs else _POINTERS.get(a, data.get(a, "i32")) for a in fn.arg_names
            }
            try:
                src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
                options = backend.parse_options({"num_warps": 4, "num_stages": 2})
                stages = {}
                backend.add_stages(stages, options, src.language)
                context = ir.context()
                ir.load_dialects(context)
                backend.load_dialects(context)
                module = src.make_ir(
                    target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
                )
                metadata = {"hash": "0", "target": target, **options.__dict__}
                for stage in ("ttir", "ttgir"):
                    module = stages[stage](module, metadata)
                results[f"{name}[flags={on}]"] = None
            except Exception:  # noqa: BLE001 (whatever the compiler raises is the report)
                results[f"{name}[flags={on}]"] = traceback.format_exc()
    os.environ["TRITON_INTERPRET"] = "1"  # too late: triton is already imported for the compiler
    q = torch.randn(1, 1, 4, 16)
    results["cpu_reason"] = tb.check(make_call(q, q, q))
    results["listed"] = "triton" in attnkit.backends.available()
    Path(out_path).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compiled.json"
        proc = subprocess.run(
            [sys.executable, __file__, "--compile", str(out)], env=env, capture_output=True, text=True, timeout=500
        )
        if proc.returncode != 0 or not out.exists():
            pytest.fail(f"the compiler child failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return json.loads(out.read_text())


@pytest.mark.parametrize("kernel", ["_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv", "_paged_decode", "_paged_combine"])
def test_kernels_compile_for_an_h100_without_a_gpu(kernel, compiled):
    assert compiled["interpreted"] is False
    for on in (False, True):
        error = compiled[f"{kernel}[flags={on}]"]
        assert error is None, f"{kernel} with every feature flag {on} does not compile for sm_90:\n{error}"


def test_triton_imported_for_the_gpu_declines_cpu_tensors_with_the_reason(compiled):
    assert "triton was imported before TRITON_INTERPRET=1 was set" in compiled["cpu_reason"]
    assert compiled["listed"] == torch.cuda.is_available()  # listed only where it takes calls (a GPU)


# ------------------------------------------------------------------------- in this process (no triton)


def test_cpu_without_interpreter_is_declined_without_importing_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.randn(1, 2, 8, 16)
    reason = tb.check(make_call(q, q, q))
    assert "set TRITON_INTERPRET=1" in reason
    if not torch.cuda.is_available():
        assert not tb.available() and "triton" not in attnkit.backends.available()
        with pytest.raises(ValueError, match="backend='triton' is not available"):
            attnkit.attention(q, q, q, backend="triton")


@pytest.mark.parametrize(
    "kwargs, dtype, expected",
    [
        ({}, torch.float64, "float64 is not supported"),
        ({"dropout_p": 0.1}, torch.float32, "no dropout"),
        ({"bias": biases.from_fn(lambda s, b, h, q, k: s * 2)}, torch.float32, "not computed by the Triton kernels"),
        ({"bias": biases.relative_buckets(torch.zeros(2, 8))}, torch.float32, "not computed by the Triton kernels"),
        ({"bias": biases.alibi(torch.ones(2, requires_grad=True))}, torch.float32, "learnable ALiBi slopes"),
        ({"bias": torch.zeros(8, 8, requires_grad=True)}, torch.float32, "bias gradient"),
        ({"bias": biases.temperature(2.0), "softcap": 3.0}, torch.float32, "temperature after a softcap"),
    ],
)
def test_check_names_what_it_declines(monkeypatch, kwargs, dtype, expected):
    # these reasons come before any device question, so no triton import is needed to reach them...
    monkeypatch.setattr(tb, "_device_reason", lambda device: None)
    q = torch.randn(1, 2, 8, 16, dtype=dtype)
    assert expected in tb.check(make_call(q, q, q, **kwargs))


def test_head_dim_over_256_is_declined(monkeypatch):
    monkeypatch.setattr(tb, "_device_reason", lambda device: None)
    q = torch.randn(1, 1, 4, 320)
    assert "at most 256" in tb.check(make_call(q, q, q))


def _gpu_costs(mask, L):
    """The triton and sdpa costs of a bf16 call as they would be on a GPU (its tile plan, no launch)."""
    q = torch.randn(1, 1, L, 64, dtype=torch.bfloat16)
    call = make_call(q, q, q, mask=mask)
    fwd, _ = tb_ops._configs(64, torch.bfloat16, False)
    p = tb_ops._build_plan(mask, L, L, 1, 1, fwd, torch.device("cpu"))
    return tb._tile_cost(call.flops(), p), sdpa_backend.cost(call)


def test_auto_would_pick_triton_on_gpu_for_sparse_masks_and_sdpa_for_dense():
    t, s = _gpu_costs(masks.sliding_window(255), 4096)
    assert t < s / 4  # a 256-key window over 4096 keys: a small share of the tiles
    t, s = _gpu_costs(masks.document(_ids([1000, 2000, 1096])) & masks.causal(), 4096)
    assert t < s
    t, s = _gpu_costs(masks.causal(), 4096)
    assert s < t  # plain causal and dense: SDPA's flash kernel is the faster one
    t, s = _gpu_costs(None, 4096)
    assert s < t


def test_paged_decode_rejects_malformed_inputs():
    q, pool = torch.randn(2, 4, 1, 16), torch.randn(5, 2, 8, 16)
    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="one query token per sequence"):
        tb.paged_decode(torch.randn(2, 4, 3, 16), pool, pool, table, lens)
    with pytest.raises(ValueError, match="Hq must be a multiple of Hkv"):
        tb.paged_decode(torch.randn(2, 3, 1, 16), pool, pool, table, lens)
    with pytest.raises(ValueError, match="block_table must be"):
        tb.paged_decode(q, pool, pool, table[:1], lens)
    with pytest.raises(TypeError, match="block_table must be int32"):
        tb.paged_decode(q, pool, pool, table.float(), lens)
    with pytest.raises(ValueError, match="does not broadcast"):
        tb.check_paged_decode(q, pool, pool, table, lens, bias=torch.randn(3, 4, 1, 24))
    with pytest.raises(ValueError, match="slopes for Hq=4"):
        tb.check_paged_decode(q, pool, pool, table, lens, bias=biases.alibi(biases.alibi_slopes(2)))
    # values the kernel would misread: checked, never computed on
    with pytest.raises(ValueError, match=r"seq_lens holds 25, outside \[0, 24\]"):
        tb.check_paged_decode(q, pool, pool, table, torch.tensor([3, 25], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = 7 is not a block of the pool \[0, 5\)"):
        tb.check_paged_decode(q, pool, pool, torch.tensor([[0, 1, 2], [7, 1, 2]], dtype=torch.int32), lens)
    tb.check_paged_decode(q, pool, pool, torch.tensor([[0, -1, -1], [1, -1, -1]], dtype=torch.int32), lens)  # unread
    with pytest.raises(ValueError, match="the bias covers 3 keys but seq_lens holds 4"):
        tb.check_paged_decode(q, pool, pool, table, lens, bias=torch.randn(1, 1, 1, 3))
    with pytest.raises(ValueError, match=r"softcap=0.0 must be > 0.0 \(or None for no softcap\)"):
        tb.check_paged_decode(q, pool, pool, table, lens, softcap=0.0)
    with pytest.raises(ValueError, match="scale=nan must be a finite number"):
        tb.check_paged_decode(q, pool, pool, table, lens, scale=float("nan"))


# ------------------------------------------------------------------ host-side planning, property-tested

_PLAN_MASKS = [  # factories of (Lq, Lk)
    lambda Lq, Lk: masks.causal(),
    lambda Lq, Lk: masks.sliding_window(5, 2, align="top_left"),
    lambda Lq, Lk: masks.prefix_lm(7) & masks.sliding_window(None, 4),
    lambda Lq, Lk: masks.document(_ids([Lk // 3, Lk - Lk // 3], batch=2)),
    lambda Lq, Lk: masks.key_padding([Lk // 2, Lk]) & masks.causal(),
    lambda Lq, Lk: masks.strided(3),
    lambda Lq, Lk: masks.random_blocks(5, 2, seed=1),
    lambda Lq, Lk: masks.from_dense(torch.rand(1, 2, Lq, Lk, generator=torch.Generator().manual_seed(Lq)) > 0.6),
]


def _eval_predicates(p: plan.Predicates, b, q, k):
    ok = torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool)
    if p.lo_off is not None:
        ok &= k >= q + p.lo_off
    if p.hi_off is not None:
        ok &= k <= q + p.hi_off
    if p.prefix is not None:
        ok &= (k <= q + p.prefix[0]) | (k < p.prefix[1])
    if p.doc is not None:
        qi, ki = p.doc
        ok &= qi[min(b, qi.shape[0] - 1)][q] == ki[min(b, ki.shape[0] - 1)][k]
    if p.key_lengths is not None:
        ok &= k < p.key_lengths[min(b, len(p.key_lengths) - 1)]
    return ok


@given(
    kind=st.integers(0, len(_PLAN_MASKS) - 1),
    L=st.integers(9, 40),
    shrink=st.integers(0, 8),
    bm=st.sampled_from([4, 8, 16]),
    bn=st.sampled_from([4, 8, 16, 48]),
)
def test_tile_lists_with_predicates_or_bitmaps_rebuild_the_mask(kind, L, shrink, bm, bn):
    Lq, Lk = L - shrink * (kind != 3), L  # documents keep Lq == Lk
    B, H = 2, 2
    mask = _PLAN_MASKS[kind](Lq, Lk)
    dense = mask.to_dense(Lq, Lk, batch=B, heads=H).expand(B, H, Lq, Lk)
    lists = plan.tile_lists(mask.block_structure(Lq, Lk, bm, bn, batch=B, heads=H))
    preds = plan.predicates(mask, Lq, Lk, torch.device("cpu"))
    bits = plan.bitmap(mask, lists, Lq, Lk, bm, bn) if preds is None else None
    rebuilt = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    Bp, Hp, R, _ = lists.index.shape
    for b in range(B):
        for h in range(H):
            for r in range(R):
                n_part, n_total = lists.count[min(b, Bp - 1), min(h, Hp - 1), r].tolist()
                for j in range(n_total):
                    kt = int(lists.index[min(b, Bp - 1), min(h, Hp - 1), r, j])
                    q = torch.arange(r * bm, min(Lq, (r + 1) * bm)).view(-1, 1)
                    k = torch.arange(kt * bn, min(Lk, (kt + 1) * bn)).view(1, -1)
                    if j >= n_part:
                        tile = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool)
                    elif preds is not None:
                        tile = _eval_predicates(preds, b, q, k)
                    else:
                        words = bits[int(lists.tile_id[min(b, Bp - 1), min(h, Hp - 1), r, j])]
                        c = k - kt * bn
                        tile = ((words[q - r * bm, c // 32] >> (c % 32)) & 1).bool()
                    rebuilt[b, h, q, k] = tile
    assert torch.equal(rebuilt, dense)


@given(
    kind=st.integers(0, len(_PLAN_MASKS) - 1),
    L=st.integers(9, 40),
    bm=st.sampled_from([4, 8, 16]),
    bn=st.sampled_from([4, 8, 16]),
)
def test_transposed_lists_hold_the_same_tiles(kind, L, bm, bn):
    mask = _PLAN_MASKS[kind](L, L)
    lists = plan.tile_lists(mask.block_structure(L, L, bm, bn, batch=2, heads=2))
    nk = -(-L // bn)
    t = plan.transpose(lists, nk)

    def entries(lst, transposed):
        out = set()
        Bp, Hp, R, _ = lst.index.shape
        for b in range(Bp):
            for h in range(Hp):
                for r in range(R):
                    n_part, n_total = lst.count[b, h, r].tolist()
                    for j in range(n_total):
                        other = int(lst.index[b, h, r, j])
                        tid = int(lst.tile_id[b, h, r, j]) if j < n_part else -1
                        out.add((b, h, other, r, tid) if transposed else (b, h, r, other, tid))
        return out

    assert entries(t, True) == entries(lists, False)
    # partial entries first, and rows ascending within each kind
    for row_count, row_index in zip(t.count.view(-1, 2).tolist(), t.index.view(-1, t.index.shape[-1]).tolist()):
        n_part, n_total = row_count
        assert row_index[:n_part] == sorted(row_index[:n_part])
        assert row_index[n_part:n_total] == sorted(row_index[n_part:n_total])


def test_a_million_token_window_plans_a_few_tiles_per_row():
    # the kernels' work and the plan's size follow the visited tiles, not Lq x Lk
    fwd, _ = tb_ops._configs(128, torch.bfloat16, False)  # 128 x 64 tiles
    L = 1 << 20
    p = tb_ops._build_plan(masks.sliding_window(255), L, L, 1, 1, fwd, torch.device("cpu"))
    # a query tile of 128 rows sees keys [r0 - 255, r0 + 127]: 383 keys, six tiles of 64
    assert p.lists.index.shape == (1, 1, L // 128, 6) and p.preds.lo_off == -255 and p.bitmap is None
    assert p.visited < 1e-3
    t = p.transposed()
    assert t.index.shape[-1] <= 4 and int(t.count[..., 1].sum()) == int(p.lists.count[..., 1].sum())


def test_predicates_cover_the_built_in_masks_and_only_those():
    cpu = torch.device("cpu")
    assert plan.predicates(masks.causal() & masks.document(_ids([4, 6])), 10, 10, cpu).doc is not None
    assert plan.predicates(masks.prefix_lm(3), 10, 10, cpu).prefix == (0, 3)
    assert plan.predicates(masks.key_padding([5]), 6, 10, cpu).key_lengths.tolist() == [5]
    assert plan.predicates(masks.sliding_window(2, 1, align="top_left"), 6, 10, cpu).lo_off == -2
    for m in (
        masks.causal() | masks.prefix_lm(2),
        ~masks.causal(),
        masks.block_local(4),
        masks.prefix_lm(2) & masks.prefix_lm(3),
        masks.from_fn(lambda b, h, q, k: q >= k),
    ):
        assert plan.predicates(m, 10, 10, cpu) is None


if __name__ == "__main__":  # the child process of the `compiled` fixture
    _compile_main(sys.argv[2])

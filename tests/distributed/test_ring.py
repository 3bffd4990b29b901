"""Ring attention on 2 and 4 gloo processes against single-process ``attnkit.attention``.

Each world size starts its process group once: this file, run as a script, is the worker.  Every rank
runs all the cases below, each comparing its shard of out, lse, dq, dk and dv with the same rows of
the single-process result (float64: 1e-9; float32: the numerical rule against the float64 oracle), and
writes one JSON report; the tests read the reports.  Bad input must raise on every rank, not hang.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import attnkit
from attnkit import bias as B
from attnkit import masks as M
from attnkit.testing import max_err, reference

WORLDS = (2, 4)
LAYOUTS = ("zigzag", "contiguous")
_TIMEOUT_S = 150  # the whole run of one world; a hang fails here instead of blocking the suite


# ------------------------------------------------------------------------ the cases
# name -> (settings for _compare); tensors are built from the seed, identically on every rank.


def _doc_ids(L: int, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, L, generator=g) < 0.15
    starts[:, 0] = True
    return starts.long().cumsum(-1)  # (batch, L): packed documents of random lengths


def _dead_rows(b, h, q, k):  # every 5th query row sees nothing: output 0, lse -inf, zero grads
    return (q % 5 != 3) & (k <= q)


_SLOPES = B.alibi_slopes(4)

CASES: dict[str, dict] = {
    "none": dict(),
    "causal": dict(mask=M.causal()),
    "sliding_window": dict(mask=M.sliding_window(5)),
    "sliding_window_two_sided": dict(mask=M.sliding_window(3, 3)),
    "document_causal": dict(mask=M.causal() & M.document(_doc_ids(32, 2, 1)), batch=2),
    "document": dict(mask=M.document(_doc_ids(32, 1, 2)[0])),
    "prefix_lm": dict(mask=M.prefix_lm(6)),
    "alibi_causal": dict(mask=M.causal(), bias=B.alibi(_SLOPES)),
    "alibi_two_sided_window": dict(mask=M.sliding_window(6, 2), bias=B.alibi(_SLOPES)),
    "gqa_causal": dict(mask=M.causal(), hq=4, hkv=2),
    "mqa_sliding_window": dict(mask=M.sliding_window(4), hq=4, hkv=1),
    "softcap_causal": dict(mask=M.causal(), softcap=2.0),
    "temperature_scale": dict(mask=M.causal(), bias=B.temperature(1.7), scale=0.9),
    "empty_rows_from_fn": dict(mask=M.from_fn(_dead_rows, name="dead_rows")),
    "dense_bool_mask": dict(mask="dense"),
    "value_dim_differs": dict(mask=M.causal(), dv=6),
    "lse_gradient": dict(mask=M.causal() & M.document(_doc_ids(32, 1, 3)[0]), dlse=True),
    "fine_tiles_causal": dict(mask=M.causal(), block=2),
    "fine_tiles_window": dict(mask=M.sliding_window(3), block=2, hq=4, hkv=2),
    "fine_tiles_document": dict(mask=M.causal() & M.document(_doc_ids(32, 1, 4)[0]), block=3),
    "coarse_tiles_prime_chunk": dict(mask=M.causal(), block=8, L=88, bias=B.alibi(_SLOPES)),
    "float32_causal": dict(mask=M.causal(), dtype=torch.float32, L=64),
    "float32_gqa_alibi_document": dict(
        mask=M.causal() & M.document(_doc_ids(64, 1, 5)[0]),
        bias=B.alibi(_SLOPES),
        hq=4,
        hkv=2,
        dtype=torch.float32,
        L=64,
    ),
    "float32_window": dict(mask=M.sliding_window(7), dtype=torch.float32, L=64, block=4),
}

ERROR_CASES = (
    "uneven_lengths",
    "mismatched_heads",
    "one_rank_bad_input",
    "mismatched_mask",
    "odd_zigzag_shard",
    "indivisible_shard",
    "learnable_bias",
    "dense_bias",
    "plain_function_bias",
    "local_document_ids",
    "mismatched_mask_values",
    "mismatched_bias_values",
    "one_rank_learnable_bias",
    "unshard_mismatch",
    "string_return_lse",
    "overflowing_scale",
    "usable_after_errors",
)
OTHER_CASES = (
    "shard_positions",
    "unshard_roundtrip",
    "unshard_gradient",
    "no_grad_forward",
    "gradcheck",
    "padding_garbage",
)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _run_full(fn, q, k, v, dout, dlse, kwargs):
    """out, lse and the gradients of sum(out * dout) + sum(lse * dlse), on one process."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = fn(*leaves, **kwargs)
    loss = (out * dout.to(out.dtype)).sum()
    if dlse is not None:
        loss = loss + (_finite(lse) * dlse.to(lse.dtype)).sum()
    loss.backward()
    return [out, lse] + [t.grad for t in leaves]


def _compare(
    rank: int,
    world: int,
    layout: str,
    *,
    mask=None,
    bias=None,
    softcap=None,
    scale=None,
    dtype=torch.float64,
    batch=1,
    hq=4,
    hkv=4,
    L=32,
    d=8,
    dv=None,
    dlse=False,
    block=None,
) -> dict:
    from attnkit.distributed import ring, ring_attention, shard

    dv = dv or d
    g = torch.Generator().manual_seed(L * 7 + hq + hkv + batch)
    q = torch.randn(batch, hq, L, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, hkv, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, hkv, L, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, hq, L, dv, generator=g, dtype=torch.float64)
    dl = torch.randn(batch, hq, L, generator=g, dtype=torch.float64) if dlse else None
    if mask == "dense":
        mask = torch.rand(batch, 1, L, L, generator=g) < 0.5
        mask[..., 0] = True
    kw = dict(mask=mask, bias=bias, softcap=softcap, scale=scale)

    oracle = _run_full(
        lambda *t, **kw_: attnkit.attention(*t, **kw_, return_lse=True, backend="math"), q, k, v, dout, dl, kw
    )
    saved = ring._BLOCK
    if block is not None:
        ring._BLOCK = block
    try:
        local = [shard(t.to(dtype), layout=layout) for t in (q, k, v)]
        ring_out = _run_full(
            lambda *t, **kw_: ring_attention(*t, **kw_, layout=layout, return_lse=True),
            *local,
            shard(dout, layout=layout),
            None if dl is None else shard(dl, layout=layout),
            kw,
        )
    finally:
        ring._BLOCK = saved
    names = ["out", "lse", "dq", "dk", "dv"]
    report = {}
    if dtype == torch.float64:
        for name, got, want in zip(names, ring_out, oracle):
            err = max_err(got, shard(want, layout=layout))
            report[name] = {"err": err, "bound": 1e-9}
    else:  # the numerical rule: at most 2x (3x for grads) the error of the textbook formula in float32

        def textbook(q_, k_, v_, **kw_):
            return reference(q_, k_, v_, **{n: kw_[n] for n in ("mask", "bias", "scale", "softcap")})

        naive = _run_full(textbook, *(t.to(dtype) for t in (q, k, v)), dout, dl, kw)
        for name, got, want, nv in zip(names, ring_out, oracle, naive):
            factor = 2.0 if name in ("out", "lse") else 3.0
            report[name] = {"err": max_err(got, shard(want, layout=layout)), "bound": factor * max_err(nv, want) + 1e-6}
    return report


def _expect_error(fn, kind, *fragments) -> dict:
    try:
        fn()
    except kind as e:
        missing = [f for f in fragments if f not in str(e)]
        if missing:
            raise AssertionError(f"{kind.__name__} raised but its message lacks {missing}: {e}") from None
        return {"message": str(e)}
    except Exception as e:  # noqa: BLE001 - report the wrong kind of error
        raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from None
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")


def _error_case(name: str, rank: int, world: int) -> dict:
    from attnkit.distributed import ring_attention, shard, unshard

    x = torch.randn(1, 2, 8, 4)
    if name == "uneven_lengths":
        y = torch.randn(1, 2, 8 if rank == 0 else 10, 4)
        return _expect_error(lambda: ring_attention(y, y, y), ValueError, "differs across", "rank 0", "rank 1", "pad")
    if name == "mismatched_heads":
        y = torch.randn(1, 2 if rank else 4, 8, 4)
        return _expect_error(lambda: ring_attention(y, y, y), ValueError, "q shape differs")
    if name == "one_rank_bad_input":
        y = x[0] if rank == world - 1 else x
        if rank == world - 1:
            return _expect_error(lambda: ring_attention(y, y, y), ValueError, "4 dims")
        return _expect_error(lambda: ring_attention(y, y, y), ValueError, f"rank {world - 1} rejected")
    if name == "mismatched_mask":
        m = M.causal() if rank == 0 else None
        return _expect_error(lambda: ring_attention(x, x, x, mask=m), ValueError, "mask differs")
    if name == "odd_zigzag_shard":
        y = torch.randn(1, 2, 7, 4)
        return _expect_error(lambda: ring_attention(y, y, y), ValueError, "odd", "contiguous")
    if name == "indivisible_shard":
        return _expect_error(lambda: shard(torch.randn(1, 2, 4 * world + 2, 4)), ValueError, "pad")
    if name == "learnable_bias":
        slopes = torch.ones(2, requires_grad=True)
        return _expect_error(lambda: ring_attention(x, x, x, bias=B.alibi(slopes)), ValueError, "require grad")
    if name == "dense_bias":
        return _expect_error(
            lambda: ring_attention(x, x, x, bias=torch.zeros(8 * world, 8 * world)), TypeError, "from_fn"
        )
    if name == "string_return_lse":  # "no" is truthy: refused like attention's, on every rank
        return _expect_error(
            lambda: ring_attention(x, x, x, return_lse="no"), TypeError, "return_lse must be True or False"
        )
    if name == "overflowing_scale":  # attention()'s check (its call is built the same way), not NaN rows
        return _expect_error(lambda: ring_attention(x, x, x, scale=1e30), ValueError, "would overflow")
    if name == "plain_function_bias":  # the same TypeError as attention's, not "differs across ranks"
        return _expect_error(
            lambda: ring_attention(x, x, x, bias=lambda s, b, h, i, j: s),
            TypeError,
            "got the callable <lambda>",
            "from_fn",
        )
    if name == "local_document_ids":  # ids for this rank's 8 tokens instead of all 8W
        return _expect_error(
            lambda: ring_attention(x, x, x, mask=M.document(torch.zeros(8, dtype=torch.long))),
            ValueError,
            "full sequence",
            f"L = {world} ranks x 8 local tokens",
        )
    if name == "mismatched_mask_values":  # prints as document(8W ids) on every rank: the values are compared
        ids = torch.zeros(8 * world, dtype=torch.long) if rank == 0 else torch.arange(8 * world)
        return _expect_error(
            lambda: ring_attention(x, x, x, mask=M.document(ids)), ValueError, "mask holds different values"
        )
    if name == "mismatched_bias_values":
        slopes = torch.tensor([0.5, 0.25 + 0.125 * (rank == world - 1)])
        return _expect_error(
            lambda: ring_attention(x, x, x, bias=B.alibi(slopes)), ValueError, "bias holds different values"
        )
    if name == "one_rank_learnable_bias":  # refused on one rank: every rank stops (a peer crashed in the ring)
        slopes = torch.ones(2).requires_grad_(rank == 0)
        return _expect_error(
            lambda: ring_attention(x, x, x, bias=B.alibi(slopes)),
            ValueError,
            "require grad" if rank == 0 else "rank 0 rejected",
        )
    if name == "unshard_mismatch":
        y = torch.randn(1, 2, 8 + 2 * rank, 4)
        return _expect_error(lambda: unshard(y), ValueError, "differ across ranks")
    if name == "usable_after_errors":
        out = ring_attention(x, x, x, mask=M.causal())
        if not torch.isfinite(out).all():
            raise AssertionError("non-finite output after the error cases")
        return {}
    raise KeyError(name)


def _other_case(name: str, rank: int, world: int) -> dict:
    from attnkit.distributed import ring_attention, shard, unshard

    L = 8 * world
    if name == "shard_positions":
        c = L // (2 * world)
        got = {lay: shard(torch.arange(L), dim=0, layout=lay).tolist() for lay in LAYOUTS}
        want = {
            "zigzag": list(range(rank * c, (rank + 1) * c))
            + list(range((2 * world - 1 - rank) * c, (2 * world - rank) * c)),
            "contiguous": list(range(rank * 2 * c, (rank + 1) * 2 * c)),
        }
        if got != want:
            raise AssertionError(f"positions {got}, expected {want}")
        return {}
    if name == "unshard_roundtrip":
        x = torch.randn(2, L, 3, generator=torch.Generator().manual_seed(0))
        for lay in LAYOUTS:
            if not torch.equal(unshard(shard(x, dim=1, layout=lay), dim=1, layout=lay), x):
                raise AssertionError(f"unshard(shard(x)) != x for layout={lay}")
        return {}
    if name == "unshard_gradient":  # rank r's loss is (r + 1) * sum(full * w): the grads of a shard add up
        w = torch.randn(1, 2, L, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        local = torch.randn(1, 2, L // world, 4, dtype=torch.float64).requires_grad_(True)
        ((rank + 1) * (unshard(local) * w).sum()).backward()
        want = shard(w, layout="zigzag") * (world * (world + 1) / 2)
        if max_err(local.grad, want) > 1e-12:
            raise AssertionError(f"unshard gradient off by {max_err(local.grad, want)}")
        return {}
    if name == "gradcheck":
        return _gradcheck(rank, world)
    if name == "padding_garbage":  # NaN / inf in padded keys and values reach no row, forward or backward
        g = torch.Generator().manual_seed(3)
        q, k, v = (torch.randn(2, 2, L, 4, generator=g) for _ in range(3))
        lengths = [L, L - 5]
        junk = (torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None])[:, None, :, None].expand_as(k)
        runs = []
        for kk, vv in (
            (k.masked_fill(junk, 0.0), v.masked_fill(junk, 0.0)),
            (k.masked_fill(junk, float("nan")), v.masked_fill(junk, float("inf"))),
        ):
            leaves = [shard(t).requires_grad_() for t in (q, kk, vv)]
            out = ring_attention(*leaves, mask=M.key_padding(lengths) & M.causal())
            out.backward(shard(torch.ones_like(q)))
            runs.append([out.detach()] + [t.grad for t in leaves])
        for name_, a, b in zip(("out", "dq", "dk", "dv"), *runs):
            if not torch.isfinite(a).all() or max_err(a, b) > 1e-5:
                raise AssertionError(f"{name_}: garbage changed it by {max_err(a, b)}")
        hidden = shard(junk)
        for grad in runs[1][2:]:
            if grad[hidden].abs().max() != 0 if hidden.any() else False:
                raise AssertionError("the hidden slots got a gradient")
        return {}
    if name == "no_grad_forward":
        x = torch.randn(1, 2, 8, 4, requires_grad=True)
        with torch.no_grad():
            out = ring_attention(x, x, x, mask=M.causal())
        if out.requires_grad:
            raise AssertionError("output requires grad under torch.no_grad()")
        return {}
    raise KeyError(name)


def _gradcheck(rank: int, world: int) -> dict:
    """torch.autograd.gradcheck of the whole distributed function of the full inputs, on every rank.

    Every rank perturbs the same input entry at the same time, so all ranks evaluate one global function.
    The test's own scatter/gather make each rank's analytic gradient the full one: scatter's backward
    sums the ranks' shard gradients, gather's backward takes this rank's rows only.
    """
    import torch.distributed as dist
    from attnkit.distributed import ring_attention, shard, unshard

    class Scatter(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return shard(x, layout="zigzag")

        @staticmethod
        def backward(ctx, g):
            full = unshard(g.contiguous(), layout="zigzag").detach()  # every rank's shard gradient, in place
            return full

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return unshard(x, layout="zigzag").detach()

        @staticmethod
        def backward(ctx, g):
            return shard(g, layout="zigzag")

    L = 4 * world
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, L, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, L, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, L, 2, generator=g, dtype=torch.float64, requires_grad=True)

    def fn(q_, k_, v_):
        out, lse = ring_attention(
            Scatter.apply(q_),
            Scatter.apply(k_),
            Scatter.apply(v_),
            mask=M.causal(),
            bias=B.alibi(B.alibi_slopes(2)),
            softcap=3.0,
            return_lse=True,
        )
        return Gather.apply(out), Gather.apply(lse)

    torch.manual_seed(0)  # fast mode draws random directions: the same ones on every rank
    ok = torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, fast_mode=True)
    dist.barrier()
    if not ok:
        raise AssertionError("gradcheck failed")
    return {}


# ------------------------------------------------------------------------ the worker


def _worker(rank: int, world: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    results = {}
    jobs = [
        (f"{name}[{lay}]", lambda n=name, lay=lay: _compare(rank, world, lay, **CASES[n]))
        for name in CASES
        for lay in LAYOUTS
    ]
    jobs += [(name, lambda n=name: _error_case(n, rank, world)) for name in ERROR_CASES]
    jobs += [(name, lambda n=name: _other_case(n, rank, world)) for name in OTHER_CASES]
    for name, job in jobs:
        try:
            results[name] = {"ok": True, "report": job()}
        except Exception:  # noqa: BLE001 - every failure is reported to the test, which asserts on it
            results[name] = {"ok": False, "report": traceback.format_exc()}
    dist.destroy_process_group()
    Path(out_path).write_text(json.dumps(results))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, tmp: Path) -> subprocess.Popen:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--rank",
                str(r),
                "--world",
                str(world),
                "--port",
                str(port),
                "--out",
                str(tmp / f"w{world}_r{r}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
        )
        for r in range(world)
    ]
    return procs


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{world: [report of rank 0, rank 1, ...]}: both worlds run at once, each started once."""
    tmp = tmp_path_factory.mktemp("ring")
    running = {w: _launch(w, tmp) for w in WORLDS}
    out = {}
    for w, procs in running.items():
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=_TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for other in procs:
                    other.kill()
                pytest.fail(f"world {w}: the workers did not finish in {_TIMEOUT_S} s (a hang?)")
        reports_w = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            path = tmp / f"w{w}_r{r}.json"
            if p.returncode != 0 or not path.exists():
                pytest.fail(f"world {w} rank {r} exited with {p.returncode}:\n{log[-4000:]}")
            reports_w.append(json.loads(path.read_text()))
        out[w] = reports_w
    return out


def _all_ranks(reports, world, name) -> list[dict]:
    got = [rep[name] for rep in reports[world]]
    failed = [f"rank {r}:\n{g['report']}" for r, g in enumerate(got) if not g["ok"]]
    if failed:
        pytest.fail("\n".join(failed))
    return [g["report"] for g in got]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_matches_single_process(reports, world, case, layout):
    for rank, rep in enumerate(_all_ranks(reports, world, f"{case}[{layout}]")):
        for name, r in rep.items():
            assert r["err"] <= r["bound"], f"rank {rank} {name}: max|err| {r['err']:.3e} > {r['bound']:.3e}"


@pytest.mark.parametrize("case", ERROR_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_bad_input_raises_on_every_rank(reports, world, case):
    _all_ranks(reports, world, case)  # each rank checked the error kind and message itself


@pytest.mark.parametrize("case", OTHER_CASES)
@pytest.mark.parametrize("world", WORLDS)
def test_shard_unshard_and_autograd(reports, world, case):
    _all_ranks(reports, world, case)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one rank of the ring attention tests")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    _worker(args.rank, args.world, args.port, args.out)

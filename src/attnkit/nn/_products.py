"""Which kernel multiplies the 1-3 rows of a decode step by a row-major float32 weight: measured per machine.

A decode step of one to three sequences is a matrix-vector product bound by how fast a kernel streams the
weight, and which of PyTorch's kernels streams fastest depends on the CPU, not on the code.  MKL's two-column
product (a single row padded to two) was the fastest on one machine (an Intel CPU: 1.8x oneDNN) and the
slowest on another (an AMD Zen 3, where MKL takes its generic path: 6.7 GB/s against 16.5 for ``F.linear``
at one thread).  So the kernel is chosen by timing the candidates on this machine, once per process for each
product shape and thread count, and kept:

* ``"columns"``: ``weight @ x.T`` through MKL, one row padded to two;
* ``"linear"``: ``F.linear`` (MKL's matrix-vector product);
* ``"onednn"``: oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``) on the row-major weight.

Each candidate runs on a weight of the product's shape (random values: only the time is read), at each thread
count a decode step may run (the caller's, one fewer, one: what ``decode_threads="auto"`` tries), in
interleaved rounds; the median of each candidate's calls decides, so one call slowed by another process does
not.  ``"linear"`` is kept unless another candidate is :data:`MARGIN` faster (a single operator, and no
thread barrier at one row, whose waits a busy core stretches).  The cost is paid once per shape and process
(a few milliseconds for a 512 x 1408 weight, about a second for a 32000-word output head), on the first decode
step, which ``decode_threads="auto"`` never times.

:func:`decode_products` reports every choice made so far, with the speeds measured.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

KERNELS = ("linear", "columns", "onednn")
ROUNDS = 5  # rounds of one call per candidate (fewer when a shape's rounds pass BUDGET seconds, at least 3)
BUDGET = 0.3  # seconds of measuring per shape and thread count after which the rounds stop (after the third)
MARGIN = 0.10  # another kernel must be this much faster than "linear" to be chosen
_WHAT = {
    "linear": "F.linear, MKL's matrix-vector product",
    "columns": "MKL's two-column product",
    "onednn": "oneDNN's linear kernel",
}


class ProductChoice(NamedTuple):
    """One choice: the kernel for ``rows`` rows (1, or 2 standing for 2-3) times an ``(out_features,
    in_features)`` float32 weight at ``threads`` threads, and the median seconds of each candidate."""

    rows: int
    out_features: int
    in_features: int
    threads: int
    kernel: str
    seconds: dict

    def gbps(self, kernel: str) -> float:
        """GB/s of weight the kernel streamed (4 bytes a weight)."""
        return 4 * self.out_features * self.in_features / self.seconds[kernel] / 1e9

    def __str__(self) -> str:
        rows = "1 row" if self.rows == 1 else "2-3 rows"
        speeds = ", ".join(f"{k} {self.gbps(k):.1f} GB/s" for k in sorted(self.seconds, key=lambda k: self.seconds[k]))
        why = (
            "the fastest"
            if self.kernel != "linear"
            else "the fastest"
            if min(self.seconds, key=lambda k: self.seconds[k]) == "linear"
            else f"no other kernel was {MARGIN:.0%} faster"
        )
        return (
            f"{rows} x ({self.out_features}, {self.in_features}) at {self.threads} thread"
            f"{'s' if self.threads > 1 else ''}: {self.kernel} ({_WHAT[self.kernel]}), {why}; measured {speeds}"
        )


_CHOICES: dict[tuple[int, int, int, int], ProductChoice] = {}  # (rows class, out, in, threads) -> the choice
_clock = time.perf_counter  # the timer (replaceable in tests)
_LOCK = threading.Lock()


def _rows_class(rows: int) -> int:
    return 1 if rows == 1 else 2


def _thread_counts(n: int) -> tuple[int, ...]:
    """The counts a decode step may run at (attnkit._threads tries these): n, n - 1 and 1."""
    return tuple(dict.fromkeys((n, max(1, n - 1), 1)))


def run(kernel: str, x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x2 (rows, in) @ weight.T + bias`` -> ``(rows, out)`` through ``kernel`` (row-major weight)."""
    if kernel == "columns":
        rows = x2.shape[0]
        xc = torch.cat([x2, x2]) if rows == 1 else x2  # MKL streams (out, in) @ (in, 2) with every thread
        y = torch.mm(weight, xc.t()).t()[:rows]  # (rows, out), a view of (out, 2 or 3)
        return y + bias if bias is not None else y.contiguous()
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x2, weight, bias, "none", [], "")
    return F.linear(x2, weight, bias)


def _measure(
    rows: int, out_features: int, in_features: int, threads: int, kernels: tuple[str, ...], w: Tensor
) -> ProductChoice:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {k: [] for k in kernels}
    for k in kernels:  # (first calls: one-time setup, untimed)
        run(k, x, w, None)
    start = _clock()
    for r in range(ROUNDS):
        for k in kernels:
            t0 = _clock()
            run(k, x, w, None)
            times[k].append(_clock() - t0)
        if r >= 2 and _clock() - start > BUDGET:
            break
    seconds = {k: statistics.median(t) for k, t in times.items()}
    best = min(seconds, key=lambda k: seconds[k])
    kernel = best if seconds[best] * (1 + MARGIN) <= seconds["linear"] else "linear"
    return ProductChoice(rows, out_features, in_features, threads, kernel, seconds)


def choose(rows: int, out_features: int, in_features: int, onednn: bool) -> str:
    """The kernel for ``rows`` (1-3) rows times a row-major ``(out_features, in_features)`` float32 weight at
    torch's thread count now; measured on first use (with the other counts a decode step may run at)."""
    n = torch.get_num_threads()
    key = (_rows_class(rows), out_features, in_features, n)
    hit = _CHOICES.get(key)
    if hit is not None:
        return hit.kernel
    kernels = KERNELS if onednn else KERNELS[:2]
    with _LOCK, torch.inference_mode():
        hit = _CHOICES.get(key)
        if hit is not None:
            return hit.kernel
        g = torch.Generator().manual_seed(0)  # (the caller's RNG untouched)
        w = torch.randn(out_features, in_features, generator=g)  # (out, in): a stand-in of the weight's shape
        try:
            for t in _thread_counts(n):
                k = (key[0], out_features, in_features, t)
                if k not in _CHOICES:
                    torch.set_num_threads(t)
                    _CHOICES[k] = _measure(key[0], out_features, in_features, t, kernels, w)
        finally:
            torch.set_num_threads(n)
    return _CHOICES[key].kernel


class DecodeProducts(NamedTuple):
    """The kernels chosen so far for decode-sized products in this process (:func:`decode_products`)."""

    choices: tuple

    def __str__(self) -> str:
        head = (
            "Decode products (1-3 rows x a row-major float32 weight), chosen by timing F.linear, MKL's "
            "two-column product and oneDNN's linear on this machine, once per shape and thread count "
            f"(median of up to {ROUNDS} interleaved calls each; F.linear unless another is {MARGIN:.0%} "
            "faster):"
        )
        if not self.choices:
            return head + "\n  none yet (the first decode step of a float32 model on the CPU chooses)"
        return "\n".join([head, *(f"  {c}" for c in self.choices)])


def decode_products() -> DecodeProducts:
    """What attnkit chose for the decode-sized products run so far in this process, and why.

    Example::

        >>> import torch
        >>> from attnkit.nn import decode_products, linear
        >>> with torch.no_grad():
        ...     _ = linear(torch.randn(1, 64), torch.randn(96, 64))
        >>> any(c.out_features == 96 and c.rows == 1 for c in decode_products().choices)
        True
        >>> print(decode_products())                                 # doctest: +ELLIPSIS
        Decode products (1-3 rows x a row-major float32 weight), chosen by timing ...
    """
    with _LOCK:
        return DecodeProducts(tuple(_CHOICES[k] for k in sorted(_CHOICES)))

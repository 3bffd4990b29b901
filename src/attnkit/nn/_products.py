"""Which kernel multiplies the 1-3 rows of a decode step by a row-major float32 weight: measured per machine.

A decode step of one to three sequences is a matrix-vector product bound by how fast a kernel streams the
weight, and which of PyTorch's kernels streams fastest depends on the CPU, not on the code.  MKL's two-column
product (a single row padded to two) was the fastest on one machine (an Intel CPU: 1.8x oneDNN) and the
slowest on another (an AMD Zen 3, where MKL takes its generic path: 6.7 GB/s against 16.5 for ``F.linear``
at one thread).  So the kernel is chosen by timing the candidates on this machine, once for each product
shape and thread count, and kept:

* ``"columns"``: ``weight @ x.T`` through MKL, one row padded to two;
* ``"linear"``: ``F.linear`` (MKL's matrix-vector product);
* ``"onednn"``: oneDNN's linear kernel (``torch.ops.mkldnn._linear_pointwise``) on the row-major weight.

Each candidate runs on a weight of the product's shape (random values: only the time is read), at each thread
count a decode step may run (the caller's, one fewer, one: what ``decode_threads="auto"`` tries), in
interleaved rounds (each round in another order); the median of each candidate's calls decides, so one call
slowed by another process does not.  ``"linear"`` is kept unless another candidate is :data:`MARGIN` faster
(a single operator, and no thread barrier at one row, whose waits a busy core stretches).  The cost is paid
once per shape (a few milliseconds for a 512 x 1408 weight, about a second for a 32000-word output head), on
the first decode step, which ``decode_threads="auto"`` never times.

The choices are kept between processes, per machine (``attnkit._machine``: the CPU model, cores, instruction
set, torch and its BLAS / oneDNN build), in ``decode-choices-<machine id>.json`` under ``$ATTNKIT_CACHE_DIR``
(else ``$XDG_CACHE_HOME/attnkit`` or ``~/.cache/attnkit``): a later process on the same machine reads its
choice there and times nothing.  A busy core must not decide for every later process, so a choice is stored
only when its measurement shows no sign of one: the fastest call of each candidate must pick the kernel its
median picked (when another process holds a core, most multi-threaded calls wait for it and a few do not),
and at more than one thread no candidate may run :data:`CONTENDED` times slower than it did at one thread
(on a quiet machine more threads do not slow a product down that much; a thread waiting for a taken core
does).  Such a choice serves the process that measured it, and the next process measures again.
``ATTNKIT_CACHE_DIR=""`` stores and reads nothing; :func:`clear_decode_choices` forgets every choice (in the
process and this machine's file), so the next products measure again.

:func:`decode_products` reports every choice made so far, with the speeds measured and where each came from.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _machine, _threads

Tensor = torch.Tensor

KERNELS = ("linear", "columns", "onednn")
ROUNDS = 5  # rounds of one call per candidate (fewer when a shape's rounds pass BUDGET seconds, at least 3)
BUDGET = 0.3  # seconds of measuring per shape and thread count after which the rounds stop (after the third)
MARGIN = 0.10  # another kernel must be this much faster than "linear" to be chosen
CONTENDED = 2.0  # a candidate this much slower at n threads than at one: n threads met a busy core (not stored)
KIND = _machine.DECODE  # the stored file's name: decode-choices-<machine id>.json (shared with the thread counts)
_WHAT = {
    "linear": "F.linear, MKL's matrix-vector product",
    "columns": "MKL's two-column product",
    "onednn": "oneDNN's linear kernel",
}


class ProductChoice(NamedTuple):
    """One choice: the kernel for ``rows`` rows (1, or 2 standing for 2-3) times an ``(out_features,
    in_features)`` float32 weight at ``threads`` threads; the median seconds of each candidate's calls
    (``seconds``) and the fastest call of each (``fastest``); ``origin``: ``"measured"`` in this process or
    ``"stored"`` (read from this machine's file, measured by an earlier process); ``unstored``: why a choice
    measured now is kept from the file (a sign of another process on a core), empty when it is not."""

    rows: int
    out_features: int
    in_features: int
    threads: int
    kernel: str
    seconds: dict
    fastest: dict | None = None
    origin: str = "measured"
    unstored: str = ""

    def gbps(self, kernel: str) -> float:
        """GB/s of weight the kernel streamed (4 bytes a weight), at its median call."""
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
        if self.origin == "stored":
            where = "stored: measured by an earlier process on this machine"
        elif not self.unstored:
            where = "measured now"
        else:
            where = f"measured now, not stored: {self.unstored}; the next process measures again"
        return (
            f"{rows} x ({self.out_features}, {self.in_features}) at {self.threads} thread"
            f"{'s' if self.threads > 1 else ''}: {self.kernel} ({_WHAT[self.kernel]}), {why}; median {speeds} "
            f"({where})"
        )


_CHOICES: dict[tuple[int, int, int, int], ProductChoice] = {}  # (rows class, out, in, threads) -> the choice
_FILES: dict[str, dict[str, dict]] = {}  # a stored file's path ("" with storing off) -> its records, read once
_PROBLEM: list[str] = []  # why the last write of the file failed (empty when it did not)
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
        for k in kernels[r % len(kernels) :] + kernels[: r % len(kernels)]:  # (each round starts elsewhere)
            t0 = _clock()
            run(k, x, w, None)
            times[k].append(_clock() - t0)
        if r >= 2 and _clock() - start > BUDGET:
            break
    seconds = {k: statistics.median(t) for k, t in times.items()}
    fastest = {k: min(t) for k, t in times.items()}
    return ProductChoice(rows, out_features, in_features, threads, _pick(seconds), seconds, fastest)


def _pick(seconds: dict[str, float]) -> str:
    """The fastest kernel, but "linear" unless another is MARGIN faster."""
    best = min(seconds, key=lambda k: seconds[k])
    return best if seconds[best] * (1 + MARGIN) <= seconds["linear"] else "linear"


def _contended(c: ProductChoice, one: ProductChoice | None) -> str:
    """Why the measurement ``c`` may have met another process on a core ("" when it shows no sign of one);
    ``one`` is the same product's measurement at one thread."""
    if c.fastest and _pick(c.fastest) != c.kernel:
        return f"its fastest calls pick {_pick(c.fastest)} (calls slowed by another process?)"
    if one is not None and c.threads > 1:
        slower = {k: c.seconds[k] / one.seconds[k] for k in c.seconds if k in one.seconds}
        worst = max(slower, key=lambda k: slower[k], default=None)
        if worst is not None and slower[worst] > CONTENDED:
            return (
                f"{worst} ran {slower[worst]:.1f}x slower at {c.threads} threads than at 1 (a core busy with "
                "another process?)"
            )
    return ""


def _name(key: tuple[int, int, int, int]) -> str:
    """A choice's key in the stored file: ``"<rows>x<out>x<in>@<threads>"``."""
    return "{}x{}x{}@{}".format(*key)


def _record(c: ProductChoice) -> dict:
    return {"kernel": c.kernel, "seconds": c.seconds, "fastest": c.fastest}


def _from_record(key: tuple[int, int, int, int], record: dict | None, kernels: tuple[str, ...]) -> ProductChoice | None:
    """The stored choice of ``key``, or None when there is none usable (a record of other candidates, or
    malformed: the product is measured again)."""
    if record is None:
        return None

    def times(d) -> dict | None:
        ok = isinstance(d, dict) and set(d) == set(kernels)
        ok = ok and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in d.values())
        return {k: float(d[k]) for k in kernels} if ok else None

    seconds, fastest = times(record.get("seconds")), times(record.get("fastest"))
    if seconds is None or fastest is None or record.get("kernel") not in kernels:
        return None
    return ProductChoice(*key, record["kernel"], seconds, fastest, "stored")


def _stored() -> dict[str, dict]:
    """This machine's stored records (read from the file on first use in the process)."""
    where = str(_machine.path(KIND) or "")
    if where not in _FILES:
        _FILES[where] = _machine.load(KIND) if where else {}
    return _FILES[where]


def _store(new: list[ProductChoice]) -> None:
    """Adds the ones of ``new`` that met no busy core to this machine's file (read again first: another process may have
    added its own since)."""
    keep = {_name(c[:3] + (c.threads,)): _record(c) for c in new if not c.unstored}
    where = _machine.path(KIND)
    if not keep or where is None:
        return
    records, problem = _machine.merge(KIND, keep)
    _PROBLEM[:] = [problem] if problem else []
    _FILES[str(where)] = records


def choose(rows: int, out_features: int, in_features: int, onednn: bool) -> str:
    """The kernel for ``rows`` (1-3) rows times a row-major ``(out_features, in_features)`` float32 weight at
    torch's thread count now: stored for this machine, else measured on first use (with the other counts a
    decode step may run at)."""
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
        stored = _stored()
        measured: list[ProductChoice] = []
        w: Tensor | None = None
        try:
            for t in _thread_counts(n):
                k = (key[0], out_features, in_features, t)
                if k in _CHOICES:
                    continue
                found = _from_record(k, stored.get(_name(k)), kernels)
                if found is not None:
                    _CHOICES[k] = found
                    continue
                if w is None:
                    g = torch.Generator().manual_seed(0)  # (the caller's RNG untouched)
                    w = torch.randn(out_features, in_features, generator=g)  # (out, in): a stand-in of the shape
                torch.set_num_threads(t)
                _CHOICES[k] = _measure(key[0], out_features, in_features, t, kernels, w)
                measured.append(_CHOICES[k])
        finally:
            torch.set_num_threads(n)
        for i, c in enumerate(measured):
            why = _contended(c, _CHOICES.get(c[:3] + (1,)))
            if why:
                measured[i] = _CHOICES[c[:3] + (c.threads,)] = c._replace(unstored=why)
        _store(measured)
    return _CHOICES[key].kernel


def clear_decode_choices() -> str | None:
    """Forgets every decode-time choice, the products' kernels and the decode steps' thread counts: this
    process's and the ones stored for this machine, so the next decode products are measured again and the next
    thread policies (of a new model, batch size or Engine) probe again (after a change to the machine that its
    key does not see, or to re-measure on a quiet machine); a policy already running keeps its count and
    re-checks it as usual.  Returns the path of the stored file it deleted, or None when there was none (or
    storing is off: ``ATTNKIT_CACHE_DIR=""``).

    Example::

        >>> from attnkit.nn import clear_decode_choices, decode_products
        >>> _ = clear_decode_choices()
        >>> decode_products().choices
        ()
    """
    with _LOCK:
        _CHOICES.clear()
        _FILES.clear()
        _PROBLEM.clear()
        _threads.forget()
        removed = _machine.remove(KIND)
    return None if removed is None else str(removed)


class DecodeProducts(NamedTuple):
    """The kernels chosen so far for decode-sized products in this process (:func:`decode_products`), the
    thread counts chosen for decode steps (``threads``: ``attnkit._threads.ThreadChoice``, one per step shape
    and available count), and the file that keeps both for this machine (``file``: None when storing is off;
    ``problem``: why it could not be written, if so)."""

    choices: tuple
    file: str | None = None
    problem: str | None = None
    threads: tuple = ()

    def __str__(self) -> str:
        head = (
            "Decode products (1-3 rows x a row-major float32 weight), chosen by timing F.linear, MKL's "
            "two-column product and oneDNN's linear on this machine, once per shape and thread count "
            f"(median of up to {ROUNDS} interleaved calls each; F.linear unless another is {MARGIN:.0%} "
            "faster):"
        )
        if self.file is None:
            where = "  stored choices: off (ATTNKIT_CACHE_DIR is empty): every process measures"
        else:
            where = f"  stored choices: {self.file} (read by later processes on this machine)"
            if self.problem:
                where += f"; {self.problem}: the choices serve this process only"
        products = [f"  {c}" for c in self.choices] or [
            "  none yet (the first decode step of a float32 model on the CPU chooses)"
        ]
        threads = (
            f"Decode-step thread counts (decode_threads='auto'), chosen by timing the live decode steps at the "
            f"caller's count, one fewer and one, per model, batch and available count (the fastest by median step "
            f"time; stored only without signs of a busy core, re-checked every {_threads.RECHECK}-"
            f"{_threads.RECHECK_MAX} steps):"
        )
        counts = [f"  {c}" for c in self.threads] or ["  none yet (the first generation or Engine on the CPU chooses)"]
        return "\n".join([head, where, *products, threads, *counts])


def decode_products() -> DecodeProducts:
    """What attnkit chose for the decode-sized products run so far in this process, why, the GB/s each
    candidate streamed, and whether each choice was measured now or read from this machine's stored file; and
    the thread count each kind of decode step runs at (``decode_threads="auto"``), with the median step time
    measured at each count and where it came from.

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
        where = _machine.path(KIND)
        problem = _PROBLEM[0] if _PROBLEM else _threads.stored_problem()
        return DecodeProducts(
            tuple(_CHOICES[k] for k in sorted(_CHOICES)),
            None if where is None else str(where),
            problem,
            _threads.thread_choices(),
        )

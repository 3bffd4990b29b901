"""How many threads a CPU decode step uses: measured on the live steps, re-checked as they go.

A decode step is a few dozen small products and attention calls.  PyTorch splits each one evenly over its
threads (OpenMP's static schedule) and waits for the slowest.  When another process keeps one core busy (a
data loader, a second job, a notebook kernel), the thread that shares that core gets a fraction of it, and
every product of the step waits for it, while the thread that finished first spins at the barrier: on
the 2-core machine of ``benchmarks/generate.py`` a batch-8 float32 step took 39.5 ms at 2 threads with a
busy loop on one core, against 24.9 ms at 1 thread on a quiet machine (and layouts with more parallel
regions per product fared worse: 125 and 179 ms).  One thread on the free core is then the faster choice;
on a quiet machine every thread is.  No rule read off the machine tells the two apart (the load average
counts this process too, and affinity masks say nothing of other processes), so :class:`DecodeThreads`
times the steps themselves.

What it costs a short generation is kept small:

* the first step of a policy runs at the caller's count untimed (it pays one-time costs: weight copies,
  kernel setup, which would mislead the comparison);
* then each candidate count runs one step in turn (a round); a count at least :data:`MARGIN` faster than
  every other decides at once (the usual case: a busy core makes 2 threads 2-4x slower, a quiet machine
  makes 1 thread 1.3-1.6x slower), else rounds go on, up to :data:`PROBE`, and the medians decide;
* afterwards the steps run at the chosen count.  Each other candidate runs one step again after
  :data:`RECHECK` steps, an interval that doubles (up to :data:`RECHECK_MAX`) while re-checks keep the
  choice and starts over when one changes it; and at once when two steps in a row take :data:`SLOWER`
  times the chosen count's recent median (the machine became busy).  A re-checked count wins when its
  fresh step is :data:`MARGIN` faster than that median;
* :func:`attnkit.generate` keeps one policy per model and batch size, so later generations start from
  what earlier ones decided; an :class:`attnkit.decoding.Engine` keeps its own.

Decisions are also kept between processes, per machine (``attnkit._machine``), in the file of the decode-time
choices (``decode-choices-<machine id>.json``, beside the products' kernels), keyed by the steps' shape
(:func:`step_shape`: the model and the batch) and the caller's count.  A policy whose steps have a stored count
starts from it (its first step untimed as ever, then the stored count, no probing round) and re-checks the
other counts as above, so a changed load is still noticed.  A decision is written only when it differs from the
stored one and its step times show no sign of a busy core (the rules of the products' kernels): the fastest
step of each count picks the count the medians picked, and no count above one runs :data:`CONTENDED` times
slower than one thread, nor (against one thread) :data:`CONTENDED` times slower than when the stored count was
measured.  So a process that finds a core busy runs at fewer threads itself without telling later processes to.
Nothing is read or written per step: the stored count is looked up when a policy meets the caller's count, and
the file written only on a decision.  ``ATTNKIT_CACHE_DIR=""`` stores and reads nothing;
:func:`attnkit.nn.clear_decode_choices` forgets the stored counts too; :func:`attnkit.nn.decode_products` lists
every count chosen or read so far, with its step times and where it came from.

Torch's thread count is the caller's (process-wide) setting: a step changes it only for its own
duration and gives the caller's count back when it ends, also on error.  Python threads of the caller
that run torch operations during a step see the step's count meanwhile.

OpenMP's own waiting can also be changed, before the process starts, with ``OMP_WAIT_POLICY=PASSIVE``
(threads sleep at barriers instead of spinning); attnkit does not set it: it is the process's setting.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
from collections import deque
from typing import NamedTuple

import torch

from . import _machine

PROBE = 3  # most rounds (one step at each candidate count) before the medians decide
MARGIN = 0.25  # a count whose step time is below 1 / (1 + MARGIN) of every other's wins without more rounds
RECHECK = 32  # steps at the chosen count before each other candidate runs one step again ...
RECHECK_MAX = 256  # ... an interval that doubles up to this while re-checks keep the choice
SLOWER = 1.5  # two steps in a row this much slower than the chosen count's recent median: re-check now
_KEEP = 5  # recent step times kept per count (their median decides)
CONTENDED = 2.0  # a count above one this much slower than one thread (or than the stored entry said): not stored
KIND = _machine.DECODE  # the stored file: decode-choices-<machine id>.json, shared with the products' kernels
_PREFIX = "threads "  # the stored keys of thread counts: "threads <step shape>@<caller's count>"


def _candidates(n: int) -> tuple[int, ...]:
    """The thread counts tried for a caller that runs ``n``: all of them, one fewer (a core taken by another
    process) and one (several taken)."""
    return tuple(dict.fromkeys((n, max(1, n - 1), 1)))


def _median(times) -> float:
    s = sorted(times)
    return s[len(s) // 2]


def step_shape(model, rows: str) -> str | None:
    """What a decode step's time depends on besides the machine and its thread count, as the stored choices'
    key: the model (its class, width and layers where its config names them, its parameter count and dtypes,
    and a digest of every parameter's and buffer's shape and dtype) and ``rows`` (the step's batch, in words).
    None for a model that is not a ``torch.nn.Module`` (nothing is stored for it).

    Example::

        >>> import torch
        >>> from attnkit._threads import step_shape
        >>> step_shape(torch.nn.Linear(8, 4), "1 row")                   # doctest: +ELLIPSIS
        'Linear, 0.0M float32 parameters [...]; 1 row'
    """
    if not isinstance(model, torch.nn.Module):
        return None
    tensors = [*model.parameters(), *model.buffers()]
    digest = hashlib.sha256(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()).hexdigest()[:8]
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    parts = [type(model).__name__]
    config = getattr(model, "config", None)
    for words, names in (
        ("width", ("d_model", "hidden_size", "n_embd")),
        ("layers", ("n_layers", "num_hidden_layers")),
    ):
        value = next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)
        if value is not None:
            parts.append(f"width {value}" if words == "width" else f"{value} layers")
    count = sum(p.numel() for p in model.parameters())
    parts.append(f"{count / 1e6:.1f}M {'/'.join(dtypes) or 'no'} parameters [{digest}]")
    return f"{', '.join(parts)}; {rows}"


class ThreadChoice(NamedTuple):
    """The thread count decode steps of ``step`` (:func:`step_shape`) run at when the caller runs
    ``available`` threads: ``threads``, from the median step time at each count tried (``seconds``; ``fastest``:
    the fastest step at each).  ``origin``: ``"measured"`` in this process or ``"stored"`` (read from this
    machine's file, measured by an earlier process); ``unstored``: why a measured choice was kept from the file
    (signs of another process on a core; empty when it was not); ``stored``: the count the file holds for this
    step now (None: none)."""

    step: str
    available: int
    threads: int
    seconds: dict
    fastest: dict
    origin: str = "measured"
    unstored: str = ""
    stored: int | None = None

    def __str__(self) -> str:
        ms = ", ".join(f"{c} thread{'s' if c > 1 else ''} {1e3 * s:.2f} ms" for c, s in sorted(self.seconds.items()))
        if self.origin == "stored":
            where = "stored: measured by an earlier process on this machine; re-checked as the steps go"
        elif self.unstored:
            where = f"measured now, not stored: {self.unstored}"
            if self.stored is not None:
                where += f"; the file keeps {self.stored}"
        else:
            where = "measured now, stored"
        best = min(self.seconds, key=lambda c: self.seconds[c])
        why = "the fastest by median step time" if best == self.threads else f"kept: {best} was not {MARGIN:.0%} faster"
        return (
            f"{self.step}, {self.available} thread{'s' if self.available > 1 else ''} available: {self.threads}, "
            f"{why}; median step {ms} ({where})"
        )


_CHOICES: dict[str, ThreadChoice] = {}  # stored key -> the latest choice of this process for that step
_FILES: dict[str, dict[str, dict]] = {}  # the stored file's path ("" with storing off) -> its records, read once
_PROBLEM: list[str] = []  # why the last write of the file failed (empty when it did not)
_LOCK = threading.Lock()


def _stored() -> dict[str, dict]:
    """This machine's stored records (read from the file on first use in the process)."""
    where = str(_machine.path(KIND) or "")
    if where not in _FILES:
        _FILES[where] = _machine.load(KIND) if where else {}
    return _FILES[where]


def _from_record(key: str, step: str, available: int, record: dict | None) -> ThreadChoice | None:
    """The stored choice of ``key`` (None when there is none usable: the steps are timed as in a new process)."""
    if not isinstance(record, dict):
        return None
    counts = _candidates(available)

    def times(d) -> dict | None:
        ok = isinstance(d, dict) and {str(c) for c in counts} == set(d)
        ok = ok and all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in d.values())
        return {c: float(d[str(c)]) for c in counts} if ok else None

    seconds, fastest = times(record.get("seconds")), times(record.get("fastest"))
    chosen = record.get("threads")
    if seconds is None or fastest is None or chosen not in counts or isinstance(chosen, bool):
        return None
    return ThreadChoice(step, available, chosen, seconds, fastest, "stored", "", chosen)


def _lookup(step: str, available: int) -> ThreadChoice | None:
    """The count stored for decode steps of ``step`` at ``available`` threads on this machine, if any."""
    key = f"{_PREFIX}{step}@{available}"
    with _LOCK:
        found = _from_record(key, step, available, _stored().get(key))
        if found is not None and key not in _CHOICES:
            _CHOICES[key] = found
    return found


def _contended(chosen: int, seconds: dict, fastest: dict, before: ThreadChoice | None) -> str:
    """Why the step times may have met another process on a core ("" when they show no sign of one): the
    fastest steps pick another count than the medians did, or a count above one ran :data:`CONTENDED` times
    slower than one thread, or than the stored entry's measurement said it runs relative to one thread
    (``before``)."""
    quickest = min(fastest, key=lambda c: fastest[c])
    if quickest != chosen:
        return f"its fastest steps pick {quickest} thread(s) (steps slowed by another process?)"
    if 1 not in seconds:
        return ""
    for c in sorted(seconds, reverse=True):
        if c == 1:
            continue
        ratio = seconds[c] / seconds[1]
        if ratio > CONTENDED:
            return f"{c} threads ran {ratio:.1f}x slower than 1 (a core busy with another process?)"
        if before is not None and c in before.seconds and 1 in before.seconds:
            was = before.seconds[c] / before.seconds[1]
            if ratio > CONTENDED * was:
                return (
                    f"{c} threads ran {ratio / was:.1f}x slower against 1 than when the stored count was measured "
                    "(a core busy with another process?)"
                )
    return ""


def _settle(step: str, available: int, chosen: int, seconds: dict, fastest: dict) -> None:
    """A policy decided (a probe or a re-check): kept for :func:`thread_choices`, and written to this machine's
    file when it differs from what the file holds and its step times show no sign of a busy core."""
    key = f"{_PREFIX}{step}@{available}"
    with _LOCK:
        records = _stored()
        before = _from_record(key, step, available, records.get(key))
        why = _contended(chosen, seconds, fastest, before)
        stored = None if before is None else before.threads
        where = _machine.path(KIND)
        if where is None:
            why = "storing is off (ATTNKIT_CACHE_DIR is empty)" + (f"; and {why}" if why else "")
        elif not why and stored != chosen and set(seconds) == set(_candidates(available)):
            record = {
                "threads": chosen,
                "seconds": {str(c): s for c, s in seconds.items()},
                "fastest": {str(c): s for c, s in fastest.items()},
            }
            records, problem = _machine.merge(KIND, {key: record})
            _PROBLEM[:] = [problem] if problem else []
            _FILES[str(where)] = records
            stored = chosen if problem is None else stored
        _CHOICES[key] = ThreadChoice(step, available, chosen, dict(seconds), dict(fastest), "measured", why, stored)


def thread_choices() -> tuple[ThreadChoice, ...]:
    """The thread counts chosen (or read from this machine's file) for decode steps so far in this process,
    one per step shape and available count, the latest of each."""
    with _LOCK:
        return tuple(_CHOICES[k] for k in sorted(_CHOICES))


def stored_problem() -> str | None:
    """Why the last write of a thread choice to this machine's file failed (None when it did not)."""
    return _PROBLEM[0] if _PROBLEM else None


def forget() -> None:
    """Forgets this process's thread choices and what it read from the file (the file is the caller's to
    remove: ``attnkit.nn.clear_decode_choices``); live policies keep their counts and re-check as usual."""
    with _LOCK:
        _CHOICES.clear()
        _FILES.clear()
        _PROBLEM.clear()


class DecodeThreads:
    """Picks the thread count of each decode step of one decoding loop (a generation, an Engine).

    ``threads="auto"`` tries the caller's count, one fewer and one (:func:`_candidates`) on the live steps
    and keeps the fastest, re-checking as it goes (module doc); an int uses exactly that many threads for the
    steps; None leaves torch's count alone.  ``clock`` is the timer (``time.perf_counter``; replaceable in
    tests).  ``shape``: what the steps are (:func:`step_shape`), the key of the count stored for this machine:
    with it, ``"auto"`` starts from the stored count instead of probing, and stores what it decides (module doc);
    None stores and reads nothing.

    Example::

        >>> import torch
        >>> from attnkit._threads import DecodeThreads
        >>> policy, before = DecodeThreads("auto"), torch.get_num_threads()
        >>> with policy.step():
        ...     _ = torch.ones(4) @ torch.ones(4)
        >>> torch.get_num_threads() == before        # the caller's count is given back after each step
        True
    """

    def __init__(self, threads: str | int | None = "auto", clock=time.perf_counter, shape: str | None = None):
        if (
            threads is not None
            and threads != "auto"
            and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1)
        ):
            raise ValueError(
                f"decode_threads={threads!r} must be 'auto' (measure 1 thread against more on the "
                f"live decode steps), a positive int, or None (leave torch's thread count alone)"
            )
        self.threads = threads
        self.shape = shape
        self._clock = clock
        self._steps = 0  # steps run (all of them, probes and re-checks too)
        self._base: int | None = None  # the caller's count the candidates were made for
        self._reset(None)

    def _reset(self, caller: int | None) -> None:
        self._base = caller
        self._chosen: int | None = caller
        self._times: dict[int, deque] = {}
        self._warm = False  # the first (untimed) step ran
        self._probing = True  # deciding for the first time
        self._rounds = 0  # probing rounds done
        self._plan: deque[int] = deque()  # counts queued for the next steps (a round, a re-check)
        self._interval = RECHECK  # steps at the chosen count before the next re-check
        self._since = 0  # steps at the chosen count since the last decision
        self._slow = 0  # steps in a row SLOWER than the chosen count's median
        self._periodic = False  # the queued re-check is the periodic one (not a slowdown's)
        self._stored: ThreadChoice | None = None  # the stored choice the steps started from (no probing)
        if caller is not None and self.threads == "auto" and self.shape and len(_candidates(caller)) > 1:
            self._stored = _lookup(self.shape, caller)
            if self._stored is not None:
                self._probing, self._chosen = False, self._stored.threads

    def __str__(self) -> str:
        """What the policy runs the steps at and why: the count, and the median step time it measured at each
        count (or the stored choice it started from).  Every policy's choices are listed by
        :func:`attnkit.nn.decode_products`."""
        if self.threads is None:
            return "decode threads: torch's count, left alone (decode_threads=None)"
        if self.threads != "auto":
            return f"decode threads: {self.threads}, as asked (decode_threads={self.threads})"
        if self._stored is not None and set(self._times) <= {self._chosen}:  # (no re-check yet)
            return (
                f"decode threads: {self._chosen} of the caller's {self._base}, stored by an earlier process for this "
                f"machine and these steps ({self._stored.step}), where its median step took "
                + ", ".join(f"{1e3 * v:.2f} ms at {c}" for c, v in sorted(self._stored.seconds.items()))
                + f"; the other counts are tried again in {max(0, self._interval - self._since)} steps, or at once "
                f"if steps slow down ({self._steps} steps run)"
            )
        if self._base is None or not self._times:
            return "decode threads: the caller's count until the steps have been timed (decode_threads='auto')"
        measured = ", ".join(
            f"{c} thread{'s' if c > 1 else ''} {1e3 * _median(t):.2f} ms" for c, t in sorted(self._times.items())
        )
        if self._probing:
            state = f"deciding (round {self._rounds + 1} of at most {PROBE}), {self._base} thread(s) meanwhile"
        else:
            state = (
                f"{self._chosen} of the caller's {self._base}, the fastest by median step time; the other counts are"
                f" tried again in {max(0, self._interval - self._since)} steps, or at once if steps slow down"
            )
        return f"decode threads: {state}; median step measured at {measured} ({self._steps} steps run)"

    @property
    def chosen(self) -> int | None:
        """The count the steps run at now (None before the first step, or when torch's count is left alone)."""
        return self._chosen

    def _next(self, caller: int) -> int | None:
        if self.threads is None:
            return None
        if self.threads != "auto":
            return int(self.threads)
        if caller != self._base:  # (the caller changed its count between steps: start again)
            self._reset(caller)
        cands = _candidates(caller)
        if len(cands) == 1 or not self._warm:
            return caller
        if self._probing and not self._plan:
            self._plan.extend(cands)  # a round: each candidate once
        return self._plan[0] if self._plan else self._chosen

    def _record(self, n: int, seconds: float) -> None:
        self._steps += 1
        if not self._warm:  # (the first step: one-time costs, not timed into any decision)
            self._warm = True
            return
        self._times.setdefault(n, deque(maxlen=_KEEP)).append(seconds)
        if self._plan and self._plan[0] == n:
            self._plan.popleft()
            if not self._plan:
                self._decide()
            return
        if n != self._chosen:  # (a single candidate: nothing to decide)
            return
        self._since += 1
        recent = self._times[n]
        self._slow = self._slow + 1 if len(recent) >= 3 and seconds > SLOWER * _median(recent) else 0
        if self._slow >= 2 or self._since >= self._interval:
            self._periodic = self._slow < 2
            if not self._periodic:  # (the slow steps are the chosen count's times now)
                self._times[n] = deque(list(recent)[-self._slow :], maxlen=_KEEP)
            for c in _candidates(self._base):
                if c != self._chosen:
                    self._times.pop(c, None)  # (old times of a count say nothing of the machine now)
                    self._plan.append(c)

    def _decide(self) -> None:
        """A probing round or a re-check ended: keep or change the chosen count."""
        medians = {c: _median(t) for c, t in self._times.items()}
        if self._probing:
            self._rounds += 1
            best = min(medians, key=medians.get)
            clear = all(medians[best] * (1 + MARGIN) <= m for c, m in medians.items() if c != best)
            if not (clear or self._rounds >= PROBE):
                return
            self._probing, self._chosen, self._interval = False, best, RECHECK
        else:
            others = {c: m for c, m in medians.items() if c != self._chosen}
            best = min(others, key=others.get)
            if others[best] * (1 + MARGIN) <= medians[self._chosen]:
                self._chosen, self._interval = best, RECHECK
            elif self._periodic:
                self._interval = min(2 * self._interval, RECHECK_MAX)
        self._since = self._slow = 0
        if self.shape and self._base is not None and self._chosen is not None:
            fastest = {c: min(t) for c, t in self._times.items()}
            _settle(self.shape, self._base, self._chosen, medians, fastest)

    @contextlib.contextmanager
    def follow(self):
        """Runs a step that is not a decode step (a prefill, a step with prompt chunks: its time says nothing
        of the decode steps') at the count the decode steps run at now, untimed; torch's count is the caller's
        again afterwards.  Before the policy has chosen (and with None), torch's count is left alone."""
        caller = torch.get_num_threads()
        if self.threads is None:
            n = caller
        elif self.threads != "auto":
            n = int(self.threads)
        else:
            n = self._chosen if self._base == caller and self._chosen is not None else caller
        if n == caller:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(caller)

    @contextlib.contextmanager
    def step(self):
        """Runs one decode step (the block) at the chosen thread count, timing it; torch's count is the
        caller's again afterwards."""
        caller = torch.get_num_threads()
        n = self._next(caller)
        if n is None or (n == caller and self.threads != "auto"):
            yield
            return
        if n != caller:
            torch.set_num_threads(n)
        try:
            t0 = self._clock()
            yield
            if self.threads == "auto":
                self._record(n, self._clock() - t0)
            else:
                self._chosen = n
        finally:
            if torch.get_num_threads() != caller:
                torch.set_num_threads(caller)

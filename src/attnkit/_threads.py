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

Torch's thread count is the caller's (process-wide) setting: a step changes it only for its own
duration and gives the caller's count back when it ends, also on error.  Python threads of the caller
that run torch operations during a step see the step's count meanwhile.

OpenMP's own waiting can also be changed, before the process starts, with ``OMP_WAIT_POLICY=PASSIVE``
(threads sleep at barriers instead of spinning); attnkit does not set it: it is the process's setting.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

PROBE = 3  # most rounds (one step at each candidate count) before the medians decide
MARGIN = 0.25  # a count whose step time is below 1 / (1 + MARGIN) of every other's wins without more rounds
RECHECK = 32  # steps at the chosen count before each other candidate runs one step again ...
RECHECK_MAX = 256  # ... an interval that doubles up to this while re-checks keep the choice
SLOWER = 1.5  # two steps in a row this much slower than the chosen count's recent median: re-check now
_KEEP = 5  # recent step times kept per count (their median decides)


def _candidates(n: int) -> tuple[int, ...]:
    """The thread counts tried for a caller that runs ``n``: all of them, one fewer (a core taken by another
    process) and one (several taken)."""
    return tuple(dict.fromkeys((n, max(1, n - 1), 1)))


def _median(times) -> float:
    s = sorted(times)
    return s[len(s) // 2]


class DecodeThreads:
    """Picks the thread count of each decode step of one decoding loop (a generation, an Engine).

    ``threads="auto"`` tries the caller's count, one fewer and one (:func:`_candidates`) on the live steps
    and keeps the fastest, re-checking as it goes (module doc); an int uses exactly that many threads for the
    steps; None leaves torch's count alone.  ``clock`` is the timer (``time.perf_counter``; replaceable in
    tests).

    Example::

        >>> import torch
        >>> from attnkit._threads import DecodeThreads
        >>> policy, before = DecodeThreads("auto"), torch.get_num_threads()
        >>> with policy.step():
        ...     _ = torch.ones(4) @ torch.ones(4)
        >>> torch.get_num_threads() == before        # the caller's count is given back after each step
        True
    """

    def __init__(self, threads: str | int | None = "auto", clock=time.perf_counter):
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

    def __str__(self) -> str:
        """What the policy runs the steps at and why: the count, and the median step time it measured at each
        count.  The count is not stored between processes (unlike the decode products' kernels): it follows the
        load of the machine now, which a later process does not share."""
        if self.threads is None:
            return "decode threads: torch's count, left alone (decode_threads=None)"
        if self.threads != "auto":
            return f"decode threads: {self.threads}, as asked (decode_threads={self.threads})"
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

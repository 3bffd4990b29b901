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
times the steps themselves: it alternates the candidate thread counts for the first steps, keeps the
fastest, and tries the others again every :data:`RECHECK` steps, so that a machine that becomes busy
(or quiet) mid-generation is followed.

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

PROBE = 3  # steps at each candidate count when decoding starts
RECHECK = 32  # after this many steps at the chosen count, one step at each other candidate
_KEEP = 5  # recent step times kept per count (their median decides)


def _candidates(n: int) -> tuple[int, ...]:
    """The thread counts tried for a caller that runs ``n``: all of them, one fewer (a core taken by another
    process) and one (several taken)."""
    return tuple(dict.fromkeys((n, max(1, n - 1), 1)))


class DecodeThreads:
    """Picks the thread count of each decode step of one decoding loop (a generation, an Engine).

    ``threads="auto"`` tries the caller's count, one fewer and one (:func:`_candidates`) on the live steps
    and keeps the fastest (module doc); an int uses exactly that many threads for the steps; None leaves
    torch's count alone.  ``clock`` is the timer (``time.perf_counter``; replaceable in tests).

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
        if threads is not None and threads != "auto" and (isinstance(threads, bool) or not isinstance(threads, int)
                                                          or threads < 1):
            raise ValueError(f"decode_threads={threads!r} must be 'auto' (measure 1 thread against more on the "
                             f"live decode steps), a positive int, or None (leave torch's thread count alone)")
        self.threads = threads
        self._clock = clock
        self._times: dict[int, deque] = {}
        self._steps = 0
        self._since_check = 0
        self._chosen: int | None = None
        self._base: int | None = None  # the caller's count the candidates were made for

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
            self._base, self._times, self._steps, self._since_check = caller, {}, 0, 0
            self._chosen = caller
        cands = _candidates(caller)
        if len(cands) == 1:
            return caller
        if self._steps < PROBE * len(cands):  # probing: the candidates in turn
            return cands[self._steps % len(cands)]
        if self._since_check >= RECHECK:  # re-check: each other candidate once, then back
            k = self._since_check - RECHECK
            others = [c for c in cands if c != self._chosen]
            if k < len(others):
                return others[k]
            self._since_check = 0
        return self._chosen

    def _record(self, n: int, seconds: float) -> None:
        self._times.setdefault(n, deque(maxlen=_KEEP)).append(seconds)
        self._steps += 1
        probing = PROBE * len(_candidates(self._base))
        if self._steps > probing:
            self._since_check += 1
        if self._steps >= probing:
            medians = {c: sorted(t)[len(t) // 2] for c, t in self._times.items()}
            self._chosen = min(medians, key=medians.get)

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

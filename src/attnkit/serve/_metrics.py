"""The server's metrics, in the Prometheus text exposition format (version 0.0.4).

Gauges: requests running and waiting, KV blocks in use and in the pool.  Counters: prompt and generated
tokens, requests finished by reason, requests rejected.  Histograms: time to first token (from the request's
arrival) and inter-token latency (between two tokens of one request), in seconds.
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["Metrics", "Histogram"]

# bucket upper bounds in seconds (the +Inf bucket is implicit)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)


class Histogram:
    """Observations counted into cumulative buckets ``le`` (seconds), with their sum and count.

    Example::

        >>> h = Histogram((0.1, 1.0))
        >>> for x in (0.05, 0.5, 3.0):
        ...     h.observe(x)
        >>> h.cumulative(), h.count, round(h.sum, 2)
        ([1, 2, 3], 3, 3.55)
    """

    def __init__(self, buckets):
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.count += 1

    def cumulative(self) -> list[int]:
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out


def _value(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


class Metrics:
    """What ``GET /metrics`` reports, recorded by :class:`~attnkit.serve.AsyncEngine` from its worker thread and
    read from the server's; :meth:`render` gives the Prometheus text."""

    def __init__(self, prefix: str = "attnkit"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self.state = {"running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": 0}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    # ------------------------------------------------------------------ recording

    def set_state(self, state: dict) -> None:
        with self._lock:
            self.state = dict(state)

    def request_started(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)
            self.generation_tokens += 1

    def next_token(self, seconds: float) -> None:
        with self._lock:
            self.itl.observe(seconds)
            self.generation_tokens += 1

    def request_finished(self, reason: str) -> None:
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1

    def request_rejected(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    # ------------------------------------------------------------------ reading

    def render(self) -> str:
        """The Prometheus text format: ``# HELP`` and ``# TYPE`` lines, then the samples."""
        p = self.prefix
        with self._lock:
            lines: list[str] = []

            def metric(name, kind, help_, samples):
                lines.append(f"# HELP {p}_{name} {help_}")
                lines.append(f"# TYPE {p}_{name} {kind}")
                for suffix, labels, value in samples:
                    lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                    lines.append(f"{p}_{name}{suffix}{lab} {_value(value)}")

            s = self.state
            metric(
                "requests_running", "gauge", "Requests being decoded in the running batch.", [("", {}, s["running"])]
            )
            metric(
                "requests_waiting",
                "gauge",
                "Requests queued for a slot in the running batch.",
                [("", {}, s["waiting"])],
            )
            metric("kv_blocks_used", "gauge", "KV cache blocks held by running requests.", [("", {}, s["blocks_used"])])
            metric("kv_blocks_total", "gauge", "KV cache blocks in the pool.", [("", {}, s["blocks_total"])])
            metric(
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of the requests accepted.",
                [("", {}, self.prompt_tokens)],
            )
            metric("generation_tokens_total", "counter", "Tokens generated.", [("", {}, self.generation_tokens)])
            metric(
                "requests_finished_total",
                "counter",
                "Requests ended, by finish reason (stop, length, abort, error).",
                [("", {"finish_reason": k}, v) for k, v in sorted(self.finished.items())],
            )
            metric(
                "requests_rejected_total",
                "counter",
                "Requests refused before queueing, by reason.",
                [("", {"reason": k}, v) for k, v in sorted(self.rejected.items())],
            )
            for name, h, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Seconds from a request's arrival to its first token."),
                ("inter_token_latency_seconds", self.itl, "Seconds between two consecutive tokens of a request."),
            ):
                cum = h.cumulative()
                samples = [("_bucket", {"le": _value(b)}, c) for b, c in zip(h.bounds, cum)]
                samples += [("_bucket", {"le": "+Inf"}, cum[-1]), ("_sum", {}, h.sum), ("_count", {}, h.count)]
                metric(name, "histogram", help_, samples)
        return "\n".join(lines) + "\n"

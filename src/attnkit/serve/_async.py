"""``AsyncEngine``: one :class:`~attnkit.decoding.Engine` driven by its own thread, fed from any thread or asyncio loop.

The Engine itself is a synchronous object (``add``, ``step``, ``take``).  Here a worker thread owns it: between
two steps it runs the commands other threads queued (add a request, abort one), then steps while some request
waits or runs, and hands each step's tokens to the streams of their requests.  A caller gets a
:class:`RequestStream` per request, to iterate with ``for`` (a thread) or ``async for`` (an asyncio loop);
:meth:`RequestStream.abort` (a client that went away) frees the request's blocks before the next step, so its
slot goes to the next waiting request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from .. import _checks
from ..decoding import Engine
from ..decoding.sampling import resolve_sampling
from ._metrics import Metrics

__all__ = ["AsyncEngine", "RequestStream", "Delta", "Overloaded"]

log = logging.getLogger("attnkit.serve")

# how long the idle worker sleeps before looking again (it is woken at once by every command)
IDLE_WAIT_S = 0.5


class Overloaded(RuntimeError):
    """The waiting queue is at its limit (``max_waiting``): try again later."""


@dataclass
class Delta:
    """What one step gave a request: its new ``tokens`` (and their ``logprobs``, when asked), and on the last
    delta the ``finish_reason``: ``"stop"`` (an eos id), ``"length"`` (``max_new_tokens`` reached),
    ``"abort"`` (aborted or the engine closed) or ``"error"`` (the step failed; ``error`` says why)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """The token stream of one request: iterate it (``for`` or ``async for``) for :class:`Delta` s until the
    one with a ``finish_reason``.  ``tokens`` holds every token delivered so far."""

    def __init__(
        self, owner: "AsyncEngine", prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...], logprobs: bool
    ):
        self._owner = owner
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.wants_logprobs = logprobs
        self.rid: int | None = None
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.submitted = time.perf_counter()
        self.last_token: float | None = None
        self._items: deque[Delta] = deque()
        self._cond = threading.Condition()
        self._closed = False  # the last delta was queued
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._event = asyncio.Event() if self._loop is not None else None

    # ------------------------------------------------------------------ the worker's side

    def _put(self, delta: Delta, wakeups: dict | None = None) -> None:
        """Queue ``delta`` for the reader.  A reader in an asyncio loop is woken through the loop: at once, or,
        given ``wakeups`` (``{loop: [events]}``), by the caller, once per loop for all of a step's streams."""
        with self._cond:
            if self._closed:
                return
            self.tokens.extend(delta.tokens)
            if delta.finish_reason is not None:
                self.finish_reason = delta.finish_reason
                self._closed = True
            self._items.append(delta)
            self._cond.notify_all()
        if self._loop is not None:
            if wakeups is not None:
                wakeups.setdefault(self._loop, []).append(self._event)
            else:
                _wake_loops({self._loop: [self._event]})

    @property
    def done(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ the caller's side

    def abort(self) -> None:
        """Stop the request: its blocks are freed before the engine's next step; the stream ends with
        ``finish_reason="abort"`` unless it had finished already."""
        self._owner._abort(self)

    def __iter__(self):
        return self

    def __next__(self) -> Delta:
        with self._cond:
            while not self._items:
                if self._closed:
                    raise StopIteration
                self._cond.wait()
            return self._items.popleft()

    def __aiter__(self):
        if self._loop is None:
            raise RuntimeError(
                "this stream was submitted outside an asyncio loop: iterate it with `for`, or "
                "submit it with `await engine.asubmit(...)` inside the loop"
            )
        return self

    async def __anext__(self) -> Delta:
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                if self._closed:
                    raise StopAsyncIteration
            self._event.clear()  # (a set() from the worker runs on this loop after this line: never lost)
            with self._cond:
                if self._items or self._closed:
                    continue
            await self._event.wait()

    def __repr__(self) -> str:
        state = self.finish_reason or "running"
        return f"RequestStream(rid={self.rid}, {len(self.prompt)} prompt + {len(self.tokens)} tokens, {state})"


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


def _wake_loops(wakeups: dict) -> None:
    """Set each loop's events from inside that loop: one ``call_soon_threadsafe`` (one wakeup of the loop) per
    loop, however many of its streams got something."""
    for loop, events in wakeups.items():
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # the caller's loop is closed: nobody reads these streams any more
            pass


class AsyncEngine:
    """Drive ``engine`` (an :class:`~attnkit.decoding.Engine`) from a thread of its own, safely from any other thread
    or asyncio loop.

    Args:
        engine: the Engine; from now on only this object's thread may call it.
        max_waiting: the most requests that may wait for a slot (queued, not yet running); one more raises
            :class:`Overloaded`.  None: no limit.
        metrics: a :class:`~attnkit.serve.Metrics` to record into (a new one by default).

    :meth:`submit` (any thread) and :meth:`asubmit` (inside an asyncio loop) queue a request with the Engine's
    ``add`` arguments and return its :class:`RequestStream`; bad arguments raise in the caller, as ``add``
    would.  :meth:`close` aborts what is left and stops the thread (also on leaving a ``with`` block).

    Example::

        >>> import torch, attnkit
        >>> from attnkit.nn import DecoderLM, DecoderConfig
        >>> from attnkit.serve import AsyncEngine
        >>> torch.manual_seed(0)
        <torch._C.Generator object at ...>
        >>> model = DecoderLM(DecoderConfig.preset("tiny"))
        >>> with AsyncEngine(attnkit.Engine(model, cache_blocks=16, block_size=4, max_batch=2)) as engine:
        ...     stream = engine.submit([1, 2, 3], max_new_tokens=5)
        ...     deltas = list(stream)
        >>> stream.tokens == attnkit.generate(model, [[1, 2, 3]], 5)[0], deltas[-1].finish_reason
        (True, 'length')
    """

    def __init__(self, engine: Engine, *, max_waiting: int | None = None, metrics: Metrics | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an attnkit.Engine, got {type(engine).__name__}")
        if max_waiting is not None:
            _checks.int_in_range("max_waiting", max_waiting, 0, fix=" or None (no limit)")
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics if metrics is not None else Metrics()
        self._commands: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._live: dict[int, RequestStream] = {}  # rid -> stream, while the engine holds the request
        self._pending_adds = 0
        self._closing = False
        self.submitted = 0  # requests accepted
        self.finished: dict[str, int] = {}  # finish reason -> count
        self._snapshot = {"running": 0, "waiting": 0, "blocks_used": 0, "blocks_total": engine.cache.num_blocks}
        self._thread = threading.Thread(target=self._work, name="attnkit-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ submitting

    def submit(self, prompt, max_new_tokens: int, **sampling) -> RequestStream:
        """Queue a request (the arguments of :meth:`attnkit.decoding.Engine.add`: ``sampling=SamplingParams(...)`` or
        the sampling keywords); returns its stream once the engine has accepted it.  Raises what ``add`` raises
        for bad arguments, :class:`Overloaded` when ``max_waiting`` requests wait already, RuntimeError after
        :meth:`close`."""
        stream, future = self._queue_add(prompt, max_new_tokens, sampling)
        future.result()
        return stream

    async def asubmit(self, prompt, max_new_tokens: int, **sampling) -> RequestStream:
        """:meth:`submit` for a coroutine: waits for the engine without blocking the loop; the stream is read
        with ``async for``."""
        stream, future = self._queue_add(prompt, max_new_tokens, sampling)
        await asyncio.wrap_future(future)
        return stream

    def _queue_add(self, prompt, max_new_tokens, keywords):
        sampling = resolve_sampling(keywords.pop("sampling", None), keywords, "submit")
        tokens = (
            prompt.tolist()
            if hasattr(prompt, "tolist")
            else list(prompt)
            if isinstance(prompt, (list, tuple))
            else prompt
        )
        stream = RequestStream(self, tokens, max_new_tokens, sampling.eos_ids, sampling.logprobs is not None)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise RuntimeError("AsyncEngine is closed: no more requests")
            if self.max_waiting is not None and self._snapshot["waiting"] + self._pending_adds >= self.max_waiting:
                raise Overloaded(
                    f"{self._snapshot['waiting'] + self._pending_adds} requests wait already "
                    f"(max_waiting={self.max_waiting}): try again later"
                )
            self._pending_adds += 1
            self._commands.append(("add", stream, (prompt, max_new_tokens, sampling), future))
        self._wake.set()
        return stream, future

    def _abort(self, stream: RequestStream) -> None:
        with self._lock:
            if self._closing:
                return
            self._commands.append(("abort", stream, None, None))
        self._wake.set()

    # ------------------------------------------------------------------ looking

    def stats(self) -> dict:
        """``running``, ``waiting`` (queued in the engine or about to be), ``blocks_used``, ``blocks_total``:
        as of the last step."""
        with self._lock:
            snap = dict(self._snapshot)
            snap["waiting"] += self._pending_adds
        return snap

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no command is queued and no request waits or runs (at most ``timeout`` seconds);
        returns whether it did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                idle = not self._commands and not self._live and not self._pending_adds
            if idle:
                return True
            time.sleep(0.01)
        return False

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        engine = self.engine
        while True:
            with self._lock:
                commands, self._commands = self._commands, deque()
                closing = self._closing
            for cmd in commands:
                self._run_command(cmd)
            if closing:
                break
            if not engine.has_work:
                self._refresh()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                events = engine.step()
            except Exception as e:  # a step that fails ends every request it held, not the server
                log.exception("attnkit engine step failed; ending the %d requests in flight", len(self._live))
                for rid, stream in list(self._live.items()):
                    engine.abort(rid)
                    self._finish(rid, stream, "error", error=f"{type(e).__name__}: {e}")
                self._refresh()
                continue
            self._refresh()  # (before the tokens go out: a client reacting to them sees this step's state)
            self._deliver(events)
        for rid, stream in list(self._live.items()):  # closing: abort what is left
            engine.abort(rid)
            self._finish(rid, stream, "abort")
        self._refresh()

    def _run_command(self, cmd) -> None:
        kind, stream, args, future = cmd
        if kind == "add":
            prompt, max_new_tokens, sampling = args
            try:
                rid = self.engine.add(prompt, max_new_tokens, sampling=sampling)
            except BaseException as e:  # noqa: BLE001  (bad arguments, re-raised in the caller's thread)
                with self._lock:
                    self._pending_adds -= 1
                future.set_exception(e)
                return
            stream.rid = rid
            self._live[rid] = stream
            self._refresh(added=True)  # (the queue's count and the pending adds change together)
            self.metrics.request_started(len(stream.prompt))
            future.set_result(rid)
            if rid in self.engine.results:  # max_new_tokens=0: done at once
                self.engine.take(rid)
                self._finish(rid, stream, "length")
        elif kind == "abort":
            rid = stream.rid
            if rid is not None and rid in self._live:
                self.engine.abort(rid)
                self._finish(rid, stream, "abort")
        self._refresh()

    def _deliver(self, events: list[tuple[int, int]]) -> None:
        """Hand one step's tokens to their streams: one delta per stream, and one wakeup per asyncio loop."""
        engine = self.engine
        now = time.perf_counter()
        new: dict[int, list[int]] = {}
        for rid, tok in events:
            new.setdefault(rid, []).append(tok)
        wakeups: dict = {}
        for rid, toks in new.items():
            stream = self._live.get(rid)
            if stream is None:
                continue
            for _ in toks:
                if stream.last_token is None:
                    self.metrics.first_token(now - stream.submitted)
                else:
                    self.metrics.next_token(now - stream.last_token)
                stream.last_token = now
            lps = []
            if stream.wants_logprobs:
                have = len(stream.tokens)
                lps = list(engine.token_logprobs(rid)[have : have + len(toks)])
            if rid in engine.results:
                out = engine.take(rid)
                stopped = len(out) < stream.max_new_tokens or (out and out[-1] in stream.eos_ids)
                self._finish(rid, stream, "stop" if stopped else "length", tokens=toks, logprobs=lps, wakeups=wakeups)
            else:
                stream._put(Delta(toks, lps), wakeups)
        _wake_loops(wakeups)

    def _finish(
        self,
        rid: int,
        stream: RequestStream,
        reason: str,
        *,
        tokens=(),
        logprobs=(),
        error: str | None = None,
        wakeups: dict | None = None,
    ) -> None:
        self._live.pop(rid, None)
        with self._lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        self.metrics.request_finished(reason)
        stream._put(Delta(list(tokens), list(logprobs), reason, error), wakeups)

    def _refresh(self, added: bool = False) -> None:
        engine = self.engine
        snap = {
            "running": len(engine.running),
            "waiting": len(engine.waiting),
            "blocks_used": engine.cache.stats()["blocks_used"],
            "blocks_total": engine.cache.num_blocks,
        }
        with self._lock:
            self._snapshot = snap
            if added:
                self._pending_adds -= 1
                self.submitted += 1
        self.metrics.set_state(snap)

    # ------------------------------------------------------------------ closing

    def close(self, timeout: float = 30.0) -> None:
        """Abort every request left (their streams end with ``"abort"``) and stop the thread."""
        with self._lock:
            self._closing = True
            dropped = list(self._commands)
            self._commands.clear()
        for kind, _stream, _, future in dropped:  # (a command queued after the worker's last look)
            if kind == "add":
                with self._lock:
                    self._pending_adds -= 1
                future.set_exception(RuntimeError("AsyncEngine closed before the request was queued"))
        self._wake.set()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"AsyncEngine({s['running']} running, {s['waiting']} waiting, {s['blocks_used']}/"
            f"{s['blocks_total']} blocks, {self.submitted} submitted)"
        )

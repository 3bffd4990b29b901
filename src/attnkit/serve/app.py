"""The HTTP layer: an OpenAI-compatible server over an :class:`~attnkit.serve.AsyncEngine` (Starlette + uvicorn,
the ``serve`` extra).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template), ``GET
/v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).  Streaming answers are server-sent events in
OpenAI's chunk format ending with ``data: [DONE]``.  A client that disconnects has its requests aborted at once
(their KV blocks go back to the pool).  Bad requests are answered with OpenAI's error JSON naming the field
(``attnkit.serve._protocol``); a full waiting queue with 503.

Example (a server in a background thread, called with the ``openai`` client)::

    >>> import tempfile, attnkit, openai
    >>> from attnkit.serve import load_model_dir, make_demo_model
    >>> from attnkit.serve.app import start_server
    >>> served = load_model_dir(make_demo_model(tempfile.mkdtemp() + "/tiny"))
    >>> with start_server(served, cache_blocks=64, block_size=8) as server:
    ...     client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    ...     reply = client.completions.create(model="tiny", prompt="ba be bi", max_tokens=5, temperature=0)
    >>> reply.choices[0].finish_reason, reply.usage.prompt_tokens, reply.usage.completion_tokens
    ('length', 3, 5)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route
except ImportError as e:  # pragma: no cover (a plain install)
    raise ImportError(
        f"attnkit.serve.app needs the serve extra ({e.name} is missing): pip install 'attnkit[serve]'"
    ) from None

from ..decoding import Engine
from ._async import AsyncEngine, Overloaded, RequestStream
from ._model import ServedModel
from ._protocol import ApiError, GenerationRequest, error_body, parse_chat, parse_completion

__all__ = ["build_app", "start_server", "run_server", "RunningServer"]

log = logging.getLogger("attnkit.serve")

# each engine step is one forward of at most this many tokens: a decode token of every running request, then
# chunks of the prompts admitted (so prompts arriving together are prefilled together, beside the decodes)
DEFAULT_MAX_BATCHED_TOKENS = 512


# ------------------------------------------------------------------------------ the model's side


class _Context:
    """What request checking needs from the model: its name, vocabulary, context and tokenizer."""

    def __init__(self, served: ServedModel):
        self.served = served
        self.name = served.name
        self.tokenizer = served.tokenizer
        self.vocab_size = int(served.model.config.vocab_size)
        self.max_context = served.max_context

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def chat_encode(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(
                f"the model {self.name!r} has no chat template (tokenizer_config.json's chat_template): "
                f"use /v1/completions",
                "messages",
            )
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def piece(self, token: int) -> str:
        return self.tokenizer.decode([token])


class _Text:
    """A choice's text as its tokens come, cut at the first stop string and held back while its end could still
    begin one.

    Decoding is incremental: each call decodes only the last few tokens, twice (those already read, and those
    plus the new ones, from the same first token, so a tokenizer that treats a text's first token differently
    treats both alike), and gives out the difference; tokens that end inside a character (``\ufffd``) wait for
    the rest of its bytes.  Each token costs the same however long the text is, where decoding the whole text
    each time would cost its length.  ``text`` is what was given out."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""  # the text given out so far
        self._held = ""  # decoded text not given out yet: its end could begin a stop string
        self._prefix = 0  # tokens[_prefix:_read] are the context of the next decode ...
        self._read = 0  # ... and tokens[:_read] are decoded
        self._reach = max((len(s) for s in stops), default=1) - 1  # how far back into `text` a stop may start

    def _decoded(self, final: bool) -> str:
        """The text of the tokens not decoded yet (empty while they end inside a character, unless final)."""
        toks = self.tokens
        if self._read == len(toks):
            return ""
        before = self.tokenizer.decode(toks[self._prefix : self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(toks[self._prefix :], skip_special_tokens=True)
        if not final and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # nothing new yet, or an incomplete character: wait for its other bytes
        self._prefix, self._read = self._read, len(toks)
        return after[len(before) :]

    def feed(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """The new text after ``tokens``, and whether a stop string ended it."""
        self.tokens += tokens
        self._held += self._decoded(final)
        look = max(0, len(self.text) - self._reach)
        window = self.text[look:] + self._held  # (a stop string may begin in text given out already)
        start = len(self.text) - look  # where the held text begins in the window
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if hits:
            end = max(min(hits), start)
            out, self._held = window[start:end], ""
            self.text += out
            return out, True
        end = len(window)
        if not final:
            for s in self.stops:  # the longest tail that starts a stop string waits
                for k in range(min(len(s) - 1, len(window)), 0, -1):
                    if window.endswith(s[:k]):
                        end = min(end, len(window) - k)
                        break
        end = max(end, start)
        out, self._held = window[start:end], window[end:]
        self.text += out
        return out, False


def _completion_logprobs(ctx: _Context, lps, offset: int) -> dict:
    """OpenAI's legacy completions ``logprobs`` object for the TokenLogprobs ``lps``."""
    tokens = [ctx.piece(lp.token) for lp in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{ctx.piece(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def _chat_logprobs(ctx: _Context, lps) -> dict:
    def entry(t, v):
        s = ctx.piece(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode())}

    return {"content": [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in lps]}


# ------------------------------------------------------------------------------ requests


class _Handler:
    """The routes, over one model and one AsyncEngine."""

    def __init__(self, served: ServedModel, engine: AsyncEngine):
        self.ctx = _Context(served)
        self.engine = engine
        self.created = int(time.time())

    # ---------------------------------------------------------------- plain routes

    async def models(self, request: Request):
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.ctx.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "attnkit",
                        "max_model_len": self.ctx.max_context,
                    }
                ],
            }
        )

    async def health(self, request: Request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request):
        return PlainTextResponse(self.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    # ---------------------------------------------------------------- generation

    async def completions(self, request: Request):
        return await self._generate(request, parse_completion)

    async def chat(self, request: Request):
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request, parse):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(f"could not parse the request body as JSON: {e}") from None
        req = parse(body, self.ctx)
        limits = [self._max_tokens(req, p) for p in req.prompts]
        streams = await self._submit(req, limits)
        if req.stream:
            return _EventStream(self._chunks(req, streams), streams, request.receive)
        watcher = asyncio.create_task(_abort_on_disconnect(request.receive, streams))
        try:
            return JSONResponse(await self._collect(req, streams))
        finally:
            watcher.cancel()
            for s in streams:
                s.abort()

    def _max_tokens(self, req: GenerationRequest, prompt: list[int]) -> int:
        room = self.ctx.max_context - len(prompt)
        if room < 1:
            raise ApiError(
                f"the prompt is {len(prompt)} tokens, and the model's context is {self.ctx.max_context}: shorten it",
                "messages" if req.chat else "prompt",
            )
        if req.max_tokens is None:  # the rest of the context, as far as the block pool holds it
            cache = self.engine.engine.cache
            return max(1, min(room, cache.num_blocks * cache.block_size - len(prompt)))
        if req.max_tokens > room:
            raise ApiError(
                f"max_tokens={req.max_tokens} plus the prompt's {len(prompt)} tokens is beyond the "
                f"model's context of {self.ctx.max_context}: ask for at most {room}",
                req.max_tokens_field,
            )
        return req.max_tokens

    async def _submit(self, req: GenerationRequest, limits: list[int]) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for prompt, limit in zip(req.prompts, limits):
                for j in range(req.n):
                    sampling = dict(req.sampling)
                    if sampling["seed"] is not None:
                        sampling["seed"] += j  # n choices from one seed differ, and repeat with it
                    streams.append(
                        await self.engine.asubmit(
                            prompt,
                            limit,
                            eos_id=list(self.ctx.served.eos_ids) or None,
                            logprobs=req.logprobs,
                            **sampling,
                        )
                    )
        except Overloaded as e:
            for s in streams:
                s.abort()
            self.engine.metrics.request_rejected("overloaded")
            raise ApiError(f"the server is overloaded: {e}", None, status=503, type_="server_overloaded") from None
        except ValueError as e:
            for s in streams:
                s.abort()
            raise ApiError(str(e), "max_tokens" if "blocks" in str(e) else None) from None
        return streams

    async def _choice(self, stream: RequestStream, text: _Text):
        """``(text, logprobs, finish_reason)`` as the stream's tokens come; the last one has the reason."""
        async for d in stream:
            piece, hit = text.feed(d.tokens, d.finish_reason is not None)
            if d.finish_reason == "error":
                raise RuntimeError(d.error)
            if hit:
                stream.abort()
                yield piece, d.logprobs, "stop"
                return
            yield piece, d.logprobs, d.finish_reason

    def _usage(self, req: GenerationRequest, streams: list[RequestStream]) -> dict:
        prompt = sum(len(p) for p in req.prompts)
        done = sum(len(s.tokens) for s in streams)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    async def _collect(self, req: GenerationRequest, streams: list[RequestStream]) -> dict:
        choices = []
        for i, stream in enumerate(streams):
            text, lps, reason = _Text(self.ctx.tokenizer, req.stop), [], None
            async for _, lp, r in self._choice(stream, text):
                lps += lp
                reason = r or reason
            if req.chat:
                choice = {
                    "index": i,
                    "message": {"role": "assistant", "content": text.text},
                    "logprobs": _chat_logprobs(self.ctx, lps) if req.logprobs is not None else None,
                    "finish_reason": reason,
                }
            else:
                choice = {
                    "index": i,
                    "text": text.text,
                    "logprobs": _completion_logprobs(self.ctx, lps, 0) if req.logprobs is not None else None,
                    "finish_reason": reason,
                }
            choices.append(choice)
        kind = "chat.completion" if req.chat else "text_completion"
        return {
            "id": _new_id(req),
            "object": kind,
            "created": int(time.time()),
            "model": self.ctx.name,
            "choices": choices,
            "usage": self._usage(req, streams),
        }

    async def _chunks(self, req: GenerationRequest, streams: list[RequestStream]):
        """The streamed chunks (dicts), then ``[DONE]``.  The ``n`` choices of a request generate together in
        the engine, and each choice's chunks are sent as its tokens come: chunks of different choices
        interleave (each names its ``index``), in order within a choice."""
        head = {
            "id": _new_id(req),
            "object": "chat.completion.chunk" if req.chat else "text_completion",
            "created": int(time.time()),
            "model": self.ctx.name,
        }
        merged = _interleave([self._choice_chunks(req, head, i, s) for i, s in enumerate(streams)])
        try:
            async for chunk in merged:
                yield chunk
        except RuntimeError as e:
            log.error("request failed: %s", e)
            yield error_body(f"generation failed: {e}", "server_error")
        finally:
            await merged.aclose()
        if req.include_usage:
            yield dict(head, choices=[], usage=self._usage(req, streams))
        yield "[DONE]"

    async def _choice_chunks(self, req: GenerationRequest, head: dict, i: int, stream: RequestStream):
        """The chunks of choice ``i``: for chat the assistant's role first, then a chunk per decoded piece."""
        text = _Text(self.ctx.tokenizer, req.stop)
        if req.chat:
            yield dict(
                head,
                choices=[
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                ],
            )
        offset = 0
        async for piece, lps, reason in self._choice(stream, text):
            if not piece and not lps and reason is None:
                continue
            if req.chat:
                delta = {"content": piece} if piece or reason is None else {}
                lp = _chat_logprobs(self.ctx, lps) if req.logprobs is not None and lps else None
                choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                lp = _completion_logprobs(self.ctx, lps, offset) if req.logprobs is not None and lps else None
                choice = {"index": i, "text": piece, "logprobs": lp, "finish_reason": reason}
            offset += len(piece)
            yield dict(head, choices=[choice])


async def _interleave(gens: list):
    """The items of several async generators as each comes (items ready together in the generators' order);
    an exception of one ends the whole (the others are closed); closing this closes them all."""
    pending = {asyncio.ensure_future(anext(g)): i for i, g in enumerate(gens)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                yield item
                pending[asyncio.ensure_future(anext(gens[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for g in gens:
            await g.aclose()


def _new_id(req: GenerationRequest) -> str:
    return ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex


async def _abort_on_disconnect(receive, streams: list[RequestStream]) -> None:
    """Wait for the client to go away (the body has been read), then abort its requests."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            for s in streams:
                s.abort()
            return


class _EventStream:
    """A server-sent-events response: one ``data: ...`` event per chunk; the requests are aborted when the
    client disconnects, when sending fails, or when the response is cancelled (server shutdown)."""

    def __init__(self, chunks, streams: list[RequestStream], receive):
        self.chunks, self.streams, self.receive = chunks, streams, receive

    async def __call__(self, scope, receive, send):
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        watcher = asyncio.create_task(_abort_on_disconnect(self.receive, self.streams))
        try:
            async for chunk in self.chunks:
                data = chunk if isinstance(chunk, str) else json.dumps(chunk, separators=(",", ":"))
                await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client went away while we wrote (the watcher aborts too)
            pass
        finally:
            watcher.cancel()
            for s in self.streams:
                s.abort()
            await self.chunks.aclose()


# ------------------------------------------------------------------------------ the application


def _guarded(fn):
    async def endpoint(request: Request):
        try:
            return await fn(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # never let one request take the server down
            log.exception("internal error answering %s %s", request.method, request.url.path)
            return JSONResponse(
                error_body(f"internal server error: {type(e).__name__}", "server_error"), status_code=500
            )

    return endpoint


async def _http_error(request: Request, exc: HTTPException):
    return JSONResponse(
        error_body(f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error"),
        status_code=exc.status_code,
    )


def build_app(served: ServedModel, engine: AsyncEngine) -> Starlette:
    """The Starlette application serving ``served`` through ``engine``; the application closes the engine when
    it shuts down."""
    h = _Handler(served, engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(engine.close)

    routes = [
        Route("/v1/completions", _guarded(h.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(h.chat), methods=["POST"]),
        Route("/v1/models", _guarded(h.models), methods=["GET"]),
        Route("/health", _guarded(h.health), methods=["GET"]),
        Route("/metrics", _guarded(h.metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error})


def _engine_for(
    served: ServedModel,
    *,
    cache_blocks: int,
    block_size: int,
    max_batch: int,
    max_batched_tokens: int | str | None,
    max_waiting: int | None,
) -> AsyncEngine:
    if isinstance(max_batched_tokens, str):
        if max_batched_tokens != "auto":
            raise ValueError(
                f"max_batched_tokens={max_batched_tokens!r} must be an int >= max_batch, 'auto' or None (each prompt "
                f"prefilled alone)"
            )
        batched = _auto_batched_tokens(served.model, max_batch)
    else:
        batched = max_batched_tokens
    engine = Engine(
        served.model,
        cache_blocks=cache_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_batched_tokens=batched,
    )
    return AsyncEngine(engine, max_waiting=max_waiting)


def _auto_batched_tokens(model, max_batch: int) -> int | None:
    """``DEFAULT_MAX_BATCHED_TOKENS`` (``max_batch`` if larger), or None for a model whose rope scaling follows
    each sequence's length (LongRoPE, dynamic NTK), which the Engine does not prefill in chunks."""
    if any(getattr(m, "length_dependent", False) is True for m in model.modules()):
        return None
    return max(DEFAULT_MAX_BATCHED_TOKENS, max_batch)


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGINT / SIGTERM end it cleanly without re-raising the signal afterwards, and
    abort the requests in flight at once (their streams end with ``finish_reason="abort"`` and ``[DONE]``), so
    shutting down never waits for long generations."""

    def __init__(self, config, engine: AsyncEngine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit and sig == 2:  # a second Ctrl-C: stop waiting for open connections
            self.force_exit = True
        if not self.should_exit:
            threading.Thread(target=self.engine.close, name="attnkit-serve-stop", daemon=True).start()
        self.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _config(app, log_level: str, graceful_s: float) -> "uvicorn.Config":
    return uvicorn.Config(
        app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_s, access_log=log_level == "debug"
    )


class RunningServer:
    """A server running in a background thread (for tests and notebooks): ``url``, ``engine``, ``stop()``
    (also on leaving a ``with`` block)."""

    def __init__(self, app, engine: AsyncEngine, host: str, port: int, log_level: str, graceful_s: float):
        self.engine = engine
        self._sock = _bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = _Server(_config(app, log_level, graceful_s), engine)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="attnkit-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start (see the log)")
            time.sleep(0.01)

    def stop(self, timeout: float = 30.0) -> None:
        self.engine.close()  # (requests in flight end with "abort" at once)
        self._server.should_exit = True
        self._thread.join(timeout)
        self.engine.close()
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_server(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    cache_blocks: int = 256,
    block_size: int = 16,
    max_batch: int = 16,
    max_batched_tokens: int | str | None = "auto",
    max_waiting: int | None = 256,
    log_level: str = "warning",
    graceful_s: float = 5.0,
) -> RunningServer:
    """Serve ``served`` from a background thread (``port=0``: a free port; see ``server.url``) until
    ``server.stop()``.  The Engine arguments are :class:`attnkit.decoding.Engine`'s; ``max_batched_tokens`` (at least
    ``max_batch``) is the most tokens of one step, a decode token of every running request and chunks of the
    prompts admitted in one forward ("auto": ``DEFAULT_MAX_BATCHED_TOKENS`` or ``max_batch`` if larger, None for
    a model whose rope follows each sequence's length; None: each prompt prefilled alone before the decode
    step); ``max_waiting`` bounds the queue."""
    engine = _engine_for(
        served,
        cache_blocks=cache_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_batched_tokens=max_batched_tokens,
        max_waiting=max_waiting,
    )
    return RunningServer(build_app(served, engine), engine, host, port, log_level, graceful_s)


def run_server(
    served: ServedModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    cache_blocks: int = 256,
    block_size: int = 16,
    max_batch: int = 16,
    max_batched_tokens: int | str | None = "auto",
    max_waiting: int | None = 256,
    log_level: str = "info",
    graceful_s: float = 5.0,
    announce=print,
) -> None:
    """Serve ``served`` in this thread until SIGINT / SIGTERM (what ``attnkit serve`` runs)."""
    engine = _engine_for(
        served,
        cache_blocks=cache_blocks,
        block_size=block_size,
        max_batch=max_batch,
        max_batched_tokens=max_batched_tokens,
        max_waiting=max_waiting,
    )
    sock = _bind(host, port)
    try:
        server = _Server(_config(build_app(served, engine), log_level, graceful_s), engine)
        announce(
            f"attnkit serve: {served.name!r} ({served.family}) on http://{host}:{sock.getsockname()[1]}/v1 "
            f"(Ctrl-C stops)"
        )
        server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    announce("attnkit serve: stopped")

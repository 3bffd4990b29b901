"""A tiny Llama model directory with a word-level tokenizer, built here (no downloads), and servers over it that
are always stopped."""

import logging

import pytest

from attnkit.serve import load_model_dir, make_demo_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("models") / "tiny", max_positions=256)


@pytest.fixture(scope="session")
def served(model_dir):
    return load_model_dir(model_dir)


class _Problems(logging.Handler):
    """Collects every log record at ERROR or above, and every record carrying a traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture
def server_log():
    """The server's problems (attnkit.serve's and uvicorn's loggers); a test asserts it stays empty."""
    handler = _Problems()
    loggers = [logging.getLogger(n) for n in ("attnkit.serve", "uvicorn", "uvicorn.error", "uvicorn.asgi")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.records
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.fixture
def start(served):
    """``start(**engine_options)`` -> a running server on a free loopback port, stopped after the test."""
    from attnkit.serve.app import start_server

    running = []

    def make(**kw):
        kw.setdefault("cache_blocks", 96)
        kw.setdefault("block_size", 8)
        kw.setdefault("max_batch", 4)
        server = start_server(served, **kw)
        running.append(server)
        return server

    yield make
    for server in running:
        server.stop()


def slow_steps(engine, seconds: float = 0.03):
    """Make each step of ``engine`` (an attnkit.Engine) take ``seconds`` longer, so a long request surely still
    runs while a test looks at the queue (on a loaded machine a tiny model's 200 tokens can pass in a blink)."""
    import time

    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    engine.step = step

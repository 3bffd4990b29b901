"""The HTTP server: the official openai client against it (streaming and not), the OpenAI fields that map onto
the Engine, metrics, and disconnects."""

import json

import httpx
import openai
import pytest

import attnkit

from .conftest import slow_steps


pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(served, ids, n):
    """What attnkit.generate gives this prompt alone (greedy, float32), and its text."""
    eos = list(served.eos_ids) or None
    tokens = attnkit.generate(served.model, [ids], n, eos_id=eos)[0]
    return tokens, served.tokenizer.decode(tokens, skip_special_tokens=True)


def _client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


PROMPT = "ba be bi bo bu da de"
# a streamed completion that never meets an eos (token 2 is barred): it runs until it is stopped
ENDLESS_STREAM = {
    "model": "tiny",
    "prompt": PROMPT,
    "max_tokens": 200,
    "temperature": 0,
    "stream": True,
    "logit_bias": {"2": -100},
}


def test_completions_with_the_openai_client(start, served, server_log):
    server = start()
    client = _client(server)
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    ids = served.tokenizer(PROMPT).input_ids
    tokens, text = _reference(served, ids, 12)
    assert reply.choices[0].text == text
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == len(ids) + len(tokens)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
    assert not server_log


def test_chat_with_the_openai_client(start, served, server_log):
    server = start()
    client = _client(server)
    messages = [{"role": "system", "content": "ka ke"}, {"role": "user", "content": "ba be bi"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    text_prompt = served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = served.tokenizer(text_prompt, add_special_tokens=False).input_ids
    tokens, text = _reference(served, ids, 10)
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == text
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == len(tokens)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not server_log


def test_raw_stream_ends_with_done(start):
    server = start()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_sampling_fields_map_onto_the_engine(start, served):
    server = start()
    client = _client(server)
    ids = served.tokenizer(PROMPT).input_ids
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8)
    sampled = dict(
        temperature=0.9,
        top_p=0.9,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    a = client.completions.create(**kw, **sampled)
    b = client.completions.create(**kw, **sampled)
    assert a.choices[0].text == b.choices[0].text  # the seed repeats
    ref = attnkit.generate(
        served.model,
        [ids],
        8,
        temperature=0.9,
        top_p=0.9,
        seed=5,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.2,
        eos_id=list(served.eos_ids),
    )[0]
    assert a.choices[0].text == served.tokenizer.decode(ref, skip_special_tokens=True)
    banned = served.tokenizer.convert_tokens_to_ids("zi")
    greedy = _reference(served, ids, 8)[0]
    top = greedy[0]
    biased = client.completions.create(**kw, temperature=0, logit_bias={str(top): -100})
    ref = attnkit.generate(served.model, [ids], 8, logit_bias={top: -100.0}, eos_id=list(served.eos_ids))[0]
    assert biased.choices[0].text == served.tokenizer.decode(ref, skip_special_tokens=True) and ref[0] != top
    assert banned != served.tokenizer.unk_token_id


def test_n_choices_and_logprobs(start, served):
    server = start()
    client = _client(server)
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3, n=3, logprobs=2
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)
    lp = reply.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) and all(len(t) == 2 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    ids = served.tokenizer(PROMPT).input_ids
    ref = attnkit.generate(served.model, [ids], 5, temperature=1.0, seed=4, logprobs=2, eos_id=list(served.eos_ids))
    assert reply.choices[1].logprobs.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs[0]], abs=1e-5)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "ba"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-9  # greedy: the chosen is the top one


def test_stop_strings_match_decoded_text(start, served):
    server = start()
    client = _client(server)
    ids = served.tokenizer(PROMPT).input_ids
    _, text = _reference(served, ids, 12)
    words = text.split()
    stop = words[3]
    want = text[: text.index(stop)]
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "qqq"])
    assert reply.choices[0].text == want and reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert server.engine.wait_idle() and server.engine.stats()["blocks_used"] == 0


def test_models_health_metrics(start):
    server = start()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = _client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    _client(server).completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "attnkit_requests_running",
        "attnkit_requests_waiting",
        "attnkit_kv_blocks_used",
        "attnkit_prompt_tokens_total",
        "attnkit_generation_tokens_total",
        "attnkit_time_to_first_token_seconds_bucket",
        "attnkit_inter_token_latency_seconds_count",
    ):
        assert f"\n{name}" in text
    assert "# TYPE attnkit_time_to_first_token_seconds histogram" in text


def _error(r, status, param):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    return err


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "tiny", "prompt": "ba", "temperature": -0.5}, 400, "temperature"),
        ({"model": "tiny", "prompt": "ba", "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "prompt": "ba", "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "ba", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "ba", "max_tokens": 2.5}, 400, "max_tokens"),
        ({"model": "other", "prompt": "ba"}, 404, "model"),
        ({"prompt": "ba"}, 400, "model"),
        ({"model": "tiny", "prompt": 3}, 400, "prompt"),
        ({"model": "tiny", "prompt": [10**6]}, 400, "prompt"),
        ({"model": "tiny", "prompt": "ba", "top_p": 0}, 400, "top_p"),
        ({"model": "tiny", "prompt": "ba", "n": 0}, 400, "n"),
        ({"model": "tiny", "prompt": "ba", "stop": [1]}, 400, "stop"),
        ({"model": "tiny", "prompt": "ba", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ({"model": "tiny", "prompt": "ba", "presence_penalty": -2.5}, 400, "presence_penalty"),
        ({"model": "tiny", "prompt": "ba", "stream": "yes"}, 400, "stream"),
        ({"model": "tiny", "prompt": "ba", "logprobs": 50}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "ba", "echo": True}, 400, "echo"),
        ({"model": "tiny", "prompt": "ba", "colour": "blue"}, 400, "colour"),
    ],
)
def test_bad_completion_requests_name_the_field(start, body, status, param, server_log):
    server = start()
    _error(httpx.post(server.url + "/v1/completions", json=body), status, param)
    assert httpx.get(server.url + "/health").status_code == 200
    assert not server_log


def test_bad_chat_requests_and_bodies(start, served, server_log):
    server = start()
    url = server.url + "/v1/chat/completions"
    _error(httpx.post(url, content=b"{not json"), 400, None)
    _error(httpx.post(url, json=[1, 2]), 400, None)
    _error(httpx.post(url, json={"model": "tiny", "messages": []}), 400, "messages")
    _error(httpx.post(url, json={"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}), 400, "messages")
    _error(
        httpx.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "ba"}], "top_logprobs": 2}),
        400,
        "top_logprobs",
    )
    _error(
        httpx.post(
            url, json={"model": "tiny", "messages": [{"role": "user", "content": "ba"}], "max_completion_tokens": 10**5}
        ),
        400,
        "max_completion_tokens",
    )
    _error(
        httpx.post(
            url,
            json={"model": "tiny", "messages": [{"role": "user", "content": "ba"}], "tools": [{"type": "function"}]},
        ),
        400,
        "tools",
    )
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["message"]
    assert httpx.get(url).status_code == 405
    with pytest.raises(openai.BadRequestError, match="temperature"):
        _client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "ba"}], temperature=-1
        )
    assert not server_log


def test_a_full_queue_answers_503(start):
    server = start(max_batch=1, max_waiting=1)
    slow_steps(server.engine.engine)
    body = ENDLESS_STREAM
    with httpx.Client(timeout=60) as c, c.stream("POST", server.url + "/v1/completions", json=body) as first:
        next(first.iter_lines())  # running
        with c.stream("POST", server.url + "/v1/completions", json=body) as second:  # waiting
            assert second.status_code == 200
            r = c.post(server.url + "/v1/completions", json=dict(body, stream=False))
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_overloaded"
    assert 'attnkit_requests_rejected_total{reason="overloaded"} 1' in httpx.get(server.url + "/metrics").text


def test_a_client_that_disconnects_frees_its_blocks(start, served, server_log):
    server = start(max_batch=1)
    slow_steps(server.engine.engine)
    ids = served.tokenizer(PROMPT).input_ids
    body = ENDLESS_STREAM
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            assert server.engine.stats()["blocks_used"] > 0
        # gone mid-stream: the next request gets the slot and the pool is empty again
        reply = c.post(
            server.url + "/v1/completions", json=dict(body, stream=False, max_tokens=6, logit_bias=None)
        ).json()
    assert reply["choices"][0]["text"] == _reference(served, ids, 6)[1]
    assert server.engine.wait_idle()
    assert server.engine.stats()["blocks_used"] == 0
    assert server.engine.engine.cache.num_free_blocks == server.engine.engine.cache.num_blocks
    assert server.engine.finished.get("abort") == 1
    assert not server_log


def test_max_tokens_defaults_to_what_the_context_and_pool_hold(start, served):
    server = start(cache_blocks=4, block_size=8)  # 32 positions, less than the model's 256
    reply = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "tiny", "prompt": PROMPT, "temperature": 0, "logit_bias": {"2": -100}},
    ).json()
    assert reply["usage"]["completion_tokens"] == 32 - reply["usage"]["prompt_tokens"]
    assert reply["choices"][0]["finish_reason"] == "length"


def test_the_server_packs_prompts_into_steps_by_default(start, served):
    import torch

    from attnkit.serve.app import DEFAULT_MAX_BATCHED_TOKENS, _auto_batched_tokens

    assert start().engine.engine.max_batched_tokens == DEFAULT_MAX_BATCHED_TOKENS
    assert start(max_batched_tokens=None).engine.engine.max_batched_tokens is None  # each prompt alone
    assert _auto_batched_tokens(served.model, 600) == 600  # one decode token of each of 600 requests fits

    class LengthDependentRope(torch.nn.Module):
        length_dependent = True

    # LongRoPE, dynamic NTK: the Engine refuses chunks of a prompt, so each prompt is prefilled alone
    assert _auto_batched_tokens(torch.nn.Sequential(LengthDependentRope()), 16) is None
    with pytest.raises(ValueError, match="max_batched_tokens='many' must be an int"):
        start(max_batched_tokens="many")


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_streamed_choices_interleave_and_each_equals_its_unstreamed_text(start, chat):
    """n=3 streamed: the choices generate together, so their chunks come interleaved (not choice after choice),
    in order within each choice, each choice ending once with its finish reason; every choice's text is the
    unstreamed reply's (same seed), and the usage counts all three."""
    server = start()
    client = _client(server)
    kw = dict(model="tiny", max_tokens=10, temperature=1.0, seed=7, n=3, logit_bias={"2": -100})
    if chat:
        kw["messages"] = [{"role": "user", "content": "ba be"}]
        whole = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    else:
        kw["prompt"] = PROMPT
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    order = [c.choices[0].index for c in chunks if c.choices]
    assert sorted(set(order)) == [0, 1, 2]
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 starts before choice 0 ends
    for i, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        text = "".join((m.delta.content or "") if chat else m.text for m in mine)
        assert text == (choice.message.content if chat else choice.text)
        assert [m.finish_reason for m in mine if m.finish_reason] == ["length"]
        assert mine[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 30

"""Stop strings on decoded text, streamed: nothing past a stop string is ever sent, even when it spans tokens."""

import pytest

from attnkit.serve.app import _Text


@pytest.fixture
def tok(served):
    return served.tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def _stream(tok, text, stops):
    t = _Text(tok, stops)
    pieces, hit = [], False
    for i in _ids(tok, text):
        piece, hit = t.feed([i], final=False)
        pieces.append(piece)
        if hit:
            break
    if not hit:
        pieces.append(t.feed([], final=True)[0])
    return pieces, hit, t.text


def test_a_stop_string_across_tokens_is_held_back_then_cut(tok):
    pieces, hit, text = _stream(tok, "ba be bi bo bu", ["be bi"])
    assert hit and text == "ba " and "".join(pieces) == "ba "
    assert all("b" not in p or p == "ba" for p in pieces)  # "be" waited: it could begin the stop string


def test_held_back_text_comes_out_when_no_stop_follows(tok):
    pieces, hit, text = _stream(tok, "ba be bo", ["be bi"])
    assert not hit and text == "ba be bo" and "".join(pieces) == "ba be bo"


def test_the_earliest_stop_wins_and_special_tokens_are_not_text(tok):
    pieces, hit, text = _stream(tok, "ka ke ki ko", ["ko", "ke"])
    assert hit and text == "ka "
    t = _Text(tok, [])
    assert t.feed([tok.eos_token_id], final=True) == ("", False)


def test_metrics_count_what_was_served(start, served):
    import httpx

    server = start()
    body = {"model": "tiny", "prompt": "ba be bi", "max_tokens": 5, "temperature": 0, "logit_bias": {"2": -100}}
    for _ in range(2):
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert lines["attnkit_prompt_tokens_total"] == "6" and lines["attnkit_generation_tokens_total"] == "10"
    assert lines['attnkit_requests_finished_total{finish_reason="length"}'] == "2"
    assert lines["attnkit_time_to_first_token_seconds_count"] == "2"
    assert lines["attnkit_inter_token_latency_seconds_count"] == "8"
    assert lines['attnkit_inter_token_latency_seconds_bucket{le="+Inf"}'] == "8"
    assert lines["attnkit_kv_blocks_used"] == "0" and lines["attnkit_kv_blocks_total"] == "96"

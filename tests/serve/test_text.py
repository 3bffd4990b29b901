"""Stop strings on decoded text, streamed: nothing past a stop string is ever sent, even when it spans tokens."""

import pytest

from attnkit.serve.app import _Text


@pytest.fixture
def tok(served):
    return served.tokenizer


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def _stream(tok, text, stops):
    return _feed(tok, _ids(tok, text), stops)


def _feed(tok, ids, stops):
    """Feeds ``ids`` one at a time (then a final empty feed unless a stop string was hit): the pieces sent, whether
    a stop string was hit, and the whole text."""
    t = _Text(tok, stops)
    pieces, hit = [], False
    for i in ids:
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


@pytest.fixture(scope="module")
def byte_tok():
    """A tiny byte-level BPE tokenizer trained here: characters of several bytes come in several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tk.train_from_iterator(["hello world, the words of the world"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")


class _CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call reads."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


@pytest.mark.parametrize("stops", [[], ["ö w"], ["中文 x"]])
def test_streamed_text_equals_decoding_it_whole_with_split_characters(byte_tok, stops):
    text = "héllo wörld 中文 the world, ünïcode 日本語 and words " * 3
    ids = byte_tok(text, add_special_tokens=False).input_ids
    ids = ids[:20] + [byte_tok.eos_token_id] + ids[20:]  # a special token inside: not text
    whole = byte_tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in whole and any(
        len(byte_tok.decode([i])) == 1 and "\ufffd" in byte_tok.decode([i]) for i in ids
    )
    pieces, hit, streamed = _feed(byte_tok, ids, stops)
    cut = min([whole.find(s) for s in stops if s in whole], default=len(whole))
    assert "".join(pieces) == streamed == whole[:cut]
    assert hit == (cut < len(whole))
    assert not any("\ufffd" in p for p in pieces)  # a character's bytes wait for each other


def test_each_token_is_decoded_with_a_few_neighbours_not_the_whole_text(byte_tok):
    counting = _CountingTokenizer(byte_tok)
    ids = byte_tok("héllo wörld 中文 the world " * 20, add_special_tokens=False).input_ids
    t = _Text(counting, ["zzz"])
    for i in ids:
        t.feed([i], final=False)
    t.feed([], final=True)
    assert len(ids) > 150 and t.text == byte_tok.decode(ids)
    assert max(counting.lengths) <= 8  # decoding the whole text each time would read up to len(ids) tokens

"""Padding-free training: a batch packed by DataCollatorWithFlattening gives the padded batch's loss and
gradients with attn_implementation="attnkit"."""

import pytest
import torch

from attnkit import masks

import transformers
from transformers import masking_utils as mu

from attnkit.integrations import hf
from _models import V, hf_kwargs, hf_llama_family, hf_sink_model

TOL = 1e-4
_COMMON = hf_kwargs(intermediate_size=128, attention_dropout=0.0)
LENGTHS = [5, 11, 1, 8]  # a one-token sequence too


@pytest.fixture(scope="module", autouse=True)
def _registered():
    assert hf.register() == "attnkit"


def _model(name: str, impl: str):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        hf_llama_family(name, **_COMMON), attn_implementation=impl
    ).train()


def _sequences():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, V, (n,), generator=g).tolist() for n in LENGTHS]


def _padded(seqs):
    """Right-padded (B, Lmax) batch; no loss on padding."""
    n = max(map(len, seqs))
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        am[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": am, "labels": ids.masked_fill(am == 0, -100)}


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want):
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(float(loss) - float(ref_loss)) <= TOL * max(1.0, abs(float(ref_loss)))
    assert grads.keys() == ref_grads.keys() and len(grads) > 5
    for n in ref_grads:
        scale = max(1.0, ref_grads[n].abs().max().item())
        err = (grads[n] - ref_grads[n]).abs().max().item()
        assert err <= TOL * scale, f"grad of {n} differs by {err:.2e}"


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "cu-seq-lens"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_packed_batch_gives_the_padded_loss_and_gradients(name, flash_kwargs, monkeypatch):
    seqs = _sequences()
    want = _loss_and_grads(_model(name, "eager"), _padded(seqs))
    model = _model(name, "attnkit")
    _assert_same(_loss_and_grads(model, _padded(seqs)), want)
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collate([{"input_ids": s} for s in seqs])
    assert packed["input_ids"].shape == (1, sum(LENGTHS)) and ("cu_seq_lens_q" in packed) == flash_kwargs
    seen = []
    real = hf.attention

    def spy(q, k, v, **kw):
        seen.append(kw["mask"])
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    _assert_same(_loss_and_grads(model, packed), want)
    # the work follows the real tokens: every layer got the packed-sequence mask, no dense (B, 1, L, L) one
    assert seen and all(isinstance(m.form(25, 25), masks.Varlen) for m in seen)
    assert all(m.cu_q.tolist() == [0, 5, 16, 17, 25] for m in seen)


def test_cu_seq_lens_without_position_ids_keep_sequences_apart():
    """Only the flash-attention keywords mark the sequences (position ids count on): still packed."""
    seqs = _sequences()
    model = _model("llama", "attnkit").eval()
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)
    packed = collate([{"input_ids": s} for s in seqs])
    assert "position_ids" not in packed
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"],
            cu_seq_lens_q=packed["cu_seq_lens_q"],
            cu_seq_lens_k=packed["cu_seq_lens_k"],
            max_length_q=packed["max_length_q"],
            max_length_k=packed["max_length_k"],
            use_cache=False,
        ).logits
        # the third sequence alone, at positions 16.. as in the packed row (the rotary phase is relative anyway)
        alone = model(input_ids=torch.tensor([seqs[1]]), position_ids=torch.arange(5, 16)[None], use_cache=False).logits
    torch.testing.assert_close(logits[0, 5:16], alone[0], atol=TOL, rtol=0)


def _packed_masks(fn, pos):
    """attnkit's build_mask and transformers' sdpa_mask of the pattern ``fn`` within the packed documents that
    the position ids ``pos`` (B, L) restart."""
    ids = mu.find_packed_sequence_indices(pos)
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(fn, pos), mu.packed_sequence_mask_function(ids))
    b, n = pos.shape
    got = hf.build_mask(b, n, n, mask_function=packed, allow_is_causal_skip=False)
    want = mu.sdpa_mask(
        batch_size=b,
        q_length=n,
        kv_length=n,
        mask_function=packed,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
    )
    return got, want


def test_build_mask_turns_the_packed_sequence_mask_into_varlen():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    for fn, inner in ((mu.causal_mask_function, "causal"), (mu.sliding_window_causal_mask_function(2), "window")):
        got, want = _packed_masks(fn, pos)
        assert isinstance(got.mask.form(9, 9), masks.Varlen) and got.mask.cu_q.tolist() == [0, 3, 5, 9], inner
        assert torch.equal(got.to_dense(), want)
        # two rows: a document mask with the pattern, equal to transformers' own too
        got2, want2 = _packed_masks(fn, torch.cat([pos, torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]])]))
        assert torch.equal(got2.to_dense(), want2)


def test_cu_seq_lens_for_several_rows_are_refused():
    q = torch.randn(2, 4, 6, 8)
    k = v = torch.randn(2, 2, 6, 8)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed into one row, but the batch has 2 rows"):
        hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position-ids", "cu-seq-lens"])
def test_packed_sink_model_gives_the_padded_loss_and_gradients(flash_kwargs, monkeypatch):
    """GPT-OSS's s_aux reaches attnkit on the packed batch too (every layer gets its sinks with the packed-sequence
    mask), and the loss and gradients (the sinks' included) equal the padded batch's under eager attention."""
    seqs = _sequences()
    want = _loss_and_grads(hf_sink_model("gpt_oss").train(), _padded(seqs))
    assert any(n.endswith(".sinks") for n in want[1])
    model = hf_sink_model("gpt_oss", "attnkit").train()
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    packed = collate([{"input_ids": s} for s in seqs])
    seen = []
    real = hf.attention

    def spy(q, k, v, **kw):
        seen.append((kw["mask"], kw.get("sinks")))
        return real(q, k, v, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    _assert_same(_loss_and_grads(model, packed), want)
    assert len(seen) == 2 and all(isinstance(m.form(25, 25), masks.Varlen) and s is not None for m, s in seen)
    assert all(m.cu_q.tolist() == [0, 5, 16, 17, 25] for m, _ in seen)


def test_restarting_position_ids_keep_sequences_apart_in_the_attention_function():
    """A model that built a plain causal mask for a packed row: the restarting position ids mark the sequences
    (with the sinks in every row); increasing ids, two rows or a padding mask leave the mask as it was."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 9, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g),
        torch.randn(1, 2, 9, 8, generator=g),
    )
    sinks = torch.randn(4, generator=g)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    out, _ = hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, position_ids=pos, s_aux=sinks)
    for a, b in ((0, 3), (3, 5), (5, 9)):
        alone, _ = hf.attention_forward(
            torch.nn.Module(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, is_causal=True, s_aux=sinks
        )
        torch.testing.assert_close(out[:, a:b], alone, atol=1e-6, rtol=0)
    plain, _ = hf.attention_forward(torch.nn.Module(), q, k, v, None, is_causal=True, s_aux=sinks)
    same, _ = hf.attention_forward(
        torch.nn.Module(), q, k, v, None, is_causal=True, s_aux=sinks, position_ids=torch.arange(3, 12)[None]
    )
    assert torch.equal(plain, same)
    padded = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    padded[..., :2] = False
    kept, _ = hf.attention_forward(torch.nn.Module(), q, k, v, padded, position_ids=pos, s_aux=sinks)
    want, _ = hf.attention_forward(torch.nn.Module(), q, k, v, padded, s_aux=sinks)
    assert torch.equal(kept, want)

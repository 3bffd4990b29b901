"""PagedCache: the decode through the block table, ragged batches, fork with copy-on-write, prefix caching,
the allocator's invariants, and the exhausted pool."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import bias as B_
from attnkit import masks
from attnkit.cache import PagedCache, PoolExhausted, StaticCache, attend, explain_paged_attention, paged_attention

F64 = torch.float64


def _pool(nb=10, hkv=2, bs=4, d=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(nb, hkv, bs, d, generator=g, dtype=F64), torch.randn(nb, hkv, bs, dv, generator=g, dtype=F64))


def _gathered(pool, table, n):
    """A sequence's first n positions, read block by block: (1, Hkv, n, D)."""
    bs = pool.shape[2]
    rows = [pool[int(table[p // bs]), :, p % bs] for p in range(n)]
    return torch.stack(rows, dim=1)[None]


@pytest.mark.parametrize(
    "mask,bias,softcap",
    [
        (None, None, None),
        (masks.causal(), B_.alibi(B_.alibi_slopes(4).double()), None),
        (masks.sliding_window(3), B_.relative_buckets(torch.randn(4, 8, dtype=F64), bidirectional=False), 2.0),
        (masks.causal() & masks.sliding_window(4), None, None),  # combinations of positional masks: the pool path
        ((masks.sliding_window(2) | masks.prefix_lm(2)) & ~masks.block_local(5), None, None),
    ],
)
@pytest.mark.parametrize("lq", [1, 3])
@pytest.mark.parametrize("layout,hq", [("block", 4), ("head", 4), ("head", 2)])
def test_paged_attention_equals_attention_on_gathered(mask, bias, softcap, lq, layout, hq):
    """Both pool layouts: block-major (contiguous (NB, Hkv, bs, D)) and PagedCache's head-major storage;
    grouped heads and not (the fused per-sequence kernel), a multi-run table, one- and many-query steps."""
    k_pool, v_pool = _pool()
    if layout == "head":
        k_pool, v_pool = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k_pool, v_pool))
    if hq == 2 and bias is not None:
        bias = (
            B_.alibi(B_.alibi_slopes(2).double())
            if mask is not None and softcap is None
            else B_.relative_buckets(torch.randn(2, 8, dtype=F64), bidirectional=False)
        )
    table = torch.tensor([[3, 5, 9], [1, 0, 0], [7, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 3, 12], dtype=torch.int32)
    q = torch.randn(3, hq, lq, 8, dtype=F64)
    got = paged_attention(q, k_pool, v_pool, table, lens, mask=mask, bias=bias, softcap=softcap)
    for b in range(3):
        n = int(lens[b])
        k, v = _gathered(k_pool, table[b], n), _gathered(v_pool, table[b], n)
        want = attnkit.attention(q[b : b + 1], k, v, mask=mask, bias=bias, softcap=softcap)
        torch.testing.assert_close(got[b : b + 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "bias,products",
    [
        (None, 2),
        (B_.alibi(B_.alibi_slopes(8).double()), 2),
        (B_.from_fn(lambda s, b, h, q, k: s + 0.1 * torch.cos(k.to(s.dtype))), 2 * 3),
    ],
)
def test_paged_attention_reads_views_of_the_pool_without_repeating_heads(monkeypatch, bias, products):
    """Keys and values enter the products as views of the pool (no gather, no copy) with Hkv heads, not Hq:
    a decode whose modifiers read only positions reads the used span of the pool in one product for keys
    and one for values; any other modifier takes a product per run of consecutive blocks."""
    seen = []
    real = torch.matmul

    def spy(a, b, **kw):
        seen.append(b)
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "matmul", spy)
    k_pool, v_pool = _pool(hkv=2)
    table = torch.tensor([[1, 2, 7], [4, 0, 0]], dtype=torch.int32)  # sequence 0: runs [1, 2] and [7]
    lens = torch.tensor([10, 2], dtype=torch.int32)
    q = torch.randn(2, 8, 1, 8, dtype=F64)
    out = paged_attention(q, k_pool, v_pool, table, lens, bias=bias)
    pools = {k_pool.untyped_storage().data_ptr(), v_pool.untyped_storage().data_ptr()}
    assert len(seen) == products
    assert all(b.shape[1] == 2 and b.untyped_storage().data_ptr() in pools for b in seen)
    monkeypatch.setattr(torch, "matmul", real)
    for r in range(2):
        n = int(lens[r])
        want = attnkit.attention(
            q[r : r + 1], _gathered(k_pool, table[r], n), _gathered(v_pool, table[r], n), bias=bias
        )
        torch.testing.assert_close(out[r : r + 1], want, rtol=0, atol=1e-12)


def test_head_major_pool_reads_one_view_per_sequence(monkeypatch):
    """A head-major pool ((Hkv, num_blocks, ...) storage seen as (num_blocks, Hkv, ...)): a sequence stored in
    one run of blocks enters the fused kernel as a view of the pool (Hkv, L, D), with no copy, and a
    zero-length sequence gives zeros."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((k, v))
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    k_pool, v_pool = (torch.randn(2, 8, 4, 8, dtype=F64).transpose(0, 1) for _ in range(2))
    table = torch.tensor([[2, 3, 4], [0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 0], dtype=torch.int32)
    q = torch.randn(2, 2, 1, 8, dtype=F64)
    out = paged_attention(q, k_pool, v_pool, table, lens)
    assert len(seen) == 1
    k, v = seen[0]
    assert k.shape == (1, 2, 10, 8) and k.untyped_storage().data_ptr() == k_pool.untyped_storage().data_ptr()
    assert v.untyped_storage().data_ptr() == v_pool.untyped_storage().data_ptr()
    want = attnkit.attention(q[:1], _gathered(k_pool, table[0], 10), _gathered(v_pool, table[0], 10))
    torch.testing.assert_close(out[:1], want, rtol=0, atol=1e-12)
    assert out[1].abs().max() == 0


_POSITION_MODS = ["none", "window", "prefix", "block_local", "alibi", "t5", "temperature", "window+alibi"]


def _position_mods(kind: str, hq: int):
    mask = {
        "window": masks.sliding_window(5),
        "prefix": masks.prefix_lm(6),
        "block_local": masks.block_local(8),
        "window+alibi": masks.sliding_window(9),
    }.get(kind)
    g = torch.Generator().manual_seed(hq)
    bias = {
        "alibi": B_.alibi(B_.alibi_slopes(hq).double()),
        "window+alibi": B_.alibi(B_.alibi_slopes(hq).double()),
        "t5": B_.relative_buckets(torch.randn(hq, 8, generator=g, dtype=F64), bidirectional=False),
        "temperature": B_.temperature(torch.rand(hq, generator=g, dtype=F64) + 0.5),
    }.get(kind)
    return mask, bias


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    layout=st.sampled_from(["block", "head"]),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    softcap=st.sampled_from([None, 3.0]),
    nb=st.integers(4, 96),
    mods=st.sampled_from(_POSITION_MODS),
)
def test_pool_decode_equals_the_gathered_oracle(data, layout, hkv, group, softcap, nb, mods):
    """The decode over spans of the pool (any scatter of blocks, gaps, blocks shared by several rows, empty
    rows, grouped heads, softcap, both storage orders, masks and biases evaluated at each block's own
    positions) equals attention on each row's gathered keys."""
    mask, bias = _position_mods(mods, hkv * group)
    bs, d = 4, 8
    g = torch.Generator().manual_seed(nb)
    k_pool, v_pool = (torch.randn(nb, hkv, bs, d, generator=g, dtype=F64) for _ in range(2))
    if layout == "head":
        k_pool, v_pool = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k_pool, v_pool))
    B = data.draw(st.integers(1, 5))
    free = list(range(0, nb, data.draw(st.sampled_from([1, 9]))))  # every block, or gaps that split spans
    rows, lens = [], []
    for r in range(B):
        n = data.draw(st.integers(0, 6 * bs))
        shared = []
        if r and rows[0] and data.draw(st.booleans()):  # start with row 0's first blocks (a shared prefix)
            shared = rows[0][: data.draw(st.integers(1, len(rows[0])))]
        need = max(0, -(-n // bs) - len(shared))
        if need > len(free):
            n, need = len(shared) * bs, 0
        own = data.draw(st.permutations(free))[:need]
        free = [b for b in free if b not in own]
        rows.append(shared[: -(-n // bs)] + own)
        lens.append(n)
    width = max(1, max(len(r) for r in rows))
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    q = torch.randn(B, hkv * group, 1, d, generator=g, dtype=F64)
    got = paged_attention(
        q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32), softcap=softcap, mask=mask, bias=bias
    )
    for r in range(B):
        if lens[r] == 0:
            assert got[r].abs().max() == 0
            continue
        k, v = _gathered(k_pool, table[r], lens[r]), _gathered(v_pool, table[r], lens[r])
        want = attnkit.attention(q[r : r + 1], k, v, softcap=softcap, mask=mask, bias=bias)
        torch.testing.assert_close(got[r : r + 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mods", _POSITION_MODS[1:])
def test_pool_decode_takes_position_only_modifiers(mods):
    """Every built-in mask and bias that reads only positions runs on the pool path (scattered blocks, a
    shared prefix block, grouped heads) and equals the gathered oracle."""
    mask, bias = _position_mods(mods, 4)
    k_pool, v_pool = _pool(nb=40, hkv=2)
    table = torch.tensor([[31, 2, 17, 9], [31, 5, 0, 0], [22, 23, 24, 38]], dtype=torch.int32)
    lens = torch.tensor([15, 6, 16], dtype=torch.int32)
    q = torch.randn(3, 4, 1, 8, dtype=F64)
    got = paged_attention(q, k_pool, v_pool, table, lens, mask=mask, bias=bias)
    assert explain_paged_attention(q, k_pool, v_pool, table, lens, mask=mask, bias=bias).startswith("pool: ")
    for r in range(3):
        n = int(lens[r])
        want = attnkit.attention(
            q[r : r + 1], _gathered(k_pool, table[r], n), _gathered(v_pool, table[r], n), mask=mask, bias=bias
        )
        torch.testing.assert_close(got[r : r + 1], want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_decode_numerical_rule_in_low_precision(dtype):
    """In float32 and half types the pool decode's error against the float64 oracle is at most twice the naive
    formula's in the same dtype (scores and softmax run in float32)."""
    from attnkit.testing import max_err, reference

    g = torch.Generator().manual_seed(3)
    nb, hkv, bs, d = 40, 2, 16, 64
    k_pool, v_pool = torch.randn(nb, hkv, bs, d, generator=g), torch.randn(nb, hkv, bs, d, generator=g)
    table = torch.randperm(nb, generator=g)[:36].view(4, 9).to(torch.int32)
    lens = torch.tensor([144, 97, 1, 130], dtype=torch.int32)
    q = torch.randn(4, 4, 1, d, generator=g) * 2
    args = (q.to(dtype), k_pool.to(dtype), v_pool.to(dtype), table, lens)
    got = paged_attention(*args)
    assert explain_paged_attention(*args).startswith("pool: "), "the decode did not take the pool path"
    for r in range(4):
        n = int(lens[r])
        k, v = _gathered(k_pool, table[r], n), _gathered(v_pool, table[r], n)
        oracle, _ = reference(q[r : r + 1].double(), k.double(), v.double())
        naive, _ = reference(q[r : r + 1].to(dtype), k.to(dtype), v.to(dtype))
        assert max_err(got[r : r + 1], oracle) <= 2 * max_err(naive, oracle) + 1e-6


def test_ragged_batch_decode_and_prefill_equal_each_sequence_alone():
    g = torch.Generator().manual_seed(1)
    cache = PagedCache(1, num_blocks=20, block_size=4, n_kv_heads=2, d_head=8, dtype=F64)
    lens = [5, 9, 2]
    ids = [cache.add_sequence() for _ in lens]
    data = [[torch.randn(1, h, 20, 8, generator=g, dtype=F64) for h in (4, 2, 2)] for _ in lens]
    mask, bias = masks.causal(), B_.alibi(B_.alibi_slopes(4).double())
    for s, n, (q, k, v) in zip(ids, lens, data):  # prompts one at a time
        attend(cache.batch([s]).layers[0].update(k[:, :, :n], v[:, :, :n]), q[:, :, :n], mask=mask, bias=bias)
    for step in range(4):  # ragged decode: one token each
        cur = [n + step for n in lens]
        qs = torch.cat([q[:, :, c : c + 1] for (q, _, _), c in zip(data, cur)])
        ks = torch.cat([k[:, :, c : c + 1] for (_, k, _), c in zip(data, cur)])
        vs = torch.cat([v[:, :, c : c + 1] for (_, _, v), c in zip(data, cur)])
        batch = cache.batch(ids)
        assert batch.positions(1)[:, 0].tolist() == cur
        out = attend(batch.layers[0].update(ks, vs), qs, mask=mask, bias=bias)
        for b, ((q, k, v), c) in enumerate(zip(data, cur)):
            want = attnkit.attention(q[:, :, c : c + 1], k[:, :, : c + 1], v[:, :, : c + 1], mask=mask, bias=bias)
            torch.testing.assert_close(out[b : b + 1], want, rtol=0, atol=1e-12)
    # a ragged multi-token step (two tokens each) is right-aligned with a padding mask
    cur = [n + 4 for n in lens]
    qs = torch.cat([q[:, :, c : c + 2] for (q, _, _), c in zip(data, cur)])
    ks = torch.cat([k[:, :, c : c + 2] for (_, k, _), c in zip(data, cur)])
    vs = torch.cat([v[:, :, c : c + 2] for (_, _, v), c in zip(data, cur)])
    out = attend(cache.batch(ids).layers[0].update(ks, vs), qs, mask=mask, bias=bias)
    for b, ((q, k, v), c) in enumerate(zip(data, cur)):
        want = attnkit.attention(q[:, :, c : c + 2], k[:, :, : c + 2], v[:, :, : c + 2], mask=mask, bias=bias)
        torch.testing.assert_close(out[b : b + 1], want, rtol=0, atol=1e-12)


def test_a_ragged_batch_without_positions_is_an_error():
    """Default positions are seq_len + arange(L): one seq_len for sequences of different lengths gave the
    shorter ones wrong positions (silently wrong logits); the batch's seq_len now refuses."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny")).eval()
    pool = PagedCache.for_model(model, 8, 4)
    a, b = pool.add_sequence(), pool.add_sequence()
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]), cache=pool.batch([a]))
        model(torch.tensor([[5, 6]]), cache=pool.batch([b]))
        view = pool.batch([a, b])
        with pytest.raises(ValueError, match=r"different lengths \[7, 2\].*positions=batch.positions"):
            model(torch.tensor([[10], [11]]), cache=view)
        got = model(torch.tensor([[10], [11]]), cache=pool.batch([a, b]), positions=view.positions(1))
        want = model(torch.tensor([[5, 6, 11]]))[:, -1]
    torch.testing.assert_close(got[1, -1], want[0], rtol=1e-5, atol=1e-5)
    assert pool.batch([a]).seq_len == 8  # one sequence: its own length


def test_paged_equals_static():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, 13, 8, generator=g) for h in (4, 2, 2))
    static = StaticCache(2, max_len=13)
    paged = PagedCache(2, num_blocks=8, block_size=4, n_kv_heads=2, d_head=8)
    sid = paged.add_sequence()
    for a, b in [(0, 6), (6, 7), (7, 8), (8, 13)]:
        pb = paged.batch([sid])
        for i in range(2):
            o_s = attend(static.layers[i].update(k[:, :, a:b], v[:, :, a:b]), q[:, :, a:b], mask=masks.causal())
            o_p = attend(pb.layers[i].update(k[:, :, a:b], v[:, :, a:b]), q[:, :, a:b], mask=masks.causal())
            torch.testing.assert_close(o_p, o_s, rtol=1e-6, atol=1e-6)
    assert paged.length(sid) == static.seq_len == 13


def _fill(cache, sid, k, v):
    """Write k/v (1, Hkv, n, D) into sequence sid, one forward."""
    return cache.batch([sid]).layers[0].update(k, v)


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    cache = PagedCache(1, num_blocks=6, block_size=4, n_kv_heads=1, d_head=2, dtype=F64)
    a = cache.add_sequence()
    base_k = torch.arange(12, dtype=F64).view(1, 1, 6, 2)
    _fill(cache, a, base_k, base_k)  # 6 positions: one full block, one half-filled
    assert cache.num_free_blocks == 4
    b = cache.fork(a)
    assert cache.num_free_blocks == 4  # nothing copied yet
    assert cache.blocks_needed(b, 1) == 1  # the shared partial block must be copied before writing
    _fill(cache, b, torch.full((1, 1, 1, 2), -1.0, dtype=F64), torch.full((1, 1, 1, 2), -1.0, dtype=F64))
    _fill(cache, a, torch.full((1, 1, 1, 2), 7.0, dtype=F64), torch.full((1, 1, 1, 2), 7.0, dtype=F64))
    ta, tb = cache.block_table([a])[0], cache.block_table([b])[0]
    assert ta[0] == tb[0] and ta[1] != tb[1]  # full block shared, partial block copied
    ka, kb = _gathered(cache.k_pools[0], ta, 7), _gathered(cache.k_pools[0], tb, 7)
    assert torch.equal(ka[:, :, :6], base_k) and torch.equal(kb[:, :, :6], base_k)
    assert ka[0, 0, 6].tolist() == [7.0, 7.0] and kb[0, 0, 6].tolist() == [-1.0, -1.0]
    cache.free(a)
    assert cache.num_free_blocks == 6 - 2  # b still holds the shared full block and its own copy
    cache.free(b)
    assert cache.num_free_blocks == 6


def _kv_of(tokens, start=0):
    """Deterministic keys/values of a token run: what a model would compute for them at those positions."""
    t = torch.tensor(tokens, dtype=F64)
    pos = torch.arange(start, start + len(tokens), dtype=F64)
    k = torch.stack([t, pos], dim=-1).view(1, 1, len(tokens), 2)
    return k, k + 0.5


def test_prefix_caching_reuses_full_blocks_of_the_same_prefix():
    cache = PagedCache(1, num_blocks=8, block_size=4, n_kv_heads=1, d_head=2, dtype=F64)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    a = cache.add_sequence(prompt)
    assert cache.length(a) == 0  # nothing cached yet
    _fill(cache, a, *_kv_of(prompt))
    cache.free(a)
    b = cache.add_sequence(prompt[:9] + [99, 98])  # same first two full blocks
    assert cache.length(b) == 8 and cache.stats()["prefix_hits"] == 2
    kv = _fill(cache, b, *_kv_of([13, 99, 98], start=8))
    k_all = kv[0]
    torch.testing.assert_close(k_all, _kv_of(prompt[:9] + [99, 98])[0])
    c = cache.add_sequence([5, 6, 7, 8, 1, 2, 3, 4, 0])  # shares only the first block
    assert cache.length(c) == 4
    d = cache.add_sequence([5, 6, 7, 8])  # a prompt of exactly one block: its last token is recomputed
    assert cache.length(d) == 0


def test_prefix_blocks_are_evicted_only_when_the_pool_needs_them():
    cache = PagedCache(1, num_blocks=3, block_size=2, n_kv_heads=1, d_head=2, dtype=F64)
    a = cache.add_sequence([1, 2, 3, 4, 5])
    _fill(cache, a, *_kv_of([1, 2, 3, 4, 5]))
    cache.free(a)
    assert cache.num_free_blocks == 3
    b = cache.add_sequence([9, 9, 9, 9, 9, 9])  # needs all three blocks: the cached ones are evicted
    _fill(cache, b, *_kv_of([9] * 6))
    cache.free(b)
    c = cache.add_sequence([1, 2, 3, 4, 5])
    assert cache.length(c) == 0  # the old prefix is gone


def test_exhausted_pool_error_and_all_or_nothing_reserve():
    cache = PagedCache(1, num_blocks=2, block_size=4, n_kv_heads=1, d_head=2)
    a = cache.add_sequence()
    cache.reserve(a, 5)
    b = cache.add_sequence()
    with pytest.raises(PoolExhausted, match="needs 1 more block.*only 0 of 2 are free"):
        cache.reserve(b, 1)
    with pytest.raises(PoolExhausted, match="needs 2 more block.*for 16 new"):
        cache.reserve(a, 16)
    assert cache.blocks_needed(a, 3) == 0 and cache.num_free_blocks == 0
    with pytest.raises(ValueError, match="no sequence 42"):
        cache.free(42)
    with pytest.raises(ValueError, match="repeat"):
        cache.batch([a, a])


@settings(max_examples=30)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "grow", "fork", "free"]), st.integers(0, 7), st.integers(1, 9)), max_size=40
    )
)
def test_allocator_invariants(ops):
    """Reference counts equal the number of sequences holding each block; blocks are never lost."""
    cache = PagedCache(1, num_blocks=12, block_size=3, n_kv_heads=1, d_head=1, prefix_caching=True)
    for op, pick, n in ops:
        live = cache.sequences()
        if op == "add" or not live:
            cache.add_sequence([pick] * n)
            continue
        sid = live[pick % len(live)]
        if op == "grow":
            try:
                _fill(cache, sid, torch.ones(1, 1, n, 1), torch.ones(1, 1, n, 1))
            except PoolExhausted:
                pass
        elif op == "fork":
            cache.fork(sid)
        else:
            cache.free(sid)
        refs = [0] * 12
        for s in cache.sequences():
            seq = cache._seqs[s]
            assert len(seq.blocks) * 3 >= seq.length
            for blk in seq.blocks:
                refs[blk] += 1
        assert refs == cache._alloc.refs
        held = sum(1 for r in refs if r > 0)
        assert held + cache.num_free_blocks == 12


def test_a_pool_with_empty_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="blocks hold 0 positions"):
        paged_attention(
            torch.randn(2, 2, 1, 16),
            torch.randn(4, 1, 0, 16),
            torch.randn(4, 1, 0, 16),
            torch.zeros(2, 3, dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32),
        )


def test_bad_arguments_of_paged_attention_are_clear_errors():
    """softcap=-1.0 computed (attention() refuses it), a bool block table was read as block ids 0/1, and a
    bad scale, bias or mask gave raw Python/torch messages (or failed inside the decode)."""
    kp, vp = _pool()
    q = torch.randn(2, 2, 1, 8, dtype=F64)
    table = torch.tensor([[3, 5], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([7, 2], dtype=torch.int32)
    for kw, err, match in (
        (dict(softcap=-1.0), ValueError, r"softcap=-1.0 must be > 0.0 \(or None for no softcap\)"),
        (dict(softcap=0), ValueError, "softcap=0 must be > 0.0"),
        (dict(scale="x"), ValueError, "scale='x' must be a finite number"),
        (dict(scale=float("nan")), ValueError, "scale=nan must be a finite number"),
        (dict(scale=1e200), ValueError, "scale=1e[+]?200 scales the scores by 1e[+]?200, beyond"),
        (dict(bias="alibi"), TypeError, "bias must be None, a float tensor or an attnkit.bias modifier, got str"),
        (dict(bias=lambda s, b, h, i, j: s), TypeError, "bias.from_fn"),
        (dict(bias=torch.zeros(1, 1, 1, 8, dtype=torch.long)), TypeError, "bias must be a float tensor of additive"),
        (dict(mask="causal"), TypeError, "mask must be None, an attnkit.masks.Mask, a bool tensor or a FlexAtt"),
        (dict(mask=lambda b, h, i, j: i >= j), TypeError, "masks.from_fn"),
        (dict(mask=torch.ones(1, 1, 1, 8)), TypeError, "mask must be a bool tensor .True = may attend., got dtype"),
        (dict(sinks=torch.tensor([1.0, float("inf")], dtype=F64)), ValueError, "sinks holds a non-finite value"),
    ):
        with pytest.raises(err, match=match) as paged:
            paged_attention(q, kp, vp, table, lens, **kw)
        # the checks attention makes, with the same messages
        with pytest.raises(err, match=match) as plain:
            attnkit.attention(q, kp[:2], vp[:2], **kw)
        assert str(paged.value) == f"paged_attention: {plain.value}"
    for name, bad in (
        ("block_table", (table > 0, lens)),
        ("block_table", (table.double(), lens)),
        ("seq_lens", (table, lens > 0)),
    ):
        with pytest.raises(TypeError, match=f"{name} must be an integer tensor"):
            paged_attention(q, kp, vp, *bad)
    ref = paged_attention(q, kp, vp, table, lens, softcap=2.0, scale=1)  # an int scale is a number
    assert ref.shape == (2, 2, 1, 6)


def test_token_and_sequence_ids_must_be_ints():
    """add_sequence([1.5]) stored token 1 (and so matched another prompt's prefix), ["a"] and batch("x")
    gave int()'s message, batch([1.5]) read sequence 1, and True found sequence 1."""
    pool = PagedCache(1, num_blocks=8, block_size=2, n_kv_heads=1, d_head=2)
    for tokens in ([1.5], ["a"], "abc", [True, 2], torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), 7):
        with pytest.raises(TypeError, match="add_sequence: tokens must be a"):
            pool.add_sequence(tokens)
    assert pool.sequences() == []  # nothing was started
    a = pool.add_sequence(torch.tensor([1, 2, 3]))
    assert a == 0
    b = pool.add_sequence((4, 5))
    with pytest.raises(TypeError, match="append_tokens: tokens must be a list of int token ids"):
        pool.append_tokens(a, [2.5])
    for ids, match in (("x", "got 'x'"), (b, rf"pass \[{b}\]"), ([1.5], r"got \[1.5\]"), ([True], r"got \[True\]")):
        for call in (pool.batch, pool.block_table, pool.seq_lens):
            with pytest.raises(TypeError, match=f"seq_ids must be a list of sequence ids .*{match}"):
                call(ids)
    with pytest.raises(ValueError, match="no sequence True"):
        pool.length(True)
    assert pool.batch([b, a]).ids == [b, a] and pool.seq_lens(range(2)).tolist() == [0, 0]


def test_a_decode_step_with_autograd_on_has_the_static_cache_gradients():
    """With gradients on, the pool-wide decode raised from an out= matmul: it now records the graph, and the
    gradients (parameters and query) equal those through a StaticCache."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("tiny", vocab_size=32, n_kv_heads=2)).double()
    prompts, nxt = [[1, 2, 3, 4, 5], [6, 7]], torch.tensor([[8], [9]])
    grads = {}
    for kind in ("static", "paged"):
        model.zero_grad()
        if kind == "static":
            cache = StaticCache.for_model(model, 1, 8)
            with torch.no_grad():
                model(torch.tensor(prompts[:1]), cache=cache)
            loss = model(nxt[:1], cache=cache).logsumexp(-1).sum()
        else:
            pool = PagedCache.for_model(model, 8, 2)
            sids = [pool.add_sequence() for _ in prompts]
            with torch.no_grad():
                for sid, p in zip(sids, prompts):
                    model(torch.tensor([p]), cache=pool.batch([sid]))
            view = pool.batch(sids)
            loss = model(nxt, cache=view, positions=view.positions(1))[:1].logsumexp(-1).sum()
        loss.backward()
        grads[kind] = [p.grad.clone() for p in model.parameters()]
    for gs, gp in zip(grads["static"], grads["paged"]):
        torch.testing.assert_close(gp, gs, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("head_major", [False, True])
def test_paged_attention_gradients_reach_the_query_and_the_pool(head_major):
    """paged_attention's pool-wide decode with a query and a pool that require grad: gradients equal those of
    attention() over each sequence's gathered keys (float64)."""
    kp, vp = _pool(nb=12, hkv=2, bs=4, d=8, dv=6)
    if head_major:  # (Hkv, num_blocks, ...) storage, seen as (num_blocks, Hkv, ...)
        kp, vp = kp.transpose(0, 1).contiguous().transpose(0, 1), vp.transpose(0, 1).contiguous().transpose(0, 1)
    kp, vp = kp.requires_grad_(), vp.requires_grad_()
    q = torch.randn(3, 4, 1, 8, dtype=F64, requires_grad=True)
    table = torch.tensor([[3, 9, 1], [0, 0, 0], [10, 11, 2]], dtype=torch.int32)
    lens = torch.tensor([11, 3, 9], dtype=torch.int32)
    out = paged_attention(q, kp, vp, table, lens, softcap=5.0, bias=B_.alibi(B_.alibi_slopes(4)))
    ref = torch.cat(
        [
            attnkit.attention(
                q[b : b + 1],
                _gathered(kp, table[b], int(n)),
                _gathered(vp, table[b], int(n)),
                softcap=5.0,
                bias=B_.alibi(B_.alibi_slopes(4)),
            )
            for b, n in enumerate(lens)
        ]
    )
    dout = torch.randn_like(ref)
    got = torch.autograd.grad((out * dout).sum(), (q, kp, vp))
    want = torch.autograd.grad((ref * dout).sum(), (q, kp, vp))
    torch.testing.assert_close(out, ref)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("mask,lq", [(None, 1), (masks.sliding_window(4), 1), (masks.causal(), 3)])
@pytest.mark.parametrize("layout", ["block", "head"])
def test_garbage_in_unfilled_and_hidden_slots_reaches_no_row(fill, mask, lq, layout):
    """The unfilled end of a sequence's last block, blocks no sequence reads, and (under a mask) keys no query
    may see can hold anything (an uninitialised pool): the result is the one with zeros there, never NaN."""
    k_pool, v_pool = _pool(nb=12)
    table = torch.tensor([[3, 5, 9], [1, 0, 0], [7, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([9, 3, 11], dtype=torch.int32)
    bs = k_pool.shape[2]
    junk = torch.zeros(k_pool.shape[:3], dtype=torch.bool)  # (NB, Hkv, bs) slots no query may see
    junk[[6, 8, 10, 11]] = True  # blocks no sequence reads (some inside the spans read whole)
    for b, n in enumerate(lens.tolist()):
        for p in range(n, table.shape[1] * bs):
            if p // bs < -(-n // bs):
                junk[int(table[b, p // bs]), :, p % bs] = True
        if isinstance(mask, masks.Mask) and lq == 1:  # a window of 4 keys behind the newest query
            for p in range(0, n - 5):
                junk[int(table[b, p // bs]), :, p % bs] = True
    if layout == "head":
        k_pool, v_pool = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in (k_pool, v_pool))
    clean_k, clean_v = (t.masked_fill(junk[..., None], 0.0) for t in (k_pool, v_pool))
    q = torch.randn(3, 4, lq, 8, dtype=F64)
    want = paged_attention(q, clean_k, clean_v, table, lens, mask=mask)
    for which in ("k", "v"):
        bad_k = clean_k.masked_fill(junk[..., None], fill) if which == "k" else clean_k
        bad_v = clean_v.masked_fill(junk[..., None], fill) if which == "v" else clean_v
        got = paged_attention(q, bad_k, bad_v, table, lens, mask=mask)
        assert torch.isfinite(got).all(), (which, fill)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_combined_positional_masks_take_the_pool_path():
    k_pool, v_pool = _pool(nb=12)
    table = torch.tensor([[3, 5, 9], [1, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([9, 3], dtype=torch.int32)
    q = torch.randn(2, 4, 1, 8, dtype=F64)

    def path(mask):
        return explain_paged_attention(q, k_pool, v_pool, table, lens, mask=mask)

    assert path(masks.causal() & masks.sliding_window(4)).startswith("pool: ")
    assert path(~masks.block_local(4) | masks.prefix_lm(2)).startswith("pool: ")
    reads_more = "per sequence: one attention per sequence over its runs of blocks (the mask or bias reads more"
    assert path(masks.causal() & masks.key_padding(torch.tensor([3, 3]))).startswith(reads_more)
    assert path(masks.causal(align="top_left") & masks.sliding_window(4)).startswith(reads_more)
    many = explain_paged_attention(q.expand(2, 4, 2, 8), k_pool, v_pool, table, lens)
    assert many.endswith("(2 queries per sequence; the pool path takes decode steps)")
    sinks = torch.zeros(4, dtype=F64)
    assert explain_paged_attention(q, k_pool, v_pool, table, lens, sinks=sinks).endswith("(sinks)")

"""Triton kernels of the ``triton`` backend: block-sparse flash attention (forward, backward) and paged decoding.

The functions below are plain Python until :func:`build` turns them into Triton kernels.  This module does
not import triton: importing it (pytest's doctest collection does) must not fix triton's mode.  Triton builds
its own standard library (``tl.zeros``, ``tl.max``, ...) once, when ``triton.language`` is first imported,
for the interpreter when ``TRITON_INTERPRET=1`` is set at that moment and for the GPU compiler otherwise;
our kernels must be built the same way or they cannot call it.  :func:`build` therefore follows the mode
triton was imported in, rather than reading the environment again.

Layout shared by the attention kernels (all index math is in elements, not bytes):

- ``q (B, Hq, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, DV)``, ``out (B, Hq, Lq, DV)``,
  ``lse (B, Hq, Lq)`` float32 (natural log); query head ``h`` reads key/value head ``h // GROUP``.
- A *tile list* per (batch, head, row tile): ``Count[b, h, r] = (n_partial, n_total)`` and
  ``Index[b, h, r, :n_total]`` the tiles to visit along the other axis, the ``n_partial`` partial ones
  first (their element mask must be evaluated), then the full ones.  ``TileId[b, h, r, j]`` names the
  bitmap of partial entry ``j`` when the mask is read from a bitmap.  Batch/head strides are 0 where the
  mask does not depend on them.  For the forward and dq kernels rows are query tiles and entries key
  tiles; for the dk/dv kernel rows are key tiles and entries query tiles.
- ``Bitmap (n_tiles, BLOCK_M, WORDS)`` int32: bit ``c % 32`` of word ``c // 32`` in row ``r`` of a tile
  says whether query ``r`` may attend to key ``c`` of that tile.

Batch and head indices (and page numbers) are widened to int64 before they multiply strides, so offsets
into tensors of more than 2^31 elements do not overflow.

Scores are kept in base 2 inside the online softmax (``exp2`` is the GPU's native exponential):
``s2 = s * 1.44269504`` (1/ln 2), and the log-sum-exp is turned back into natural log on the way out.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import importlib.abc
    import importlib.machinery

tl: Any = None  # triton.language, bound by build()

# ----------------------------------------------------------------------------------------------- helpers


def _dot(a, b, EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """``a @ b`` with float32 accumulation.

    ``PRECISION`` is "ieee" for float32 inputs (no TF32 rounding: float32 results must match a float32
    reference) and "tf32" (ignored) for halves.  ``EMULATE_BF16``: see :func:`_round`.
    """
    if EMULATE_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def _round(x, dtype, EMULATE_BF16: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even as the GPU does.

    ``EMULATE_BF16`` is set only under the Triton interpreter with bfloat16 inputs, whose bfloat16 is
    unlike the GPU's twice over: its casts truncate instead of rounding, and its ``tl.dot`` multiplies
    bfloat16 tiles as raw 16-bit integers.  So there the rounding is done on the float32 bits (add half
    of the dropped 16 bits, ties to even, drop them) and the value stays float32 for :func:`_dot`, which
    widens bfloat16 operands to float32; the products of two bfloat16 numbers are exact in float32, as in
    the GPU's tensor cores, so the results are the GPU's up to summation order.
    """
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _tanh(x):
    """tanh in float32 from ``exp`` (the interpreter has no libdevice).

    ``sign(x) (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` is exact in the tails but cancels near 0, where
    the Taylor series ``x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835`` is used instead (for ``|x| < 0.25``
    its truncation error is below 2e-9).
    """
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    t = (1.0 - e) / (1.0 + e)
    a2 = a * a
    series = a * (
        1.0
        + a2
        * (-0.3333333333333333 + a2 * (0.13333333333333333 + a2 * (-0.05396825396825397 + a2 * 0.021869488536155203)))
    )
    t = tl.where(a < 0.25, series, t)
    return tl.where(x < 0, -t, t)


def _score_mods(
    s,
    q_pos,
    k_pos,
    b,
    h,
    softcap,
    Slopes,
    alibi_off,
    Bias,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    q_len,
    kv_len,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """softcap, then ALiBi or a tensor bias, on scaled scores ``s``; returns ``(s, tanh)`` (tanh for the
    softcap's derivative).  ``q_pos``/``k_pos`` are broadcastable query rows / key indices of the tile."""
    t = s
    if HAS_SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    if HAS_ALIBI:
        slope = tl.load(Slopes + h)
        s = s - slope * tl.abs(q_pos + alibi_off - k_pos).to(tl.float32)
    if HAS_BIAS:
        ptrs = Bias + b * stride_bb + h * stride_bh + q_pos * stride_bm + k_pos * stride_bn
        s = s + tl.load(ptrs, mask=(q_pos < q_len) & (k_pos < kv_len), other=0.0).to(tl.float32)
    return s, t


def _allowed(
    q_pos,
    k_pos,
    b,
    lo_off,
    hi_off,
    prefix_off,
    prefix_n,
    QDoc,
    KDoc,
    stride_qdb,
    stride_kdb,
    KeyLen,
    Bitmap,
    tile,
    q0,
    k0,
    q_len,
    kv_len,
    BLOCK_M: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_KEYLEN: tl.constexpr,
    HAS_BITMAP: tl.constexpr,
):
    """The element mask of a partial tile: the built-in predicates evaluated here, or the tile's bitmap.

    Row ``i`` of the query axis sits at ``i + offset``; the offsets were folded into ``lo_off`` /
    ``hi_off`` / ``prefix_off`` on the host (different masks may use different alignments):
    ``k >= q + lo_off`` (window start), ``k <= q + hi_off`` (causal / window end),
    ``k <= q + prefix_off or k < prefix_n`` (prefix LM), equal document ids, ``k < KeyLen[b]``.
    """
    ok = (q_pos >= 0) & (k_pos >= 0)  # all True, shaped like the tile
    if HAS_LO:
        ok = ok & (k_pos >= q_pos + lo_off)
    if HAS_HI:
        ok = ok & (k_pos <= q_pos + hi_off)
    if HAS_PREFIX:
        ok = ok & ((k_pos <= q_pos + prefix_off) | (k_pos < prefix_n))
    if HAS_DOC:
        qd = tl.load(QDoc + b * stride_qdb + q_pos, mask=q_pos < q_len, other=-1)
        kd = tl.load(KDoc + b * stride_kdb + k_pos, mask=k_pos < kv_len, other=-2)
        ok = ok & (qd == kd)
    if HAS_KEYLEN:
        ok = ok & (k_pos < tl.load(KeyLen + b))
    if HAS_BITMAP:
        r = q_pos - q0
        c = k_pos - k0
        words = tl.load(Bitmap + (tile * BLOCK_M + r) * WORDS + c // 32)
        ok = ok & (((words >> (c % 32)) & 1) != 0)
    return ok


def _seen(ok, row_ok):
    """Which keys (columns) of a tile's element mask ``ok (BLOCK_M, BLOCK_N)`` some real query row may see."""
    return tl.max((ok & row_ok[:, None]).to(tl.int32), 0) > 0


def _tile_list(Count, Index, TileId, b, h, r, stride_cb, stride_ch, stride_cr, stride_ib, stride_ih, stride_ir):
    """Row tile ``r``'s tile list (module docstring): ``(n_partial, n_total, index, tile_ids)``, pointers last."""
    count = Count + b * stride_cb + h * stride_ch + r * stride_cr
    entries = b * stride_ib + h * stride_ih + r * stride_ir  # (Index and TileId share their strides)
    return tl.load(count), tl.load(count + 1), Index + entries, TileId + entries


def _softmax_step(s, v, m_i, l_i, acc, v_dtype, EMULATE_BF16: tl.constexpr, PRECISION: tl.constexpr):
    """Base-2 scores ``s (rows, keys)`` and values ``v (keys, DV)`` into the online softmax's ``(m_i, l_i, acc)``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_round(p, v_dtype, EMULATE_BF16), v, EMULATE_BF16, PRECISION)
    return m_new, l_i, acc


def _softmax_result(m_i, l_i, acc):
    """``(out, lse)`` of the online softmax (lse in natural log); a row that saw nothing gives 0 and -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)  # ln 2
    return out, lse


# ----------------------------------------------------------------------------------------------- forward


def _attn_fwd(
    Q,
    K,
    V,
    Out,
    Lse,
    Count,
    Index,
    TileId,
    Bitmap,
    Slopes,
    Bias,
    QDoc,
    KDoc,
    KeyLen,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    stride_cb,
    stride_ch,
    stride_cr,
    stride_ib,
    stride_ih,
    stride_ir,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_qdb,
    stride_kdb,
    scale,
    softcap,
    alibi_off,
    lo_off,
    hi_off,
    prefix_off,
    prefix_n,
    q_len,
    kv_len,
    GROUP,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_KEYLEN: tl.constexpr,
    HAS_BITMAP: tl.constexpr,
    EVEN_N: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query tile of one head: out and lse over the key tiles its tile list names.

    Grid ``(query tiles, Hq, B)``.  ``EVEN_N``: Lk is a multiple of BLOCK_N, so key loads need no bounds.
    """
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
        mask=(rows[:, None] < q_len) & (offs_d[None, :] < D),
        other=0.0,
    )  # (BLOCK_M, BLOCK_D)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    # scores go straight to base 2 when nothing sits between the scale and the softmax
    PLAIN: tl.constexpr = not (HAS_SOFTCAP or HAS_ALIBI or HAS_BIAS)
    qk_scale = scale * 1.44269504 if PLAIN else scale  # 1/ln(2)

    n_partial, n_total, index, tile_ids = _tile_list(
        Count, Index, TileId, b, h, pid_m, stride_cb, stride_ch, stride_cr, stride_ib, stride_ih, stride_ir
    )

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, base 2
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s2 - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for j in range(0, n_total):
        kt = tl.load(index + j)
        cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        if EVEN_N:
            k = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None], mask=offs_d[:, None] < D, other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vn + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
        else:
            k = tl.load(
                k_base + cols[None, :] * stride_kn + offs_d[:, None],
                mask=(cols[None, :] < kv_len) & (offs_d[:, None] < D),
                other=0.0,
            )  # (BLOCK_D, BLOCK_N)
            v = tl.load(
                v_base + cols[:, None] * stride_vn + offs_dv[None, :],
                mask=(cols[:, None] < kv_len) & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (BLOCK_N, BLOCK_DV)
        s = _dot(q, k, EMULATE_BF16, PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        if not PLAIN:
            s, _t = _score_mods(
                s,
                rows[:, None],
                cols[None, :],
                b,
                h,
                softcap,
                Slopes,
                alibi_off,
                Bias,
                stride_bb,
                stride_bh,
                stride_bm,
                stride_bn,
                q_len,
                kv_len,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_BIAS,
            )
            s = s * 1.44269504  # 1/ln(2)
        if not EVEN_N:
            s = tl.where(cols[None, :] < kv_len, s, float("-inf"))
        if j < n_partial:
            ok = _allowed(
                rows[:, None],
                cols[None, :],
                b,
                lo_off,
                hi_off,
                prefix_off,
                prefix_n,
                QDoc,
                KDoc,
                stride_qdb,
                stride_kdb,
                KeyLen,
                Bitmap,
                tl.load(tile_ids + j),
                pid_m * BLOCK_M,
                kt * BLOCK_N,
                q_len,
                kv_len,
                BLOCK_M,
                WORDS,
                HAS_LO,
                HAS_HI,
                HAS_PREFIX,
                HAS_DOC,
                HAS_KEYLEN,
                HAS_BITMAP,
            )
            s = tl.where(ok, s, float("-inf"))
            # values no row of the tile may see weigh 0, but 0 * NaN is NaN: zero them (padding garbage)
            v = tl.where(_seen(ok, rows < q_len)[:, None], v, 0.0)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, V.dtype.element_ty, EMULATE_BF16, PRECISION)
    out, lse = _softmax_result(m_i, l_i, acc)
    tl.store(
        Out + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_dv[None, :],
        _round(out, Out.dtype.element_ty, EMULATE_BF16),
        mask=(rows[:, None] < q_len) & (offs_dv[None, :] < DV),
    )
    tl.store(Lse + b * stride_lb + h * stride_lh + rows, lse, mask=rows < q_len)


# ---------------------------------------------------------------------------------------------- backward


def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    Lse,
    Delta,
    Count,
    Index,
    TileId,
    Bitmap,
    Slopes,
    Bias,
    QDoc,
    KDoc,
    KeyLen,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_lb,
    stride_lh,
    stride_cb,
    stride_ch,
    stride_cr,
    stride_ib,
    stride_ih,
    stride_ir,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_qdb,
    stride_kdb,
    scale,
    softcap,
    alibi_off,
    lo_off,
    hi_off,
    prefix_off,
    prefix_n,
    q_len,
    kv_len,
    GROUP,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_KEYLEN: tl.constexpr,
    HAS_BITMAP: tl.constexpr,
    EVEN_N: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dq of one query tile of one head (grid ``(query tiles, Hq, B)``), same tile lists as the forward.

    ``p = exp(s - lse)``, ``ds = p * (dO v^T - delta)`` with ``delta = rowsum(dO * out)``, times the
    softcap's derivative ``1 - tanh^2``; ``dq = scale * ds @ k``.  ``DQ`` is float32 ``(B, Hq, Lq, D)``.
    """
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < q_len
    q = tl.load(
        Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )
    do = tl.load(
        DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_dom + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )
    lse = tl.load(Lse + b * stride_lb + h * stride_lh + rows, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.44269504  # empty rows: p = 0; 1/ln(2)
    delta = tl.load(Delta + b * stride_lb + h * stride_lh + rows, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh

    n_partial, n_total, index, tile_ids = _tile_list(
        Count, Index, TileId, b, h, pid_m, stride_cb, stride_ch, stride_cr, stride_ib, stride_ih, stride_ir
    )

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, n_total):
        kt = tl.load(index + j)
        cols = kt * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < kv_len
        k = tl.load(
            k_base + cols[:, None] * stride_kn + offs_d[None, :],
            mask=col_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        v = tl.load(
            v_base + cols[:, None] * stride_vn + offs_dv[None, :],
            mask=col_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BLOCK_N, BLOCK_DV)
        if j < n_partial:
            ok = _allowed(
                rows[:, None],
                cols[None, :],
                b,
                lo_off,
                hi_off,
                prefix_off,
                prefix_n,
                QDoc,
                KDoc,
                stride_qdb,
                stride_kdb,
                KeyLen,
                Bitmap,
                tl.load(tile_ids + j),
                pid_m * BLOCK_M,
                kt * BLOCK_N,
                q_len,
                kv_len,
                BLOCK_M,
                WORDS,
                HAS_LO,
                HAS_HI,
                HAS_PREFIX,
                HAS_DOC,
                HAS_KEYLEN,
                HAS_BITMAP,
            )
            # keys no row of the tile may see are zeroed first: their garbage (NaN, inf) would reach dq
            # through a zero weight (0 * NaN), also through the softcap's derivative
            seen = _seen(ok, row_ok)[:, None]
            k = tl.where(seen, k, 0.0)
            v = tl.where(seen, v, 0.0)
        else:
            ok = tl.full([BLOCK_M, BLOCK_N], 1, tl.int1)  # (unused on full tiles: both branches define it)
        s = _dot(q, tl.trans(k), EMULATE_BF16, PRECISION) * scale  # (BLOCK_M, BLOCK_N)
        s, t = _score_mods(
            s,
            rows[:, None],
            cols[None, :],
            b,
            h,
            softcap,
            Slopes,
            alibi_off,
            Bias,
            stride_bb,
            stride_bh,
            stride_bm,
            stride_bn,
            q_len,
            kv_len,
            HAS_SOFTCAP,
            HAS_ALIBI,
            HAS_BIAS,
        )
        s2 = s * 1.44269504  # 1/ln(2)
        if not EVEN_N:
            s2 = tl.where(col_ok[None, :], s2, float("-inf"))
        if j < n_partial:
            s2 = tl.where(ok, s2, float("-inf"))
        p = tl.exp2(s2 - lse2[:, None])
        dp = _dot(do, tl.trans(v), EMULATE_BF16, PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        acc += _dot(_round(ds, K.dtype.element_ty, EMULATE_BF16), k, EMULATE_BF16, PRECISION)
    tl.store(
        DQ + ((b * tl.num_programs(1) + h) * q_len + rows[:, None]) * D + offs_d[None, :],
        acc * scale,
        mask=row_ok[:, None] & (offs_d[None, :] < D),
    )


def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    DK,
    DV_,
    Lse,
    Delta,
    Count,
    Index,
    TileId,
    Bitmap,
    Slopes,
    Bias,
    QDoc,
    KDoc,
    KeyLen,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_lb,
    stride_lh,
    stride_cb,
    stride_ch,
    stride_cr,
    stride_ib,
    stride_ih,
    stride_ir,
    stride_bb,
    stride_bh,
    stride_bm,
    stride_bn,
    stride_qdb,
    stride_kdb,
    scale,
    softcap,
    alibi_off,
    lo_off,
    hi_off,
    prefix_off,
    prefix_n,
    q_len,
    kv_len,
    GROUP,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    HAS_DOC: tl.constexpr,
    HAS_KEYLEN: tl.constexpr,
    HAS_BITMAP: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """dk and dv of one key tile of one key/value head (grid ``(key tiles, Hkv, B)``).

    The GROUP query heads sharing the key/value head are summed here, one after the other, so grouped-query
    attention needs neither copies of k and v nor atomics.  The tile lists are the transposed ones: per key
    tile, the query tiles to visit.  Scores are formed transposed, ``(BLOCK_N keys, BLOCK_M queries)``.
    ``DK``/``DV_`` are float32 ``(B, Hkv, Lk, D|DV)``.
    """
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < kv_len
    k = tl.load(
        K + b * stride_kb + hk * stride_kh + cols[:, None] * stride_kn + offs_d[None, :],
        mask=col_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # (BLOCK_N, BLOCK_D)
    v = tl.load(
        V + b * stride_vb + hk * stride_vh + cols[:, None] * stride_vn + offs_dv[None, :],
        mask=col_ok[:, None] & (offs_dv[None, :] < DV),
        other=0.0,
    )  # (BLOCK_N, BLOCK_DV)
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        n_partial, n_total, index, tile_ids = _tile_list(
            Count, Index, TileId, b, h, pid_n, stride_cb, stride_ch, stride_cr, stride_ib, stride_ih, stride_ir
        )
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        for j in range(0, n_total):
            mt = tl.load(index + j)
            rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = rows < q_len
            q = tl.load(
                q_base + rows[:, None] * stride_qm + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < D),
                other=0.0,
            )  # (BLOCK_M, BLOCK_D)
            do = tl.load(
                do_base + rows[:, None] * stride_dom + offs_dv[None, :],
                mask=row_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0,
            )  # (BLOCK_M, BLOCK_DV)
            lse = tl.load(Lse + b * stride_lb + h * stride_lh + rows, mask=row_ok, other=float("inf"))
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse) * 1.44269504  # empty rows: p = 0
            delta = tl.load(Delta + b * stride_lb + h * stride_lh + rows, mask=row_ok, other=0.0)
            st = _dot(k, tl.trans(q), EMULATE_BF16, PRECISION) * scale  # (BLOCK_N, BLOCK_M)
            st, tt = _score_mods(
                st,
                rows[None, :],
                cols[:, None],
                b,
                h,
                softcap,
                Slopes,
                alibi_off,
                Bias,
                stride_bb,
                stride_bh,
                stride_bm,
                stride_bn,
                q_len,
                kv_len,
                HAS_SOFTCAP,
                HAS_ALIBI,
                HAS_BIAS,
            )
            s2 = st * 1.44269504  # 1/ln(2)
            s2 = tl.where(col_ok[:, None], s2, float("-inf"))
            if j < n_partial:
                ok = _allowed(
                    rows[None, :],
                    cols[:, None],
                    b,
                    lo_off,
                    hi_off,
                    prefix_off,
                    prefix_n,
                    QDoc,
                    KDoc,
                    stride_qdb,
                    stride_kdb,
                    KeyLen,
                    Bitmap,
                    tl.load(tile_ids + j),
                    mt * BLOCK_M,
                    pid_n * BLOCK_N,
                    q_len,
                    kv_len,
                    BLOCK_M,
                    WORDS,
                    HAS_LO,
                    HAS_HI,
                    HAS_PREFIX,
                    HAS_DOC,
                    HAS_KEYLEN,
                    HAS_BITMAP,
                )
                s2 = tl.where(ok, s2, float("-inf"))
            pt = tl.exp2(s2 - lse2[None, :])  # (BLOCK_N, BLOCK_M); padded query rows have lse2 = inf
            dv_acc += _dot(_round(pt, DO.dtype.element_ty, EMULATE_BF16), do, EMULATE_BF16, PRECISION)
            dpt = _dot(v, tl.trans(do), EMULATE_BF16, PRECISION)  # (BLOCK_N, BLOCK_M)
            dst = pt * (dpt - delta[None, :])
            if HAS_SOFTCAP:
                dst = dst * (1.0 - tt * tt)
            if j < n_partial:  # a hidden key's garbage (NaN dpt, NaN tanh) times its weight 0 must stay 0
                dst = tl.where(s2 == float("-inf"), 0.0, dst)
            dk_acc += _dot(_round(dst, Q.dtype.element_ty, EMULATE_BF16), q, EMULATE_BF16, PRECISION)
    base = (b * tl.num_programs(1) + hk) * kv_len + cols[:, None]
    tl.store(DK + base * D + offs_d[None, :], dk_acc * scale, mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DV_ + base * DV + offs_dv[None, :], dv_acc, mask=col_ok[:, None] & (offs_dv[None, :] < DV))


# ------------------------------------------------------------------------------------------ paged decode


def _paged_decode(
    Q,
    KPool,
    VPool,
    BlockTable,
    SeqLens,
    Out,
    PartOut,
    PartLse,
    Slopes,
    Bias,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_kh,
    stride_ks,
    stride_vp,
    stride_vh,
    stride_vs,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_bb,
    stride_bh,
    stride_bn,
    bias_len,
    scale,
    softcap,
    keys_per_split,
    page_size,
    GROUP,
    NUM_SPLITS,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ALIBI_AT_END: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query token per sequence against its paged keys, for all GROUP query heads of one key/value head.

    Grid ``(NUM_SPLITS, Hkv, B)``: split ``s`` covers keys ``[s * keys_per_split, (s + 1) * keys_per_split)``
    of the sequence, so a small batch still fills the GPU; the key/value blocks are read once per group.
    Key ``j`` of sequence ``b`` lives in page ``BlockTable[b, j // page_size]`` at slot ``j % page_size``.
    ``BLOCK_G`` >= 16 rows hold the group's query heads (``tl.dot`` needs 16 rows; the rest are masked).
    ``ALIBI_AT_END``: the query sits at position ``seq_len - 1`` (bottom-right), else at 0 (top-left).
    ``Bias[b, h, j]`` (``HAS_BIAS``) is added to the score of key ``j``; keys at or past ``bias_len`` get 0.
    With ``SPLIT`` the normalised partial outputs and their lse go to ``PartOut (B, Hq, S, DV)`` /
    ``PartLse (B, Hq, S)`` for :func:`_paged_combine`; without, the output is written directly.
    """
    split = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    heads = hk * GROUP + g
    g_ok = g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    )  # (BLOCK_G, BLOCK_D)
    seq_len = tl.load(SeqLens + b)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, seq_len)
    if HAS_ALIBI:
        slopes = tl.load(Slopes + heads, mask=g_ok, other=0.0)
        pos = seq_len - 1 if ALIBI_AT_END else 0
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < stop
        page = tl.load(BlockTable + b * stride_tb + keys // page_size, mask=key_ok, other=0).to(tl.int64)
        slot = keys % page_size
        k = tl.load(
            KPool + page[None, :] * stride_kp + hk * stride_kh + slot[None, :] * stride_ks + offs_d[:, None],
            mask=key_ok[None, :] & (offs_d[:, None] < D),
            other=0.0,
        )  # (BLOCK_D, BLOCK_N)
        v = tl.load(
            VPool + page[:, None] * stride_vp + hk * stride_vh + slot[:, None] * stride_vs + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < DV),
            other=0.0,
        )  # (BLOCK_N, BLOCK_DV)
        s = _dot(q, k, EMULATE_BF16, PRECISION) * scale  # (BLOCK_G, BLOCK_N)
        if HAS_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        if HAS_ALIBI:
            s = s - slopes[:, None] * tl.abs(pos - keys[None, :]).to(tl.float32)
        if HAS_BIAS:
            s = s + tl.load(
                Bias + b * stride_bb + heads[:, None] * stride_bh + keys[None, :] * stride_bn,
                mask=g_ok[:, None] & key_ok[None, :] & (keys[None, :] < bias_len),
                other=0.0,
            ).to(tl.float32)
        s = tl.where(key_ok[None, :], s * 1.44269504, float("-inf"))  # 1/ln(2)
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, VPool.dtype.element_ty, EMULATE_BF16, PRECISION)
    out, lse = _softmax_result(m_i, l_i, acc)
    if SPLIT:
        part = (b * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # (B, Hq, S) flattened
        tl.store(PartOut + part[:, None] * DV + offs_dv[None, :], out, mask=g_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(PartLse + part, lse, mask=g_ok)
    else:
        tl.store(
            Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
            _round(out, Out.dtype.element_ty, EMULATE_BF16),
            mask=g_ok[:, None] & (offs_dv[None, :] < DV),
        )


def _paged_combine(
    PartOut,
    PartLse,
    Out,
    stride_ob,
    stride_oh,
    NUM_SPLITS,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """Merge the splits of one (sequence, query head): ``out = sum_s exp(lse_s - lse) out_s`` (grid ``(Hq, B)``).

    Splits that saw no key have lse -inf and weigh nothing; a sequence with no keys at all gives 0.
    """
    h = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = b * tl.num_programs(0) + h
    lse = tl.load(PartLse + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # (BLOCK_S,)
    parts = tl.load(
        PartOut + (row * NUM_SPLITS + s[:, None]) * DV + offs_dv[None, :],
        mask=(s[:, None] < NUM_SPLITS) & (offs_dv[None, :] < DV),
        other=0.0,
    )  # (BLOCK_S, BLOCK_DV)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_dv,
        _round(out, Out.dtype.element_ty, EMULATE_BF16),
        mask=offs_dv < DV,
    )


# ------------------------------------------------------------------------------------------------- build

_FUNCTIONS = (
    "_dot",
    "_round",
    "_tanh",
    "_score_mods",
    "_allowed",
    "_seen",
    "_tile_list",
    "_softmax_step",
    "_softmax_result",
    "_attn_fwd",
    "_attn_bwd_dq",
    "_attn_bwd_dkdv",
    "_paged_decode",
    "_paged_combine",
)


def build() -> types.ModuleType:
    """A fresh copy of this module with every function above made a Triton kernel.

    Imports triton (the first import fixes its mode, see the module docstring) and decorates with the
    kind of function triton's own standard library was built as: ``InterpretedFunction`` under the
    interpreter, ``JITFunction`` for the GPU.  The copy's globals hold the decorated functions, so kernels
    find each other by name as Triton expects.  The returned module has ``INTERPRETED`` (bool).
    """
    import importlib.util

    import triton.language as language
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    interpreted = isinstance(language.zeros, InterpretedFunction)
    # this module was imported from a file, so it has a spec with a loader
    spec = cast("importlib.machinery.ModuleSpec", importlib.util.find_spec(__name__))
    module = importlib.util.module_from_spec(spec)
    cast("importlib.abc.Loader", spec.loader).exec_module(module)
    module.__dict__["tl"] = language
    wrap = InterpretedFunction if interpreted else JITFunction
    for name in _FUNCTIONS:
        setattr(module, name, wrap(getattr(module, name)))
    module.__dict__["INTERPRETED"] = interpreted
    return module

"""Attention modules, position encodings, transformer blocks and models, batch-first ``(B, L, d_model)``.

* Attention: :class:`MultiHeadAttention` (self, grouped-query, cross, cached; ``from_torch``),
  :class:`SingleHeadAttention` (the articles' one head), :class:`AdditiveAttention` (Bahdanau),
  :class:`AxialAttention` (grids), :class:`LatentAttention` (multi-head latent attention, DeepSeek-V2/V3:
  caches hold a small latent per token), :class:`DeepSeekSparseAttention` (DSA, DeepSeek-V3.2: a lightning
  indexer picks each query's top-k keys; :class:`IndexerConfig`, :func:`indexer_loss`), :class:`MoBAAttention` (mixture of block attention, Kimi: each query
  attends to the key blocks whose mean key matches it best), :class:`NSAAttention` (native sparse attention,
  DeepSeek: compressed, selected and sliding-window branches mixed by learned gates).
* Positions: :class:`RotaryEmbedding`, :class:`ALiBi`, :class:`T5RelativeBias`, :class:`SinusoidalPositions`.
* Blocks and models: :class:`TransformerBlock`, :class:`Encoder`, :class:`Decoder`, :class:`DecoderLM`
  (:class:`DecoderConfig`), :class:`EncoderDecoder`.
* Configuration objects: :class:`AttentionConfig` (a :class:`MultiHeadAttention`) and :class:`BlockConfig` (a
  :class:`TransformerBlock`), which ``from_config`` builds from; a :class:`DecoderConfig` makes them once for its
  layers (:meth:`DecoderConfig.block_config`).
* Layers: :class:`Linear` (CPU decoding kernels picked by weight layout and batch, and for 1-3 rows by timing
  them on this machine: :func:`decode_products`), :class:`RMSNorm`, :class:`FeedForward`.
* Generated training tasks: :mod:`attnkit.nn.tasks` (copying, associative recall).

Every attention score in this package is computed by one method, ``_attend`` (see
:class:`MultiHeadAttention`), which calls :func:`attnkit.attention`.

Example::

    >>> import torch
    >>> from attnkit.nn import DecoderConfig, DecoderLM
    >>> model = DecoderLM(DecoderConfig.preset("tiny", positions="alibi", n_kv_heads=1))
    >>> model(torch.randint(0, 256, (1, 8))).shape
    torch.Size([1, 8, 256])
"""

from . import tasks
from .attention import AttentionConfig, MultiHeadAttention
from .axial import AxialAttention
from .blocks import BlockConfig, Decoder, Encoder, TransformerBlock, default_d_ff
from .dsa import DeepSeekSparseAttention, IndexerConfig, LightningIndexer, indexer_loss, selected_attention, top_k_keys
from .latent import LatentAttention
from ._products import decode_products
from .layers import FeedForward, Linear, RMSNorm, linear, to_decode_layout
from .moba import MoBAAttention
from .nsa import NSAAttention
from .models import DecoderConfig, DecoderLM, EncoderDecoder
from .positions import ALiBi, PositionEncoding, RotaryEmbedding, SinusoidalPositions, T5RelativeBias
from .simple import AdditiveAttention, SingleHeadAttention

__all__ = [
    "MultiHeadAttention",
    "SingleHeadAttention",
    "AdditiveAttention",
    "AxialAttention",
    "LatentAttention",
    "DeepSeekSparseAttention",
    "IndexerConfig",
    "LightningIndexer",
    "indexer_loss",
    "selected_attention",
    "top_k_keys",
    "MoBAAttention",
    "NSAAttention",
    "RotaryEmbedding",
    "ALiBi",
    "T5RelativeBias",
    "SinusoidalPositions",
    "PositionEncoding",
    "TransformerBlock",
    "AttentionConfig",
    "BlockConfig",
    "Encoder",
    "Decoder",
    "DecoderConfig",
    "DecoderLM",
    "EncoderDecoder",
    "Linear",
    "linear",
    "RMSNorm",
    "FeedForward",
    "to_decode_layout",
    "decode_products",
    "default_d_ff",
    "tasks",
]

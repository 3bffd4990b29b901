"""Attention modules, position encodings, transformer blocks and models, batch-first ``(B, L, d_model)``.

* Attention: :class:`MultiHeadAttention` (self, grouped-query, cross, cached; ``from_torch``),
  :class:`SingleHeadAttention` (the articles' one head), :class:`AdditiveAttention` (Bahdanau),
  :class:`AxialAttention` (grids), :class:`LatentAttention` (multi-head latent attention, DeepSeek-V2/V3:
  caches hold a small latent per token; :class:`LatentConfig`), :class:`DeepSeekSparseAttention` (DSA, DeepSeek-V3.2: a lightning
  indexer picks each query's top-k keys; :class:`IndexerConfig`, :func:`indexer_loss`), :class:`MoBAAttention` (mixture of block attention, Kimi: each query
  attends to the key blocks whose mean key matches it best), :class:`NSAAttention` (native sparse attention,
  DeepSeek: compressed, selected and sliding-window branches mixed by learned gates).
* Positions: :class:`RotaryEmbedding` (scaled by a :class:`RopeScaling`: :class:`LinearScaling`, :class:`NTKScaling`,
  :class:`Llama3Scaling`, :class:`YaRNScaling`, :class:`LongRoPEScaling`, :class:`DynamicNTKScaling`, each with
  ``from_hf(dict)``), :class:`ALiBi`, :class:`T5RelativeBias`, :class:`SinusoidalPositions`.
* Blocks and models: :class:`TransformerBlock`, :class:`Encoder`, :class:`Decoder`, :class:`DecoderLM`
  (:class:`DecoderConfig`), :class:`EncoderDecoder`.
* Configuration objects: :class:`AttentionConfig` (a :class:`MultiHeadAttention`) and :class:`BlockConfig` (a
  :class:`TransformerBlock`), which the modules are built from (``MultiHeadAttention(config)``); a
  :class:`DecoderConfig` makes them once for its layers (:meth:`DecoderConfig.block_config`).
* Layers: :class:`Linear` (CPU decoding kernels picked by weight layout and batch, and for 1-3 rows by timing
  them on this machine, kept per machine between processes: :func:`decode_products`,
  :func:`clear_decode_choices`), :class:`RMSNorm`, :class:`FeedForward`.
* Generated training tasks: :mod:`attnkit.nn.tasks` (copying, associative recall).

Every attention score in this package is computed by one private method per module, which calls
:func:`attnkit.attention`.  ``module.register_attention_hook(hook)`` (on every attention module here) observes
or replaces that computation: ``hook(module, call, compute)`` gets an :class:`AttentionCall` (``q``, ``k``,
``v``, mask, bias, scale, softcap, dropout_p, sinks) and ``compute``, the computation it stands for, and
returns the output; the handle it returns removes it (the doctor's probe, distillation's capture and ring
attention's ``ring_context`` are such hooks).

Example::

    >>> import torch
    >>> from attnkit.nn import DecoderConfig, DecoderLM
    >>> model = DecoderLM(DecoderConfig.preset("tiny", positions="alibi", n_kv_heads=1))
    >>> model(torch.randint(0, 256, (1, 8))).shape
    torch.Size([1, 8, 256])
"""

from . import tasks
from ._hooks import AttentionCall, AttentionHook
from .attention import AttentionConfig, MultiHeadAttention
from .axial import AxialAttention
from .blocks import BlockConfig, Decoder, Encoder, TransformerBlock, default_d_ff
from .dsa import DeepSeekSparseAttention, IndexerConfig, LightningIndexer, indexer_loss, selected_attention, top_k_keys
from .latent import LatentAttention, LatentConfig
from ._products import DecodeProducts, clear_decode_choices, decode_products
from .layers import FeedForward, Linear, RMSNorm, decode_layout, linear, to_decode_layout
from .moba import MoBAAttention
from .nsa import NSAAttention
from .models import DecoderConfig, DecoderLM, EncoderDecoder
from .positions import ALiBi, PositionEncoding, RotaryEmbedding, SinusoidalPositions, T5RelativeBias
from .rope_scaling import (
    DynamicNTKScaling,
    LinearScaling,
    Llama3Scaling,
    LongRoPEScaling,
    NTKScaling,
    RopeScaling,
    YaRNScaling,
)
from .simple import AdditiveAttention, SingleHeadAttention

__all__ = [
    "MultiHeadAttention",
    "AttentionCall",
    "AttentionHook",
    "SingleHeadAttention",
    "AdditiveAttention",
    "AxialAttention",
    "LatentAttention",
    "LatentConfig",
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
    "RopeScaling",
    "LinearScaling",
    "NTKScaling",
    "Llama3Scaling",
    "YaRNScaling",
    "LongRoPEScaling",
    "DynamicNTKScaling",
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
    "decode_layout",
    "DecodeProducts",
    "decode_products",
    "clear_decode_choices",
    "default_d_ff",
    "tasks",
]

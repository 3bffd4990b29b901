"""DecoderLM against Hugging Face LlamaForCausalLM (sdpa) and x-transformers of the same size.

The "llama-like" preset (hidden 512, 8 layers, 8 heads, intermediate 1408, vocab 32000, untied), random
weights, float32, built from configs.  Measured interleaved in one process, the order reversed every other
round (medians):

* forward tokens/s (inference mode) and forward+backward tokens/s (cross-entropy loss) of a batch;
* decoding: milliseconds per one-token forward against a KV cache after a prompt (the prompt is not timed)
  (attnkit.cache.StaticCache for DecoderLM, HF's DynamicCache for Llama), and the same DecoderLM with its
  weights laid out column-major (``to_decode_layout(model, batch_size=8)``, the layout for batches) to show
  what the default row-major layout buys at one sequence.

    python benchmarks/model.py            # B=4, L=256; prompt 128 + 32 decoded tokens
    python benchmarks/model.py --quick    # B=1, L=128; prompt 32 + 8 tokens
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table

from attnkit.cache import StaticCache
from attnkit.nn import DecoderConfig, DecoderLM, to_decode_layout


def build_attnkit(cfg: DecoderConfig) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(cfg)


def build_hf(cfg: DecoderConfig):
    import transformers

    hc = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(hc, attn_implementation="sdpa")


def build_xt(cfg: DecoderConfig):
    from x_transformers import Decoder, TransformerWrapper

    torch.manual_seed(0)
    return TransformerWrapper(
        num_tokens=cfg.vocab_size,
        max_seq_len=cfg.max_seq_len,
        use_abs_pos_emb=False,
        tie_embedding=cfg.tie_embeddings,
        attn_layers=Decoder(
            dim=cfg.d_model,
            depth=cfg.n_layers,
            heads=cfg.n_heads,
            attn_dim_head=cfg.head_dim,
            rotary_pos_emb=True,
            attn_flash=True,
            use_rmsnorm=True,
            ff_glu=True,
            ff_swish=True,
            ff_mult=cfg.ff_dim / cfg.d_model,
            ff_no_bias=True,
        ),
    )


def logits_of(name: str, model, ids):
    out = model(ids)
    return out.logits if name == "HF Llama (sdpa)" else out


def column_major(model: DecoderLM) -> DecoderLM:
    """The same model with its weights laid out for batched decoding (the ablation)."""
    return to_decode_layout(copy.deepcopy(model), batch_size=8)


def decode_fns(models: dict, prompt: torch.Tensor, n_new: int) -> dict:
    """Functions that run a prompt forward, then ``n_new`` one-token forwards against the model's KV cache,
    and return the seconds of the one-token forwards (the prompt is not timed)."""
    fns = {}
    B, P = prompt.shape

    def ours(model):
        def run():
            cache = StaticCache.for_model(model, batch_size=B, max_len=P + n_new)
            with torch.inference_mode():
                tok = model(prompt, cache=cache)[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(n_new):
                    tok = model(tok, cache=cache)[:, -1:].argmax(-1)
                return time.perf_counter() - start

        return run

    def hf(model):
        def run():
            with torch.inference_mode():
                out = model(prompt, use_cache=True)
                past, tok = out.cache, out.logits[:, -1:].argmax(-1)
                start = time.perf_counter()
                for _ in range(n_new):
                    out = model(tok, cache=past, use_cache=True)  # transformers 5.2x: cache= (was past_key_values)
                    past, tok = out.cache, out.logits[:, -1:].argmax(-1)
                return time.perf_counter() - start

        return run

    for name, model in models.items():
        fns[name] = hf(model) if name.startswith("HF") else ours(model)
    return fns


def median_times(fns: dict, repeat: int, *, timed_inside: bool = False) -> dict:
    """Median seconds of each function after one warm-up each, run round-robin with the order reversed every
    other round (whoever runs first after another model pays for cold caches equally).  With
    ``timed_inside`` the functions return their own seconds."""
    for fn in fns.values():
        fn()
    runs = {name: [] for name in fns}
    for i in range(repeat):
        for name in list(fns) if i % 2 == 0 else list(reversed(fns)):
            start = time.perf_counter()
            inside = fns[name]()
            runs[name].append(inside if timed_inside else time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in runs.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small batch, median of 2")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    B, L, P, N = (1, 128, 32, 8) if args.quick else (4, 256, 128, 32)
    repeat = args.repeat or (2 if args.quick else 7)
    cfg = DecoderConfig.preset("llama-like")
    models = {"attnkit DecoderLM": build_attnkit(cfg)}
    for name, build in (("HF Llama (sdpa)", build_hf), ("x-transformers", build_xt)):
        try:
            models[name] = build(cfg)
        except ImportError as e:  # the bench extra is not installed: a skipped column
            print(f"note: {name} not available ({e}); skipped (pip install 'attnkit[bench]')")
    for m in models.values():
        m.eval()
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    ids = torch.randint(0, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = logits_of("attnkit DecoderLM", models["attnkit DecoderLM"], ids[:, :8])
        for n, m in models.items():
            assert logits_of(n, m, ids[:, :8]).shape == ref.shape, n

    def fwd(name, model):
        def run():
            with torch.inference_mode():
                logits_of(name, model, ids)

        return run

    def train(name, model):
        def run():
            model.zero_grad(set_to_none=True)
            logits = logits_of(name, model, ids)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

        return run

    print(
        f"model.py: llama-like ({params['attnkit DecoderLM'] / 1e6:.1f}M parameters), float32, "
        f"B={B}, L={L}; {machine()}"
    )
    t_fwd = median_times({n: fwd(n, m) for n, m in models.items()}, repeat)
    t_train = median_times({n: train(n, m) for n, m in models.items()}, repeat)
    hf = "HF Llama (sdpa)"
    dec_models = {
        "attnkit DecoderLM": models["attnkit DecoderLM"],
        "attnkit DecoderLM, column-major weights": column_major(models["attnkit DecoderLM"]),
        **({hf: models[hf]} if hf in models else {}),
    }
    prompt = ids[:1, :P]
    t_dec = median_times(decode_fns(dec_models, prompt, N), repeat, timed_inside=True)

    def vs_hf(t, n):
        return f"{t[hf] / t[n]:.2f}x" if hf in t else "- (no HF)"

    rows = []
    for n in models:
        rows.append(
            {
                "model": n,
                "params (M)": f"{params[n] / 1e6:.1f}",
                "forward tok/s": f"{B * L / t_fwd[n]:,.0f}",
                "fwd vs HF": vs_hf(t_fwd, n),
                "fwd+bwd tok/s": f"{B * L / t_train[n]:,.0f}",
                "fwd+bwd vs HF": vs_hf(t_train, n),
            }
        )
    print(table(rows, list(rows[0])))
    drows = [
        {"decoding (B=1)": n, "ms / token": f"{t_dec[n] / N * 1e3:.2f}", "vs HF": vs_hf(t_dec, n)} for n in dec_models
    ]
    print(f"\ndecoding: after a {P}-token prompt, {N} one-token forwards with a KV cache (prompt not timed)")
    print(table(drows, list(drows[0])))
    path = save(
        "model_quick" if args.quick else "model",
        {
            "config": "llama-like",
            "batch": B,
            "length": L,
            "prompt": P,
            "new_tokens": N,
            "params": params,
            "forward_s": t_fwd,
            "train_s": t_train,
            "decode_s": t_dec,
        },
        out=args.out,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

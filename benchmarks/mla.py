"""Multi-head latent attention: KV cache bytes and decode speed against HF's DeepseekV3.

A DeepSeek-V3-shaped model with dense layers (random weights, float32) built as HF ``DeepseekV3ForCausalLM``
and converted with ``from_hf`` (the same weights).  Reports

* KV cache bytes per token: attnkit's latent cache (``kv_lora_rank + qk_rope_head_dim`` per layer) against the
  same model with ordinary multi-head attention (per-head keys ``qk_nope + qk_rope`` and values ``v_head_dim``),
  both read off allocated :class:`attnkit.cache.StaticCache` s;
* greedy decode tokens/s of ``attnkit.generate`` (static cache, absorbed latent attention) against HF's
  ``generate`` at batch 1 and 8, medians of interleaved runs in one process, and whether the tokens agree.

    python benchmarks/mla.py            # full run
    python benchmarks/mla.py --quick    # small sizes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table, timeit

import attnkit
from attnkit.cache import StaticCache
from attnkit.integrations.hf import from_hf


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.quick:
        dims = dict(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            q_lora_rank=128,
            kv_lora_rank=64,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            intermediate_size=512,
        )
        prompt, new, repeat = 32, 16, 3
    else:  # DeepSeek-V3's proportions (heads of 128 + 64, latent 512, 128 heads) at a quarter of the head width
        dims = dict(
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=16,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
            intermediate_size=1408,
        )
        prompt, new, repeat = 64, 32, 3
    heads = dims["num_attention_heads"]
    cfg = transformers.DeepseekV3Config(
        vocab_size=4096,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        first_k_dense_replace=dims["num_hidden_layers"],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **dims,
    )
    torch.manual_seed(0)
    hf_model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    hf_model.generation_config.eos_token_id = None
    model = from_hf(hf_model)
    layers, tokens = dims["num_hidden_layers"], prompt + new

    latent = StaticCache.for_model(model, 1, tokens).nbytes() / tokens / layers
    mha = (
        StaticCache(
            layers,
            tokens,
            batch_size=1,
            n_kv_heads=heads,
            d_head=dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"],
            d_value=dims["v_head_dim"],
            dtype=torch.float32,
        ).nbytes()
        / tokens
        / layers
    )
    memory = [
        {
            "cache": "latent (attnkit MLA)",
            "bytes/token/layer": int(latent),
            "formula": f"({dims['kv_lora_rank']} + {dims['qk_rope_head_dim']}) x 4",
        },
        {
            "cache": "ordinary multi-head",
            "bytes/token/layer": int(mha),
            "formula": f"{heads} x ({dims['qk_nope_head_dim']} + {dims['qk_rope_head_dim']} + "
            f"{dims['v_head_dim']}) x 4",
        },
        {"cache": "ratio", "bytes/token/layer": f"{mha / latent:.1f}x smaller", "formula": ""},
    ]

    g = torch.Generator().manual_seed(1)
    rows = []
    for batch in (1, 8):
        ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=g)
        want = hf_model.generate(ids, max_new_tokens=new, do_sample=False)[:, prompt:].tolist()
        got = attnkit.generate(model, ids.tolist(), new)
        same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y)) / (batch * new)

        def hf_run(ids=ids):
            hf_model.generate(ids, max_new_tokens=new, do_sample=False)

        def ours(ids=ids):
            attnkit.generate(model, ids.tolist(), new)

        t = timeit({"hf": hf_run, "attnkit": ours}, repeat=repeat, budget_s=120)
        rows.append(
            {
                "batch": batch,
                "attnkit tokens/s": f"{batch * new / t['attnkit']:.1f}",
                "HF tokens/s": f"{batch * new / t['hf']:.1f}",
                "vs HF": f"{t['hf'] / t['attnkit']:.2f}x",
                "same tokens as HF": f"{same:.0%}",
            }
        )
    print(
        f"MLA (DeepseekV3 dense: hidden {dims['hidden_size']}, {layers} layers, {heads} heads, kv_lora_rank "
        f"{dims['kv_lora_rank']}, q_lora_rank {dims['q_lora_rank']}, rope {dims['qk_rope_head_dim']}, nope "
        f"{dims['qk_nope_head_dim']}, v {dims['v_head_dim']}), float32, {machine()}"
    )
    print(table(memory, ["cache", "bytes/token/layer", "formula"]))
    print(
        f"greedy decode, {prompt}-token prompts, {new} new tokens (prefill included), HF attn_implementation="
        f"{hf_model.config._attn_implementation!r}"
    )
    print(table(rows, list(rows[0])))
    print(
        "saved",
        save("mla_quick" if args.quick else "mla", {"memory": memory, "decode": rows, "dims": dims}, out=args.out),
    )


if __name__ == "__main__":
    main()

"""The model families from_hf converts, against Hugging Face running the same weights.

For each family a random-weight model built from a config (float32), converted with
``attnkit.integrations.hf.from_hf``: median seconds of a forward (batch, length) and of a greedy decode
(``attnkit.generate`` with its static cache against HF's ``generate``, batch 1), measured interleaved in one
process, with the ratio HF / attnkit (above 1: attnkit is faster), the largest logit difference and whether
the greedy tokens agree.

    python benchmarks/hf_families.py            # full run
    python benchmarks/hf_families.py --quick    # small sizes
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
from attnkit.integrations.hf import from_hf


def configs(width: int, layers: int, vocab: int) -> dict:
    heads = width // 64
    common = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=4096,
    )
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    pairs = 32  # rotated pairs of a 64-wide head
    return {
        "qwen3": transformers.Qwen3Config(**common),
        "gemma3": transformers.Gemma3TextConfig(**common, head_dim=64, sliding_window=128, layer_types=types),
        "phi3 (longrope)": transformers.Phi3Config(
            **common,
            original_max_position_embeddings=1024,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * pairs,
                "long_factor": [1.0 + 0.1 * i for i in range(pairs)],
            },
        ),
        "olmo2": transformers.Olmo2Config(**common),
        "smollm3": transformers.SmolLM3Config(**common, no_rope_layers=[int(i % 4 != 3) for i in range(layers)]),
        "granite": transformers.GraniteConfig(
            **common,
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
        ),
        "deepseek-v3 (dense, MLA)": transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": heads},
            q_lora_rank=width // 2,
            kv_lora_rank=width // 4,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
            first_k_dense_replace=layers,
        ),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    width, layers, vocab = (128, 2, 256) if args.quick else (256, 4, 1000)
    batch, length, prompt, new = (2, 64, 16, 8) if args.quick else (4, 256, 32, 32)
    repeat = 3 if args.quick else 5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    prompt_ids = ids[:1, :prompt]
    rows = []
    for name, cfg in configs(width, layers, vocab).items():
        torch.manual_seed(0)
        hf_model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        hf_model.generation_config.eos_token_id = None
        model = from_hf(hf_model)
        with torch.no_grad():
            err = float((model(ids) - hf_model(ids).logits).abs().max())
        hf_tokens = hf_model.generate(prompt_ids, max_new_tokens=new, do_sample=False)[0, prompt:].tolist()
        ours = attnkit.generate(model, prompt_ids.tolist(), new)[0]

        def fwd_hf():
            with torch.no_grad():
                hf_model(ids)

        def fwd_ours():
            with torch.no_grad():
                model(ids)

        def gen_hf():
            hf_model.generate(prompt_ids, max_new_tokens=new, do_sample=False)

        def gen_ours():
            attnkit.generate(model, prompt_ids.tolist(), new)

        t_fwd = timeit({"hf": fwd_hf, "attnkit": fwd_ours}, repeat=repeat, budget_s=40)
        t_gen = timeit({"hf": gen_hf, "attnkit": gen_ours}, repeat=repeat, budget_s=40)
        rows.append(
            {
                "family": name,
                "forward attnkit s": f"{t_fwd['attnkit']:.4f}",
                "forward HF s": f"{t_fwd['hf']:.4f}",
                "forward HF/attnkit": f"{t_fwd['hf'] / t_fwd['attnkit']:.2f}x",
                f"decode {new} attnkit s": f"{t_gen['attnkit']:.4f}",
                f"decode {new} HF s": f"{t_gen['hf']:.4f}",
                "decode HF/attnkit": f"{t_gen['hf'] / t_gen['attnkit']:.2f}x",
                "max_err": f"{err:.1e}",
                "same_tokens": ours == hf_tokens,
            }
        )
    cols = list(rows[0])
    print(
        f"from_hf families (width {width}, {layers} layers; forward batch {batch} x {length}; decode batch 1, "
        f"{prompt}-token prompt, {new} new), float32, HF attn_implementation='sdpa', {machine()}"
    )
    print(table(rows, cols))
    print(
        "saved",
        save(
            "hf_families_quick" if args.quick else "hf_families",
            {"rows": rows, "width": width, "layers": layers, "batch": batch, "length": length},
            out=args.out,
        ),
    )


if __name__ == "__main__":
    main()

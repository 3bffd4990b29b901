"""Hugging Face models with attn_implementation="attnkit" against HF's own "sdpa" and "eager".

Random-weight Llama (full causal) and Mistral (sliding window) models built from configs, float32, a batch
with left padding; median seconds of a forward, a forward+backward and a greedy generate, measured
interleaved in one process, with ratios to sdpa.  Also checks that every implementation gives the same
logits (at real tokens) and the same greedy tokens.

    python benchmarks/hf_models.py            # full run
    python benchmarks/hf_models.py --quick    # small sizes
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import transformers
except ImportError:  # the subject of this benchmark, not a peer: nothing to measure without it
    print(
        "benchmarks/hf_models.py: skipped, it measures Hugging Face models and transformers is not installed "
        "(pip install 'attnkit[bench]')"
    )
    sys.exit(0)

sys.path.insert(0, str(Path(__file__).parent))
from _common import OUT_HELP, machine, save, table, timeit

from attnkit.integrations import hf

IMPLS = ("eager", "sdpa", "attnkit")


def build(kind: str, width: int, layers: int, vocab: int):
    common = dict(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 256),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    cfg = (
        transformers.LlamaConfig(**common)
        if kind == "llama"
        else transformers.MistralConfig(**common, sliding_window=256)
    )
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    hf.register()
    width, layers, vocab = (128, 2, 256) if args.quick else (256, 4, 1000)
    batch, length, new = (2, 128, 8) if args.quick else (4, 512, 16)
    repeat = 2 if args.quick else 5
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    am = torch.ones_like(ids)
    for b in range(batch):
        am[b, : (b * length) // (2 * batch)] = 0  # left padding: 0, 1/8, 2/8, ... of each row
    ids = ids.masked_fill(am == 0, 0)
    labels = ids.masked_fill(am == 0, -100)
    rows = []
    for kind in ("llama", "mistral"):
        model = build(kind, width, layers, vocab)
        logits, tokens = {}, {}
        for impl in IMPLS:
            model.set_attn_implementation(impl)
            with torch.no_grad():
                logits[impl] = model(ids, attention_mask=am).logits
            tokens[impl] = model.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0)
        real = am.bool()
        err = {i: float((logits[i] - logits["eager"])[real].abs().max()) for i in IMPLS}
        same = {i: bool(torch.equal(tokens[i], tokens["eager"])) for i in IMPLS}

        def with_impl(impl, fn):
            def run():
                model.set_attn_implementation(impl)
                return fn()

            return run

        def forward():
            with torch.no_grad():
                model(ids, attention_mask=am)

        def train_step():
            model.zero_grad()
            model(ids, attention_mask=am, labels=labels).loss.backward()

        def generate():
            model.generate(ids, attention_mask=am, max_new_tokens=new, do_sample=False, pad_token_id=0)

        for mode, fn in (("forward", forward), ("fwd+bwd", train_step), (f"generate {new}", generate)):
            t = timeit({i: with_impl(i, fn) for i in IMPLS}, repeat=repeat, budget_s=60)
            for impl in IMPLS:
                rows.append(
                    {
                        "model": kind,
                        "mode": mode,
                        "impl": impl,
                        "median_s": f"{t[impl]:.4f}",
                        "vs_sdpa": f"{t[impl] / t['sdpa']:.2f}x",
                        "max_err": f"{err[impl]:.1e}",
                        "same_tokens": same[impl],
                    }
                )
    cols = ["model", "mode", "impl", "median_s", "vs_sdpa", "max_err", "same_tokens"]
    print(
        f"HF models (width {width}, {layers} layers, batch {batch}, length {length}, left padding), float32, "
        f"{machine()}"
    )
    print(table(rows, cols))
    print(
        "saved",
        save(
            "hf_models_quick" if args.quick else "hf_models",
            {"rows": rows, "width": width, "layers": layers, "batch": batch, "length": length},
            out=args.out,
        ),
    )


if __name__ == "__main__":
    main()

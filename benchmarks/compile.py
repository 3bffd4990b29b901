"""attnkit inside ``torch.compile``: compiled against eager time, FlexAttention, compile times.

float32, 1 thread by default, interleaved repeats (medians) in one process:

* ``attention()`` with ``masks.sliding_window(256)`` (B=1, H=4, D=64), L = 4096 and 16384, forward and
  forward+backward: eager against ``torch.compile(fullgraph=True)`` (Inductor), target ratio <= 1.1;
* a ``DecoderLM`` training step (llama-like: d_model 512, 4 layers, 8 heads on 2 key/value heads, SwiGLU,
  RoPE; L = 2048, sliding window 512, batch 1; forward, cross-entropy, backward, AdamW step): compiled against
  eager, target: at least as fast.  FlexAttention has no CPU backward, so its row says so;
* the forward against compiled FlexAttention (same mask, its BlockMask built once) at L = 4096 and 16384,
  with both compile times;
* ``generate(compile=True)``: the time of the first call (which compiles) and of a second one.

    python benchmarks/compile.py            # the sizes above (some minutes: each size compiles)
    python benchmarks/compile.py --quick    # L = 1024, a 1-layer model at L = 256, no generate (not saved)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM
from _common import OUT_HELP, machine, save, table, timeit

B, H, D = 1, 4, 64
WINDOW = 256


def _first_call_s(fn) -> float:
    """Seconds of the first call (for a compiled function: the compile)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def attention_rows(lengths: list[int], repeat: int) -> list[dict]:
    """Eager against compiled ``attention()`` with a sliding window, forward and forward+backward."""
    mask = masks.sliding_window(WINDOW)
    rows = []
    for L in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_() for _ in range(3))
        dout = torch.randn(B, H, L, D, generator=g)

        def fwd(q, k, v):
            return attnkit.attention(q, k, v, mask=mask)

        torch._dynamo.reset()
        compiled = torch.compile(fwd, fullgraph=True)
        passes = {
            "forward": lambda f: lambda: _no_grad(f, q, k, v),
            "forward+backward": lambda f: lambda: torch.autograd.grad(f(q, k, v), (q, k, v), dout),
        }
        for name, make in passes.items():
            compile_s = _first_call_s(make(compiled))
            t = timeit({"eager": make(fwd), "compiled": make(compiled)}, repeat=repeat, budget_s=120.0)
            rows.append(
                {
                    "pass": name,
                    "L": L,
                    "eager (ms)": f"{t['eager'] * 1e3:.1f}",
                    "compiled (ms)": f"{t['compiled'] * 1e3:.1f}",
                    "compiled / eager": f"{t['compiled'] / t['eager']:.2f}",
                    "compile (s)": f"{compile_s:.1f}",
                }
            )
            print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def _no_grad(f, *args):
    with torch.no_grad():
        return f(*args)


def training_rows(L: int, n_layers: int, repeat: int) -> list[dict]:
    """A DecoderLM training step, eager against compiled; FlexAttention cannot run it on CPU."""
    torch.manual_seed(0)
    cfg = DecoderConfig.preset(
        "llama-like", vocab_size=8192, n_layers=n_layers, n_kv_heads=2, max_seq_len=L, mask=masks.sliding_window(511)
    )
    models = {"eager": DecoderLM(cfg), "compiled": DecoderLM(cfg)}
    models["compiled"].load_state_dict(models["eager"].state_dict())
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    ids = torch.randint(0, cfg.vocab_size, (1, L + 1), generator=torch.Generator().manual_seed(1))

    def loss_of(model, x, y):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

    torch._dynamo.reset()
    compiled_loss = torch.compile(loss_of, fullgraph=True)

    def step(name):
        def run():
            f = compiled_loss if name == "compiled" else loss_of
            loss = f(models[name], ids[:, :-1], ids[:, 1:])
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)

        return run

    compile_s = _first_call_s(step("compiled"))
    t = timeit({"eager": step("eager"), "compiled": step("compiled")}, repeat=repeat, budget_s=240.0)
    return [
        {
            "step": f"DecoderLM train step, L={L}, window 512, {n_layers} layers",
            "eager (ms)": f"{t['eager'] * 1e3:.0f}",
            "compiled (ms)": f"{t['compiled'] * 1e3:.0f}",
            "compiled / eager": f"{t['compiled'] / t['eager']:.2f}",
            "compile (s)": f"{compile_s:.1f}",
            "FlexAttention": "impossible on CPU: flex_attention has no CPU backward",
        }
    ]


def flex_rows(lengths: list[int], repeat: int) -> list[dict]:
    """Forward: attnkit (eager and compiled) against compiled FlexAttention, with compile times."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = masks.sliding_window(WINDOW)

    def window_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

    rows = []
    for L in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
        torch._dynamo.reset()
        t0 = time.perf_counter()
        block_mask = create_block_mask(window_mod, None, None, L, L, device="cpu")
        block_mask_s = time.perf_counter() - t0
        flex = torch.compile(flex_attention, dynamic=False)
        ours = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, mask=mask), fullgraph=True)
        with torch.no_grad():
            flex_s = _first_call_s(lambda: flex(q, k, v, block_mask=block_mask))
            ours_s = _first_call_s(lambda: ours(q, k, v))
            err = float((flex(q, k, v, block_mask=block_mask) - attnkit.attention(q, k, v, mask=mask)).abs().max())
            t = timeit(
                {
                    "attnkit": lambda: attnkit.attention(q, k, v, mask=mask),
                    "attnkit compiled": lambda: ours(q, k, v),
                    "flex compiled": lambda: flex(q, k, v, block_mask=block_mask),
                },
                repeat=repeat,
                budget_s=120.0,
            )
        rows.append(
            {
                "L": L,
                "attnkit (ms)": f"{t['attnkit'] * 1e3:.1f}",
                "attnkit compiled (ms)": f"{t['attnkit compiled'] * 1e3:.1f}",
                "flex compiled (ms)": f"{t['flex compiled'] * 1e3:.1f}",
                "flex / attnkit compiled": f"{t['flex compiled'] / t['attnkit compiled']:.2f}",
                "attnkit compile (s)": f"{ours_s:.1f}",
                "flex compile (s)": f"{flex_s:.1f}",
                "flex block mask (s)": f"{block_mask_s:.2f}",
                "max |diff|": f"{err:.1e}",
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def generate_rows(new_tokens: int) -> list[dict]:
    """generate(compile=True) on a small model: the first call compiles, the second reuses the code."""
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("small", vocab_size=1024, max_seq_len=512)).eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]]
    torch._dynamo.reset()
    first = _first_call_s(lambda: attnkit.generate(model, prompts, new_tokens, compile=True))
    second = _first_call_s(lambda: attnkit.generate(model, prompts, new_tokens, compile=True))
    eager = _first_call_s(lambda: attnkit.generate(model, prompts, new_tokens))
    return [
        {
            "generate": f"small model, {new_tokens} new tokens",
            "first call, compiling (s)": f"{first:.1f}",
            "second call (s)": f"{second:.2f}",
            "eager (s)": f"{eager:.2f}",
        }
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--only", choices=["attention", "training", "flex", "generate"], default=None)
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [1024] if args.quick else [4096, 16384]
    repeat = args.repeat or (2 if args.quick else 7)
    print(f"float32, sliding window {WINDOW}, B={B} H={H} D={D}; {machine()}", flush=True)
    results: dict = {}
    sections = {
        "attention": lambda: attention_rows(lengths, repeat),
        "training": lambda: training_rows(256 if args.quick else 2048, 1 if args.quick else 4, repeat),
        "flex": lambda: flex_rows(lengths, repeat),
        "generate": lambda: generate_rows(16 if args.quick else 64),
    }
    if args.quick and args.only is None:  # (--quick: a check that each part runs; generate's compile is slow)
        del sections["generate"]
    for name, run in sections.items():
        if args.only in (None, name):
            rows = results[name] = run()
            print(f"\n{name}\n{table(rows, list(rows[0]))}\n", flush=True)
    if not args.quick and args.only is None:  # (a smoke run leaves the recorded result alone)
        save("compile", results, out=args.out)


if __name__ == "__main__":
    main()

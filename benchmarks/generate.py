"""Decoding: attnkit.generate against Hugging Face generate, caches against recomputation, the Engine
against static batching, quantized caches and weights, chunked prefill, speculative decoding; and decode
attention over long caches (8k-128k keys) against SDPA.

One llama-like model (hidden 512, 8 layers, 8 heads, intermediate 1408, vocab 32000, random weights) built
as a Hugging Face ``LlamaForCausalLM`` (sdpa attention) and converted with ``attnkit.integrations.hf.from_hf``
(same weights); 32-token prompts, greedy decoding.  Every timing is a median of interleaved repeats in one
process; each decode speed is also shown against the memory-bandwidth limit at batch 1: the bytes of every
weight but the embedding rows, read once per step, over the read bandwidth at the thread count the steps
ran at (``decode_threads="auto"`` may pick fewer threads than torch's; HF runs at torch's count).

    python benchmarks/generate.py            # full run (tens of minutes on 2 cores)
    python benchmarks/generate.py --quick    # fewer tokens and requests, no compiled rows (a minute or two)
    python benchmarks/generate.py --only decode --no-compile   # one section, eager steps only
    python benchmarks/generate.py --only decode --no-compile --contended   # with a busy loop on one core
    python benchmarks/generate.py --only longctx     # decode attention over 8k-128k cached keys vs SDPA

``--contended`` starts a process of its own that spins on one core (the last this process may use) for
the whole run and stops it at the end, also after an error or Ctrl-C: the machine a user decodes on
usually has something else running.  The read bandwidth is the median of many sums over a buffer 8x the
last-level cache (at least 256 MiB) at each thread count decoding may use, measured before and after each
batch size's timing, interleaved over the counts; the "x limit" column gives the ratio at that median and,
in brackets, at the 90th and 10th percentile passes (the measurement's spread).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from _common import OUT_HELP, machine, save, table, timeit
from attnkit.cache import QuantizedCache, StaticCache
from attnkit.nn import to_decode_layout
from attnkit.quantization import weight_bytes

PROMPT = 32


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this machine in bytes (Linux sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        with contextlib.suppress(ValueError):
            sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 * 2**20)


def _pass_rates(x: torch.Tensor, threads: int, passes: int) -> list[float]:
    """Bytes per second of ``passes`` sums over ``x`` at ``threads`` torch threads (set back afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x.sum()  # (the threads started)
        rates = []
        for _ in range(passes):
            t0 = time.perf_counter()
            x.sum()
            rates.append(x.nbytes / (time.perf_counter() - t0))
        return rates
    finally:
        torch.set_num_threads(before)


def read_bandwidth(passes: int = 21, rounds: int = 3) -> dict[int, dict]:
    """Bytes per second this machine reads from memory at each thread count ``decode_threads="auto"`` may
    pick (torch's count, one fewer, one): the median of ``passes`` sums over a float32 buffer 8x the
    last-level cache (at least 256 MiB: no pass is served from a cache), each element read once, with the
    10th and 90th percentiles (the spread).  The passes run in ``rounds`` interleaved over the counts, so
    that a busy neighbour weighs on every count alike."""
    from attnkit._threads import _candidates

    counts = _candidates(torch.get_num_threads())
    x = torch.ones(max(256 * 2**20, 8 * last_level_cache_bytes()) // 4)
    x.sum()  # (the pages touched)
    rates: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            rates[n] += _pass_rates(x, n, max(1, passes // rounds))
    return {n: bandwidth_summary(n, rs) for n, rs in rates.items()}


def bandwidth_summary(threads: int, rates: list[float]) -> dict:
    """The median, 10th and 90th percentiles of pass rates (bytes per second), and the rates themselves."""
    rs = sorted(rates)
    pick = lambda q: rs[round(q * (len(rs) - 1))]  # noqa: E731
    return {"threads": threads, "median": statistics.median(rs), "p10": pick(0.1), "p90": pick(0.9), "rates": rs}


def pooled(*measures: dict[int, dict]) -> dict[int, dict]:
    """Several :func:`read_bandwidth` results as one (their passes together)."""
    return {n: bandwidth_summary(n, [r for m in measures for r in m[n]["rates"]]) for n in measures[0]}


def bandwidth_text(bw: dict[int, dict]) -> str:
    """``1 thread 21.3 GB/s (20.1-22.0), 2 threads ...``: the median and the 10th-90th percentile spread."""
    return ", ".join(
        f"{n} thread{'s' * (n > 1)} {b['median'] / 1e9:.1f} GB/s ({b['p10'] / 1e9:.1f}-{b['p90'] / 1e9:.1f})"
        for n, b in sorted(bw.items())
    )


def decode_thread_count(model, batch: int) -> int:
    """The thread count ``decode_threads="auto"`` settled on for ``model``'s generations of ``batch``
    sequences (torch's count when it has not decided)."""
    import importlib

    policy = importlib.import_module("attnkit.decoding.generation")._THREADS.get(model, {}).get(batch)
    return policy.chosen if policy is not None and policy.chosen else torch.get_num_threads()


BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_core():
    """Another process spinning on one core (the last this process may run on) inside the block; it is
    stopped when the block ends, however it ends (errors, KeyboardInterrupt).  Yields the process."""
    core = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
    try:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(proc.pid, {core})
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hf_llama(seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def hf_generate(model, prompts: torch.Tensor, n: int) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[:, prompts.shape[1] :].tolist()


def streamed_bytes(model) -> int:
    """Bytes read per decode step: every parameter/buffer except the token embedding table."""
    emb = model.embed.weight
    tied = model.lm_head is None
    return weight_bytes(model) - (0 if tied else emb.nbytes)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    x, y = torch.tensor(a), torch.tensor(b)
    return float((x == y).float().mean())


def decode_rows(args, hf, model, rows, results):
    n = args.new_tokens
    step_bytes = {}
    variants = {"attnkit float32": model}
    auto = copy.deepcopy(model)
    for mod in auto.modules():  # the same model with the default backend choice ("auto") in every layer
        if hasattr(mod, "backend"):
            mod.backend = "auto"
    variants["attnkit float32, backend auto"] = auto
    if not args.quick:  # decode steps read copies laid out for their batch; these rows read the model's own
        # weights (relayout=False), in one layout at both batch sizes
        variants["attnkit float32, row-major kept"] = copy.deepcopy(model)
        variants["attnkit float32, column-major kept"] = to_decode_layout(copy.deepcopy(model), batch_size=8)
    b16 = copy.deepcopy(model).to(torch.bfloat16)
    variants["attnkit bfloat16"] = b16
    q8 = attnkit.quantize(copy.deepcopy(model), "int8")
    variants["attnkit int8 weights"] = q8
    # compiled rows use backend "auto": while tracing it picks math for decode steps, which Inductor fuses
    # (copies of the models: the compiled code freezes its own copy of the weights)
    compiled = (
        {
            "attnkit float32, compiled": copy.deepcopy(auto),
            "attnkit bfloat16, compiled": copy.deepcopy(auto).to(torch.bfloat16),
        }
        if args.compile
        else {}
    )
    for name, m in {**variants, **compiled}.items():
        step_bytes[name] = streamed_bytes(m)
    step_bytes["HF float32"] = step_bytes["attnkit float32"]
    for name, m in compiled.items():  # compile before timing (reported separately)
        t0 = time.perf_counter()
        for B in (1, 8):
            attnkit.generate(m, torch.zeros(B, PROMPT, dtype=torch.long).tolist(), 3, compile=True)
        results.setdefault("compile_seconds", {})[name] = time.perf_counter() - t0
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    for B in (1, 8):
        g = torch.Generator().manual_seed(B)
        prompts = torch.randint(0, 32000, (B, PROMPT), generator=g)
        plist = prompts.tolist()
        toks = {}

        def run_hf():
            toks["HF float32"] = hf_generate(hf, prompts, n)

        fns = {"HF float32": run_hf}
        for name, m in variants.items():
            kw = {"relayout": False} if name.endswith("kept") else {}
            fns[name] = lambda m=m, name=name, kw=kw: toks.__setitem__(name, attnkit.generate(m, plist, n, **kw))
        for name, m in compiled.items():
            fns[name] = lambda m=m, name=name: toks.__setitem__(name, attnkit.generate(m, plist, n, compile=True))
        before = read_bandwidth()
        t = timeit(fns, repeat=args.repeat, warmup=1, budget_s=args.budget)
        bw = pooled(before, read_bandwidth())  # (measured around the timing, at each count the steps may use)
        print(f"read bandwidth around the batch-{B} timing: {bandwidth_text(bw)}", flush=True)
        base = t["HF float32"]
        models = {**variants, **compiled}
        limit_ms, limit_threads = {}, {}
        for name in fns:
            # each step's limit: its bytes at the read bandwidth of the thread count its steps ran at (HF: torch's)
            threads = torch.get_num_threads() if name == "HF float32" else decode_thread_count(models[name], B)
            limit_threads[name] = threads
            limit_ms[name] = step_bytes[name] / bw[threads]["median"] * 1e3
            step_ms = t[name] / n * 1e3
            lo, hi = step_bytes[name] / bw[threads]["p90"] * 1e3, step_bytes[name] / bw[threads]["p10"] * 1e3
            row = {
                "measure": "decode, contended" if args.contended else "decode",
                "what": name,
                "batch": B,
                "new tokens": n,
                "tokens/s": f"{B * n / t[name]:.0f}",
                "ms/step": f"{step_ms:.1f}",
                "vs HF fp32": f"{base / t[name]:.2f}x",
                "x limit": (
                    f"{step_ms / limit_ms[name]:.2f} ({step_ms / hi:.2f}-{step_ms / lo:.2f}) at {threads} thr"
                    if B == 1
                    else "-"
                ),
                "same tokens as HF": f"{agreement(toks[name], toks['HF float32']):.1%}",
            }
            rows.append(row)
            print(row, flush=True)
        results.setdefault("decode", []).append(
            {
                "batch": B,
                "seconds": t,
                "new_tokens": n,
                "limit_ms": limit_ms,
                "limit_threads": limit_threads,
                "step_bytes": step_bytes,
                "read_bandwidth": {k: {**v, "rates": None} for k, v in bw.items()},
            }
        )
    # logit error of the int8 / bf16 weights on one batch
    ids = torch.randint(0, 32000, (4, 64), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(ids)
        for name in ("attnkit bfloat16", "attnkit int8 weights"):
            out = variants[name](ids).float()
            err = float((out - ref).abs().max())
            agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
            mem = streamed_bytes(variants[name])
            rows.append(
                {
                    "measure": "weights",
                    "what": name,
                    "batch": 4,
                    "new tokens": "-",
                    "tokens/s": "-",
                    "ms/step": "-",
                    "vs HF fp32": f"{streamed_bytes(model) / mem:.2f}x fewer bytes a step",
                    "x limit": f"{mem / args.bandwidth * 1e3:.1f} ms limit",
                    "same tokens as HF": f"max|dlogit| {err:.3f}, argmax {agree:.1%}",
                }
            )
            results.setdefault("weights", {})[name] = {
                "bytes": mem,
                "max_logit_err": err,
                "argmax_agree": agree,
                "fp32_bytes": streamed_bytes(model),
            }


def long_context(args, rows, results):
    """One decode query per head (batch 1, 8 query heads, 2 kv heads, D=128) against a cache of 8k-128k keys:
    attnkit.attention (backend auto) against SDPA on the same cache views (a static cache's prefix)."""
    import torch.nn.functional as F

    from attnkit import backends, masks

    out = []
    g = torch.Generator().manual_seed(11)
    for L in args.long_lengths:
        cache = StaticCache(1, max_len=L + 64, batch_size=1, n_kv_heads=2, d_head=128)
        layer = cache.layers[0]
        layer.update(torch.randn(1, 2, L - 1, 128, generator=g), torch.randn(1, 2, L - 1, 128, generator=g))
        k, v = layer.update(torch.randn(1, 2, 1, 128, generator=g), torch.randn(1, 2, 1, 128, generator=g))[:2]
        q = torch.randn(1, 8, 1, 128, generator=g)
        mask = masks.causal()
        picked = backends.explain(q, k, v, mask=mask).split("'")[1]
        reps = max(1, 2**17 // L)

        def ours():
            for _ in range(reps):
                attnkit.attention(q, k, v, mask=mask)  # noqa: F821 (runs before the del below)

        def sdpa():
            for _ in range(reps):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: F821 (runs before the del below)

        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            err = float((attnkit.attention(q, k, v, mask=mask) - ref).abs().max())
            t = timeit({"attnkit": ours, "sdpa": sdpa}, repeat=args.repeat + 3, warmup=1, budget_s=args.budget)
        kv_bytes = k.nbytes // k.shape[2] * L * 2  # keys and values read once
        ms = {name: t[name] / reps * 1e3 for name in t}
        rows.append(
            {
                "measure": "long-context decode attention",
                "what": f"{L // 1024}k keys, auto: {picked}",
                "batch": 1,
                "new tokens": "-",
                "tokens/s": "-",
                "ms/step": f"{ms['attnkit']:.2f} / SDPA {ms['sdpa']:.2f}",
                "vs HF fp32": f"{t['sdpa'] / t['attnkit']:.2f}x SDPA",
                "x limit": f"{ms['attnkit'] / (kv_bytes / args.bandwidth * 1e3):.2f}",
                "same tokens as HF": f"max|diff| {err:.1e}",
            }
        )
        print(rows[-1], flush=True)
        out.append(
            {
                "keys": L,
                "picked": picked,
                "ms": ms,
                "vs_sdpa": t["sdpa"] / t["attnkit"],
                "threads": torch.get_num_threads(),
                "max_abs_diff": err,
            }
        )
        del cache, layer, k, v
    results["long_context"] = out


def profile_step(model, rows, results):
    """Share of a batch-1 decode step spent in matrix products (the projections and the head)."""
    from torch.profiler import ProfilerActivity, profile

    cache = StaticCache.for_model(model, 1, 64)
    tok = torch.tensor([[7]])
    with torch.no_grad():
        model(torch.randint(0, 32000, (1, PROMPT)), cache=cache)
        for _ in range(3):
            model(tok, cache=cache)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                model(tok, cache=cache)
        wall = (time.perf_counter() - t0) / 10
    ev = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(ev.values())
    mm = sum(v for k, v in ev.items() if k in ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise"))
    attn = sum(v for k, v in ev.items() if "scaled_dot_product" in k)
    share = {"matmul": mm / total, "attention": attn / total, "other": 1 - (mm + attn) / total}
    rows.append(
        {
            "measure": "profile",
            "what": "batch-1 step (profiled)",
            "batch": 1,
            "new tokens": "-",
            "tokens/s": "-",
            "ms/step": f"{wall * 1e3:.1f}",
            "vs HF fp32": "-",
            "x limit": "-",
            "same tokens as HF": ", ".join(f"{k} {v:.0%}" for k, v in share.items()),
        }
    )
    results["profile"] = share


def cache_vs_recompute(args, model, rows, results):
    plist = torch.randint(0, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(3)).tolist()
    out = []
    for n in args.lengths:
        t = timeit(
            {
                "static": lambda: attnkit.generate(model, plist, n),
                "none": lambda: attnkit.generate(model, plist, n, cache=None),
            },
            repeat=args.repeat if n <= 64 else max(1, args.repeat - 2),
            warmup=int(n <= 64),
            budget_s=args.budget,
        )
        ratio = t["none"] / t["static"]
        rows.append(
            {
                "measure": "KV cache vs none",
                "what": "static / recompute",
                "batch": 1,
                "new tokens": n,
                "tokens/s": f"{n / t['static']:.0f} / {n / t['none']:.0f}",
                "ms/step": f"{t['static'] / n * 1e3:.1f} / {t['none'] / n * 1e3:.1f}",
                "vs HF fp32": f"cache {ratio:.1f}x faster",
                "x limit": "-",
                "same tokens as HF": "-",
            }
        )
        print(rows[-1], flush=True)
        out.append({"new_tokens": n, "seconds": t, "ratio": ratio})
    results["cache_vs_none"] = out


def mixed_workload(args, model, rows, results):
    rng = random.Random(0)
    lo, hi = args.mixed_lengths
    reqs = [
        ([rng.randrange(32000) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(args.requests)
    ]
    B = args.static_batch
    max_len = 2 * hi  # static preallocation: every slot holds the longest prompt plus the longest output
    static_out: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    waste_num = waste_den = 0
    for s in range(0, len(reqs), B):
        chunk = reqs[s : s + B]
        n = max(o for _, o in chunk)
        toks = attnkit.generate(
            model, [p for p, _ in chunk], n, cache=lambda m, b, _len: StaticCache.for_model(m, b, max_len)
        )
        for i, ((_p, o), t) in enumerate(zip(chunk, toks)):
            static_out[s + i] = t[:o]
        for step in range(n):  # positions held by unfinished sequences / preallocated positions
            waste_num += sum(len(p) + min(step, o) for p, o in chunk if step < o)
            waste_den += B * max_len
    t_static = time.perf_counter() - t0
    static_waste = 1 - waste_num / waste_den
    block = 16
    blocks = B * max_len // block  # the same memory as the static preallocation
    engine = attnkit.Engine(model, cache_blocks=blocks, block_size=block, max_batch=args.engine_batch)
    t0 = time.perf_counter()
    rids = [engine.add(p, o) for p, o in reqs]
    done = engine.run()
    t_engine = time.perf_counter() - t0
    engine_out = [done[r] for r in rids]
    same = sum(engine_out[i] == static_out[i] for i in range(len(reqs))) / len(reqs)
    n_tok = sum(o for _, o in reqs)
    for name, t, w in (("static batching", t_static, static_waste), ("Engine (paged)", t_engine, engine.mean_waste)):
        rows.append(
            {
                "measure": "mixed workload",
                "what": name,
                "batch": B if name.startswith("static") else f"<= {args.engine_batch}",
                "new tokens": n_tok,
                "tokens/s": f"{n_tok / t:.1f}",
                "ms/step": "-",
                "vs HF fp32": f"{t_static / t:.2f}x static",
                "x limit": f"waste {w:.1%}",
                "same tokens as HF": f"{same:.0%} of requests equal" if name.startswith("Engine") else "-",
            }
        )
        print(rows[-1], flush=True)
    results["mixed"] = {
        "requests": len(reqs),
        "lengths": [lo, hi],
        "static_batch": B,
        "engine_batch": args.engine_batch,
        "pool_blocks": blocks,
        "block_size": block,
        "seconds_static": t_static,
        "seconds_engine": t_engine,
        "static_waste": static_waste,
        "engine_waste_mean": engine.mean_waste,
        "preemptions": engine.stats["preemptions"],
        "same_tokens": same,
        "peak_blocks": engine.stats["peak_blocks"],
    }


def quantized_cache(args, model, rows, results):
    n = args.new_tokens
    out = {}
    for B in (1, 8):
        plist = torch.randint(0, 32000, (B, PROMPT), generator=torch.Generator().manual_seed(5)).tolist()
        toks = {}
        fns = {
            c: (lambda c=c: toks.__setitem__(c, attnkit.generate(model, plist, n, cache=c)))
            for c in ("static", "int8", "int4")
        }
        t = timeit(fns, repeat=max(1, args.repeat - 2), warmup=1, budget_s=args.budget)
        L = PROMPT + n
        for c in fns:
            if c == "static":
                ratio, long_ratio = "1.00x", "-"
            else:
                bits = 8 if c == "int8" else 4
                ratios = []
                for length in (L, 2048, 8192):
                    s = StaticCache.for_model(model, 1, length).nbytes()
                    q = QuantizedCache.for_model(model, 1, length, bits=bits)
                    kv = q.layers[0].update(*(torch.zeros(1, 8, 1, 64),) * 2)  # allocates the storage ...
                    kv.attend(torch.zeros(1, 8, 1, 64))  # ... and the decode read's chunk workspace
                    ratios.append((s / q.nbytes(), s / (q.nbytes() + q.workspace_nbytes())))
                ratio = f"{ratios[0][0]:.2f}x ({ratios[0][1]:.2f}x with workspace) at {L}"
                long_ratio = f"{ratios[1][0]:.2f}x ({ratios[1][1]:.2f}x) at 2048, {ratios[2][0]:.2f}x at 8192"
            rows.append(
                {
                    "measure": "KV cache storage",
                    "what": c,
                    "batch": B,
                    "new tokens": n,
                    "tokens/s": f"{B * n / t[c]:.0f}",
                    "ms/step": f"{t[c] / n * 1e3:.1f}",
                    "vs HF fp32": f"{ratio} smaller",
                    "x limit": long_ratio,
                    "same tokens as HF": f"{agreement(toks[c], toks['static']):.1%} = static",
                }
            )
            print(rows[-1], flush=True)
        out[B] = {"seconds": t}
    results["quantized_cache"] = out


def _chunked_run(model, short, long_prompt, *, arrive, dec_new, long_new, blocks, budget, sizing):
    """One Engine through the workload: 8 requests decode, the long prompt arrives at step ``arrive``.  Returns
    the step times split into plain decode steps (no prompt token in them) and the steps a running request
    waited through while the long prompt was being prefilled, the total time, and the tokens."""
    engine = attnkit.Engine(
        model,
        cache_blocks=blocks,
        block_size=16,
        max_batch=len(short) + 1,
        max_batched_tokens=budget,
        chunk_sizing=sizing,
    )
    rids = [engine.add(p, dec_new) for p in short]
    steps = []  # (seconds, kind): "plain", "waited" (a running request waits through a prefill chunk) or ""
    late, step, prefill_steps, spans = None, 0, 0, True
    t_all = time.perf_counter()
    while engine.has_work:
        if step == arrive:
            late = engine.add(long_prompt, long_new)
        running = sum(1 for r in engine.running if r.rid in rids)
        prefilled = engine.stats["prefill_tokens"]
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        has_prompt = engine.stats["prefill_tokens"] > prefilled
        prefilling = (
            late is not None
            and late not in engine.results
            and (has_prompt or any(r.rid == late and r.fed < len(r.feed) for r in engine.running))
        )
        if has_prompt and late is not None:
            prefill_steps += 1
            spans = spans and running == len(short)
        if running and has_prompt and late is not None:
            steps.append((dt, "waited"))  # a running request waits through it while the long prompt is prefilled
        elif running and not has_prompt and not prefilling:
            steps.append((dt, "plain"))  # a plain decode step: no prompt tokens in it
        else:
            steps.append((dt, ""))
        step += 1
    t_all = time.perf_counter() - t_all
    return {
        "steps": steps,
        "seconds": t_all,
        "tokens": len(short) * dec_new + long_new,
        "prefill_steps": prefill_steps,
        "spans_prefill": spans,
        "tokens_out": [engine.results[r] for r in rids + [late]],
    }


def _whole_prefill_seconds(model, long_prompt, repeat: int) -> float:
    """The median time of the long prompt's prefill alone (one forward, the Engine's prefill path)."""
    times = []
    for _ in range(repeat):
        engine = attnkit.Engine(
            model, cache_blocks=len(long_prompt) // 16 + 2, block_size=16, max_batch=1, prefix_caching=False
        )
        engine.add(long_prompt, 1)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def chunked_prefill(args, rows, results):
    """A long prompt arrives while 8 sequences decode (32-token prompts, enough new tokens to outlast the
    slowest prefill below): the longest step a running sequence waits through, against a plain decode step,
    with and without chunked prefill; the whole workload's throughput; and the chunk steps' time beyond a
    plain step, summed, against the prompt's prefill in one forward.  Each Engine runs three times (twice
    with ``--quick``), interleaved with the others; the table shows medians."""
    from attnkit.nn import DecoderConfig, DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig.preset("small", max_seq_len=8192)).eval()  # vocab 32000, d 256, 4 layers
    rng = random.Random(1)
    long_len, n_dec, arrive, long_new = args.long_prompt, 8, 16, 16
    policies = [
        ("no chunking", None, "tokens"),
        *((f"max_batched_tokens={c}", c, "tokens") for c in args.chunk),
        *((f"max_batched_tokens={c}, chunk_sizing='cost'", c, "cost") for c in args.chunk_cost),
    ]
    # the slowest prefill (the smallest token budget; cost sizing takes fewer tokens late) must end while
    # every short request still decodes
    dec_new = arrive + 2 * -(-long_len // (min(args.chunk + args.chunk_cost) - n_dec)) + 16
    short = [[rng.randrange(32000) for _ in range(PROMPT)] for _ in range(n_dec)]
    long_prompt = [rng.randrange(32000) for _ in range(long_len)]
    blocks = (n_dec * (PROMPT + dec_new) + long_len + long_new) // 16 + 16
    load = os.getloadavg()[0]
    repeat = args.repeat
    whole = _whole_prefill_seconds(model, long_prompt, repeat + 1)
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in policies}
    for _ in range(repeat):
        for name, budget, sizing in policies:
            runs[name].append(
                _chunked_run(
                    model,
                    short,
                    long_prompt,
                    arrive=arrive,
                    dec_new=dec_new,
                    long_new=long_new,
                    blocks=blocks,
                    budget=budget,
                    sizing=sizing,
                )
            )
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    ref_tokens = runs["no chunking"][0]["tokens_out"]
    out = {}
    base_tps = base_plain = None
    for name, budget, sizing in policies:
        rs = runs[name]
        if len({len(r["steps"]) for r in rs}) != 1:
            raise RuntimeError(f"{name}: the runs took different numbers of steps")
        fastest = [min(r["steps"][i][0] for r in rs) for i in range(len(rs[0]["steps"]))]
        kinds = [k for _, k in rs[0]["steps"]]
        plain_steps = [t for t, k in zip(fastest, kinds) if k == "plain"]
        waited = [t for t, k in zip(fastest, kinds) if k == "waited"]
        plain = med(plain_steps)
        base_plain = base_plain or plain
        longest = max(waited)
        tps = rs[0]["tokens"] / sum(fastest)
        base_tps = base_tps or tps
        extra = sum(waited) - plain * len(waited)  # the prefill's cost, spread over the steps
        same = all(r["tokens_out"] == ref_tokens for r in rs)
        out[name] = {
            "budget": budget,
            "chunk_sizing": sizing,
            "plain_step_s": plain,
            "longest_step_s": longest,
            "longest_vs_plain": longest / plain,
            "longest_vs_no_chunking_plain": longest / base_plain,
            "p90_vs_plain": sorted(waited)[int(0.9 * (len(waited) - 1))] / plain,
            "tokens_per_s": tps,
            "throughput_vs_no_chunking": tps / base_tps,
            "prefill_steps": rs[0]["prefill_steps"],
            "prefill_extra_s": extra,
            "prefill_extra_vs_whole": extra / whole,
            "spans_prefill": all(r["spans_prefill"] for r in rs),
            "same_tokens": same,
            "seconds": [r["seconds"] for r in rs],
        }
        rows.append(
            {
                "measure": f"{long_len}-token prompt joins {n_dec} decodes",
                "what": name,
                "batch": n_dec,
                "new tokens": rs[0]["tokens"],
                "tokens/s": f"{tps:.1f}",
                "ms/step": f"{plain * 1e3:.1f}",
                "vs HF fp32": f"longest step {longest / plain:.1f}x a decode step (90th pct "
                f"{out[name]['p90_vs_plain']:.1f}x)",
                "x limit": f"{tps / base_tps:.2f}x the throughput; prefill {extra / whole:.2f}x one forward "
                f"in {out[name]['prefill_steps']} steps",
                "same tokens as HF": "-" if budget is None else ("same as no chunking" if same else "DIFFERENT"),
            }
        )
        print(rows[-1], flush=True)
    results["chunked_prefill"] = {
        "long_prompt": long_len,
        "decoding": n_dec,
        "decode_new": dec_new,
        "threads": torch.get_num_threads(),
        "load_average": [load, os.getloadavg()[0]],
        "whole_prefill_s": whole,
        "repeat": repeat,
        **out,
    }


def speculative(args, rows, results):
    """Batch-1 greedy decoding of the copy task by trained models: plain, prompt lookup, and a draft model
    with a quarter of the target's parameters."""
    from attnkit.decoding import Speculation, SpeculativeStats
    from attnkit.nn import DecoderConfig, DecoderLM
    from attnkit.nn.tasks import copy_task, train_lm

    n, sym = args.copy_length, 16
    g = torch.Generator().manual_seed(0)
    models = {}
    for name, layers in (("target", 4), ("draft", 1)):  # d 256: the draft has 1/4 of the target's layers
        torch.manual_seed(0)
        m = DecoderLM(DecoderConfig(vocab_size=sym + 1, d_model=256, n_layers=layers, n_heads=4, max_seq_len=256))
        saved = (
            Path(args.out) if args.out else Path("benchmarks") / "results"
        ) / f"copy_{name}_{layers}x256_len{n}_steps{args.train_steps}.pt"  # beside the JSON results
        if saved.exists():  # trained by an earlier run of this section (same task, configuration and steps)
            m.load_state_dict(torch.load(saved))
            print(f"loaded the trained {name} from {saved.name}", flush=True)
        else:
            t0 = time.perf_counter()
            losses = train_lm(
                m,
                lambda step: copy_task(32, length=n, n_symbols=sym, generator=g),
                steps=args.train_steps,
                on_step=lambda step, loss: loss < 0.02,
            )
            print(
                f"trained {name} ({sum(p.numel() for p in m.parameters()) / 1e6:.2f}M parameters) in "
                f"{len(losses)} steps, {time.perf_counter() - t0:.0f} s, final loss {losses[-1]:.3f}",
                flush=True,
            )
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save(m.state_dict(), saved)
        models[name] = m.eval()
    target, draft = models["target"], models["draft"]
    prompts = (
        copy_task(args.copy_prompts, length=n, n_symbols=sym, generator=torch.Generator().manual_seed(1))
        .ids[:, : n + 1]
        .tolist()
    )  # x SEP
    toks, stats = {}, {}
    variants = {
        "plain": {},
        "prompt lookup k=8": dict(prompt_lookup=True, num_tokens=8),
        "draft model k=4": dict(draft_model=draft, num_tokens=4),
        "draft model k=8": dict(draft_model=draft, num_tokens=8),
    }

    def run(name):
        st = stats[name] = SpeculativeStats()
        spec = Speculation(**variants[name], stats=st) if variants[name] else None
        toks[name] = [attnkit.generate(target, [p], n, speculative=spec)[0] for p in prompts]

    t = timeit(
        {name: (lambda name=name: run(name)) for name in variants}, repeat=args.repeat, warmup=1, budget_s=args.budget
    )
    correct = sum(o == p[:n] for o, p in zip(toks["plain"], prompts)) / len(prompts)
    out = {
        "copy_length": n,
        "prompts": len(prompts),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "copied_exactly": correct,
    }
    for name in variants:
        tps = len(prompts) * n / t[name]
        rate = stats[name].acceptance_rate if name != "plain" else None
        out[name] = {
            "seconds": t[name],
            "tokens_per_s": tps,
            "vs_plain": t["plain"] / t[name],
            "acceptance_rate": rate,
            "tokens_per_verify": stats[name].tokens_per_step or None,
            "same_tokens": toks[name] == toks["plain"],
        }
        rows.append(
            {
                "measure": "speculative, copy task",
                "what": name,
                "batch": 1,
                "new tokens": n,
                "tokens/s": f"{tps:.1f}",
                "ms/step": "-",
                "vs HF fp32": f"{t['plain'] / t[name]:.2f}x plain",
                "x limit": "-" if rate is None else f"accepts {rate:.0%}, {stats[name].tokens_per_step:.1f} tok/verify",
                "same tokens as HF": "-"
                if name == "plain"
                else ("same as plain" if toks[name] == toks["plain"] else "DIFFERENT"),
            }
        )
        print(rows[-1], flush=True)
    results["speculative"] = out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fewer tokens, requests and repeats; no compiled rows unless --compile is given",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument(
        "--compile",
        dest="compile",
        action="store_true",
        default=None,
        help="time the generate(compile=True) rows (the default without --quick; each compiles for minutes first)",
    )
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the generate(compile=True) rows")
    ap.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="sections to run: decode longctx profile cache mixed quantized chunked speculative (default: "
        "all; with --quick all but chunked and speculative)",
    )
    ap.add_argument(
        "--contended",
        action="store_true",
        help="run with a busy-loop process of this script's own on one core (stopped at the end)",
    )
    ap.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = ap.parse_args(argv)
    if args.compile is None:
        args.compile = not args.quick
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with busy_core() if args.contended else contextlib.nullcontext():
        run(args)


def run(args) -> None:
    try:
        import transformers  # noqa: F401  (the model comes from transformers, and HF generate is the baseline)
    except ImportError:
        print(
            "benchmarks/generate.py: skipped, its model and baseline come from transformers, which is not "
            "installed (pip install 'attnkit[bench]')"
        )
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    args.new_tokens = 32 if args.quick else 256
    args.repeat = 2 if args.quick else 3
    args.budget = 15 if args.quick else 240
    args.lengths = [16, 64] if args.quick else [32, 64, 128, 256]
    args.requests = 8 if args.quick else 64
    args.mixed_lengths = (16, 64) if args.quick else (16, 1024)
    args.static_batch = 8
    args.engine_batch = 16
    args.long_prompt = 512 if args.quick else 4096
    args.chunk = [32, 64] if args.quick else [32, 64, 128]  # chunked prefill's token budgets
    args.chunk_cost = [128] if args.quick else [128, 256]  # ... and those sized by cost
    args.copy_length = 32
    args.copy_prompts = 2 if args.quick else 8
    args.train_steps = 5 if args.quick else 400
    args.long_lengths = [32768] if args.quick else [8192, 32768, 131072]
    # (--quick leaves out the chunked-prefill and speculative sections unless --only names them: they train
    # and prefill for minutes)
    default = ["decode", "longctx", "profile", "cache", "mixed", "quantized"] + (
        [] if args.quick else ["chunked", "speculative"]
    )
    sections = set(args.only or default)
    from attnkit.integrations.hf import from_hf

    hf = hf_llama()
    # backend "sdpa" names the kernel every decode step runs; the "backend auto" row is the default (auto
    # checks a call's signature, and for an unmasked call picks sdpa without weighing the tiled backends)
    model = from_hf(hf, backend="sdpa").eval()
    load = os.getloadavg()[0]
    bw = read_bandwidth()
    args.bandwidth = bw[torch.get_num_threads()]["median"]  # (every thread: the long-context rows use them all)
    rows: list[dict] = []
    results: dict = {
        "load_average_start": load,
        "contended": args.contended,
        "read_bandwidth": {n: {**b, "rates": None} for n, b in bw.items()},
    }
    if "decode" in sections:
        decode_rows(args, hf, model, rows, results)
    if "longctx" in sections:
        long_context(args, rows, results)
    if "profile" in sections:
        profile_step(model, rows, results)
    if "cache" in sections:
        cache_vs_recompute(args, model, rows, results)
    if "quantized" in sections:
        quantized_cache(args, model, rows, results)
    if "mixed" in sections:
        mixed_workload(args, model, rows, results)
    if "chunked" in sections:
        chunked_prefill(args, rows, results)
    if "speculative" in sections:
        speculative(args, rows, results)
    results["load_average_end"] = os.getloadavg()[0]
    cols = [
        "measure",
        "what",
        "batch",
        "new tokens",
        "tokens/s",
        "ms/step",
        "vs HF fp32",
        "x limit",
        "same tokens as HF",
    ]
    print()
    print(
        f"generate, llama-like (58M), {PROMPT}-token prompts, greedy; {machine()}; load average "
        f"{results['load_average_start']:.1f} -> {results['load_average_end']:.1f}; read bandwidth at start "
        f"{bandwidth_text(bw)}" + ("; a busy loop on one core (--contended)" if args.contended else "")
    )
    print(table(rows, cols))
    name = ("generate_quick" if args.quick else "generate") + ("_contended" if args.contended else "")
    path = save(name, {"rows": rows, **results}, out=args.out)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()

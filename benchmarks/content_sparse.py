"""Content-based sparse attention (MoBA, NSA) on attnkit's flash backend: speed against SDPA and against a static
block-sparse mask of the same density, an NSA training step against full attention, and a short associative
recall comparison.

Sections (float32, one process, ratios measured interleaved; the thread count is printed, default 1):

* density -- flash time under the selected-blocks mask / (density x dense flash time), block 64, top-k 8 per
            block of 64 queries (random scores; with --causal-too also causal, the own block added), beside a
            static block-sparse mask (``masks.random_blocks``) of the same density, forward and forward+backward
            at L = 4096 / 8192 / 16384 (B=1, H=2, D=64);

* moba   -- block 64, top-k 8 earlier blocks + the own block, causal, selection included, forward and
            forward+backward at L = 16384 / 32768 (B=1, H=2, D=64):
            ``moba/routed`` the paper's per-query choice, routed as the paper computes it
                            (``nn.moba.moba_attention``: ``attention_varlen`` over each chosen block's queries);
            ``moba/query``  the same choice as one flash call under ``masks.selected_blocks``;
            ``moba/block``  one choice per block of 64 queries, scored by the block's mean query
                            (``masks.top_k_blocks``): the tiling the kernels skip best;
            ``static``      ``masks.random_blocks(64, 9, causal=True)``, about the same density as moba/block;
            ``sdpa``        ``scaled_dot_product_attention(is_causal=True)``.
* nsa    -- one training step (forward, backward, AdamW) of a small DecoderLM at L = 16384 with NSA layers
            against the same model with full causal attention.
* recall -- associative recall (attnkit.nn.tasks, the task of examples/distill_recall.py), 600 steps (the
            first third copying, then copying and recall on alternate steps): full attention, MoBA and NSA
            students from the same seed on the same batches.

    python benchmarks/content_sparse.py --quick           # L = 2048 / 4096, a short recall run
    python benchmarks/content_sparse.py --only moba --lengths 16384
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import attnkit
from attnkit import masks
from attnkit.nn import DecoderConfig, DecoderLM
from attnkit.nn.moba import moba_attention, moba_selection
from attnkit.nn.tasks import accuracy, associative_recall, copy_task, train_lm
from _common import OUT_HELP, save, table, timeit

BLOCK, TOP_K, H, D = 64, 8, 2, 64


def _load() -> str:
    try:
        return "load average %.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        return "load average unknown"


def _block_choice(q: torch.Tensor, k: torch.Tensor) -> masks.Mask:
    """One choice per block of queries: the block's mean query against every earlier block's mean key."""
    B, Hh, L, Dd = q.shape
    nb = L // BLOCK
    qm = q.detach().view(B, Hh, nb, BLOCK, Dd).mean(3)
    km = k.detach().view(B, Hh, nb, BLOCK, Dd).mean(3)
    i = torch.arange(nb)
    scores = (qm @ km.transpose(-1, -2)).masked_fill(i[None, :] >= i[:, None], float("-inf"))
    earlier = masks.top_k_blocks(scores, TOP_K, block=BLOCK).selection()[0]
    own = i.view(1, 1, nb, 1).expand(B, Hh, nb, 1)
    return masks.selected_blocks(torch.cat([earlier, own], -1), block=BLOCK) & masks.causal()


def moba_section(lengths, repeat: int, with_query: bool = True) -> list[dict]:
    rows = []
    for L in lengths:
        g = torch.Generator().manual_seed(L)
        q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
        go = torch.randn(1, H, L, D, generator=g)
        static = masks.random_blocks(BLOCK, TOP_K + 1, seed=1, causal=True)

        def per_query():
            return masks.selected_blocks(moba_selection(q, k, BLOCK, TOP_K), block=(1, BLOCK)) & masks.causal()

        variants = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "static": lambda: attnkit.attention(q, k, v, mask=static, backend="flash"),
            "moba/block": lambda: attnkit.attention(q, k, v, mask=_block_choice(q, k), backend="flash"),
            "moba/routed": lambda: moba_attention(q, k, v, block=BLOCK, top_k=TOP_K, backend="flash"),
            "moba/query": lambda: attnkit.attention(q, k, v, mask=per_query(), backend="flash"),
        }
        if not with_query:
            del variants["moba/query"]
        density = {
            "sdpa": 0.5 + 0.5 / L,
            "static": static.density(L, L),
            "moba/block": _block_choice(q, k).density(L, L, heads=H),
        }
        density["moba/routed"] = per_query().density(L, L, heads=H)
        if with_query:
            density["moba/query"] = density["moba/routed"]
        visited = {
            name: (
                None
                if name in ("sdpa", "moba/routed")
                else (static if name == "static" else _block_choice(q, k) if name == "moba/block" else per_query())
                .block_structure(L, L, 64, heads=H)
                .visited_fraction()
            )
            for name in variants
        }
        with torch.no_grad():
            fwd = timeit(variants, repeat=repeat, budget_s=120)
        both = timeit({n: (lambda f=f: f().backward(go)) for n, f in variants.items()}, repeat=repeat, budget_s=240)
        for name in variants:
            rows.append(
                {
                    "L": L,
                    "variant": name,
                    "density": f"{density[name]:.3f}",
                    "tiles visited (64x64)": "-" if visited[name] is None else f"{visited[name]:.3f}",
                    "fwd s": f"{fwd[name]:.3f}",
                    "fwd+bwd s": f"{both[name]:.3f}",
                    "sdpa/x fwd": f"{fwd['sdpa'] / fwd[name]:.2f}",
                    "sdpa/x fwd+bwd": f"{both['sdpa'] / both[name]:.2f}",
                    "x/static fwd": f"{fwd[name] / fwd['static']:.2f}",
                    "x/static fwd+bwd": f"{both[name] / both['static']:.2f}",
                }
            )
    return rows


def _density_masks(L: int, causal: bool, g: torch.Generator) -> tuple[masks.Mask, masks.Mask]:
    """A selected-blocks mask (top-k of random block scores per query block; causal: the own block plus the
    top-k earlier blocks) and a static block-sparse mask of about the same density."""
    nb = L // BLOCK
    scores = torch.randn(1, H, nb, nb, generator=g)
    if not causal:
        return masks.top_k_blocks(scores, TOP_K, block=BLOCK), masks.random_blocks(BLOCK, TOP_K, seed=1)
    i = torch.arange(nb)
    scores = scores.masked_fill(i[None, :] > i[:, None], float("-inf")).masked_fill(i[None, :] == i[:, None], 1e9)
    chosen = masks.top_k_blocks(scores, TOP_K + 1, block=BLOCK) & masks.causal()
    return chosen, masks.random_blocks(BLOCK, TOP_K + 1, seed=1, causal=True)


def density_section(lengths, repeat: int, causal_too: bool) -> list[dict]:
    """flash time under a mask / (its density x dense flash time), the selected-blocks mask beside a static
    block-sparse mask; the masks are built before timing (the selection is not in the time)."""
    rows = []
    for L in lengths:
        for causal in (False, True) if causal_too else (False,):
            g = torch.Generator().manual_seed(L)
            q, k, v = (torch.randn(1, H, L, D, generator=g).requires_grad_() for _ in range(3))
            go = torch.randn(1, H, L, D, generator=g)
            chosen, static = _density_masks(L, causal, g)
            variants = {
                "dense": (None, 1.0),
                "selected": (chosen, chosen.density(L, L, heads=H)),
                "static": (static, static.density(L, L, heads=H)),
            }
            calls = {
                n: (lambda m=m: attnkit.attention(q, k, v, mask=m, backend="flash")) for n, (m, _) in variants.items()
            }
            with torch.no_grad():
                fwd = timeit(calls, repeat=repeat, budget_s=300)
            both = timeit({n: (lambda f=f: f().backward(go)) for n, f in calls.items()}, repeat=repeat, budget_s=600)
            for name, (_, dens) in variants.items():
                if name == "dense":
                    continue
                rows.append(
                    {
                        "L": L,
                        "mask": name + (" & causal" if causal else ""),
                        "density": f"{dens:.4f}",
                        "fwd s": f"{fwd[name]:.3f}",
                        "dense fwd s": f"{fwd['dense']:.3f}",
                        "x/(density*dense) fwd": f"{fwd[name] / (dens * fwd['dense']):.2f}",
                        "fwd+bwd s": f"{both[name]:.3f}",
                        "dense fwd+bwd s": f"{both['dense']:.3f}",
                        "x/(density*dense) fwd+bwd": f"{both[name] / (dens * both['dense']):.2f}",
                        "load": _load().split(" ", 2)[2],
                    }
                )
            print(table(rows[-2:], list(rows[-1])), flush=True)
    return rows


def _model(sparse, L: int, vocab: int = 256, d_model: int = 128, layers: int = 2, heads: int = 2) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(
        DecoderConfig(
            vocab_size=vocab,
            d_model=d_model,
            n_layers=layers,
            n_heads=heads,
            max_seq_len=L,
            backend="flash",
            sparse_attention=sparse,
        )
    )


def nsa_section(L: int, repeat: int) -> list[dict]:
    nsa = {
        "method": "nsa",
        "compress_block": 32,
        "compress_stride": 16,
        "select_block": 64,
        "select_count": 16,
        "window": 512,
    }
    ids = torch.randint(0, 256, (1, L + 1), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name, sparse in (("full causal", None), ("nsa", nsa), ("moba", {"method": "moba", "block": 64, "top_k": 8})):
        model = _model(sparse, L + 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            loss = F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()

        steps[name] = step
    t = timeit(steps, repeat=repeat, budget_s=300)
    return [
        {"L": L, "model": name, "step s": f"{t[name]:.3f}", "full/x": f"{t['full causal'] / t[name]:.2f}"}
        for name in steps
    ]


RECALL = dict(n_pairs=6, n_queries=4, n_keys=16, n_values=16)  # the task of examples/distill_recall.py
RECALL_MODELS = {
    "full": None,
    "moba": {"method": "moba", "block": 4, "top_k": 2},
    "nsa": {
        "method": "nsa",
        "compress_block": 4,
        "compress_stride": 2,
        "select_block": 4,
        "select_count": 4,  # the own block, the one before and block 0 are forced: 4 leaves one to choose
        "window": 4,
    },
}


def _recall_batch(step: int, steps: int):
    """The training batch of ``step``: copying (10 distinct symbols of 32, a separator, the same symbols; the
    length drawn from 6..14 each step, so that only a content-based lookup solves it, the circuit recall
    needs) for the first third of the steps, then copying and recall on alternate steps."""
    g = torch.Generator().manual_seed(step)
    length = int(torch.randint(6, 15, (), generator=g))
    if step < steps // 3 or step % 2 == 0:
        return copy_task(32, length=length, n_symbols=32, distinct=True, generator=g)
    return associative_recall(32, **RECALL, generator=g)


def recall_section(steps: int, models, positions: str) -> list[dict]:
    """Each model trained from the same initial seed on the same batches (:func:`_recall_batch`), then scored
    on 512 held-out recall sequences (only the answers count; chance is 1/16)."""
    rows = []
    L = 2 * (RECALL["n_pairs"] + RECALL["n_queries"])
    test = associative_recall(512, **RECALL, generator=torch.Generator().manual_seed(10**6))
    for name in models:
        torch.manual_seed(0)
        model = DecoderLM(
            DecoderConfig(
                vocab_size=33,
                d_model=64,
                n_layers=2,
                n_heads=4,
                max_seq_len=32,
                positions=positions,
                tie_embeddings=False,
                sparse_attention=RECALL_MODELS[name],
            )
        )
        t0 = time.perf_counter()
        losses = train_lm(model, lambda step: _recall_batch(step, steps), steps=steps, lr=5e-3)
        with torch.no_grad():
            acc = accuracy(model.eval()(test.ids), test.targets)
        rows.append(
            {
                "model": name,
                "positions": positions,
                "sequence": L,
                "steps": steps,
                "final loss": f"{losses[-1]:.3f}",
                "test accuracy": f"{acc:.3f}",
                "train s": f"{time.perf_counter() - t0:.0f}",
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=("density", "moba", "nsa", "recall"), action="append")
    p.add_argument("--causal-too", action="store_true", help="density: the causal masks as well")
    p.add_argument("--lengths", type=int, nargs="+")
    p.add_argument("--nsa-length", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--recall-steps", type=int)
    p.add_argument("--recall-models", nargs="+", choices=tuple(RECALL_MODELS), default=list(RECALL_MODELS))
    p.add_argument("--recall-positions", choices=("rope", "alibi", "none"), default="rope")
    p.add_argument("--no-per-query", action="store_true", help="skip moba/query (slow at long lengths)")
    p.add_argument("--out", metavar="DIR", default=None, help=OUT_HELP)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only or ("density", "moba", "nsa", "recall"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {_load()} at start")
    results: dict = {"threads": args.threads, "load at start": _load()}
    if "density" in only:
        lengths = args.lengths or ([2048, 4096] if args.quick else [4096, 8192, 16384])
        results["density"] = density_section(lengths, args.repeat, args.causal_too)
        print(_load())
    if "moba" in only:
        lengths = args.lengths or ([2048, 4096] if args.quick else [16384, 32768])
        results["moba"] = moba_rows = moba_section(lengths, args.repeat, not args.no_per_query)
        print(
            table(
                moba_rows,
                [
                    "L",
                    "variant",
                    "density",
                    "tiles visited (64x64)",
                    "fwd s",
                    "fwd+bwd s",
                    "sdpa/x fwd",
                    "sdpa/x fwd+bwd",
                    "x/static fwd",
                    "x/static fwd+bwd",
                ],
            )
        )
        print(_load())
    if "nsa" in only:
        L = args.nsa_length or (2048 if args.quick else 16384)
        results["nsa"] = nsa_rows = nsa_section(L, args.repeat)
        print(table(nsa_rows, ["L", "model", "step s", "full/x"]))
        print(_load())
    if "recall" in only:
        steps = args.recall_steps or (60 if args.quick else 600)
        results["recall"] = rows = recall_section(steps, args.recall_models, args.recall_positions)
        print(table(rows, ["model", "positions", "sequence", "steps", "final loss", "test accuracy", "train s"]))
        print(_load())
    print(f"saved {save('content_sparse', results, args.out)}")


if __name__ == "__main__":
    main()

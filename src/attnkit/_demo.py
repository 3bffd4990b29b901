"""``attnkit demo`` (what ``make demo`` runs): the library at work, every number computed on the spot.

1. The first article's worked example, traced step by step, and its claimed values checked.
2. A small :class:`~attnkit.nn.DecoderLM` trained on generated associative recall
   (:func:`attnkit.nn.tasks.associative_recall`) until it answers >= 95% of new queries, after a warm-up on
   copying (:func:`attnkit.nn.tasks.copy_task`) that forms the induction circuit recall needs.
3. Attention heatmaps of the trained model (``attention.png``) with the recall heads measured, and the
   attention doctor's report (``doctor.md``).
4. Generation with the KV cache against recomputing every position, with the speedup.

``quick=True`` runs the same steps at a small size (a few seconds of training, no accuracy required): the
tests run it so the demo cannot rot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["DemoSizes", "run"]


@dataclass(frozen=True)
class DemoSizes:
    """How big each part of the demo is."""

    n_pairs: int = 6  # key-value pairs per recall sequence
    n_queries: int = 4  # queries per sequence
    copy_length: int = 10  # the warm-up task: copy 10 distinct symbols
    copy_target: float = 0.95  # switch from copying to recall at this held-out copy accuracy ...
    copy_steps: int = 400  # ... or after this many steps
    batch: int = 32  # training sequences per step
    max_steps: int = 3000  # training stops earlier once held-out recall accuracy reaches `target`
    target: float = 0.98
    required: float = 0.95  # the demo fails below this test accuracy
    eval_every: int = 25
    test_size: int = 1024
    lr: float = 5e-3
    gen_prompt: int = 32  # the generation benchmark: prompt tokens ...
    gen_new: int = 128  # ... and new tokens
    gen_d_model: int = 256
    gen_layers: int = 4

    @classmethod
    def quick(cls) -> "DemoSizes":
        return cls(
            max_steps=10,
            copy_steps=4,
            target=2.0,
            required=0.0,
            eval_every=5,
            test_size=64,
            gen_prompt=8,
            gen_new=8,
            gen_d_model=64,
            gen_layers=2,
        )


def _recall_model(seed: int):
    from .nn import DecoderConfig, DecoderLM

    # 32 recall tokens (16 keys, 16 values) and the copy task's separator (id 32); ALiBi carries no position
    # in q/k, so both tasks must be solved by matching content: the induction circuit
    cfg = DecoderConfig(
        vocab_size=33, d_model=64, n_layers=2, n_heads=4, max_seq_len=64, positions="alibi", tie_embeddings=False
    )
    torch.manual_seed(seed)
    return DecoderLM(cfg)


def _labels(ids, n_keys: int = 16) -> list[str]:
    """Token names: keys ``k0..k15``, values ``v0..v15``."""
    return [f"k{t}" if t < n_keys else f"v{t - n_keys}" for t in ids]


def _head_roles(model, batch, n_pairs: int) -> list[tuple[str, int, float, float, float]]:
    """For every head: the mean weight a query puts on the value of the matching pair, on the matching key
    itself, and the mean weight a value puts on the token just before it (its key)."""
    from .diagnostics import probe

    ids = batch.ids  # (B, L): k v k v ... q a q a ...
    B, L = ids.shape
    first = 2 * n_pairs
    qpos = torch.arange(first, L, 2)  # query positions
    keys = ids[:, 0:first:2]  # (B, P)
    match = (ids[:, qpos, None] == keys[:, None, :]).float().argmax(-1)  # (B, Q): pair index of each query
    with torch.no_grad(), probe(model) as p:
        model(ids)
    rows = []
    for name, rec in p.layers.items():
        w = rec.calls[0].weights  # (B, H, L, L)
        wq = w[:, :, qpos]  # (B, H, Q, L)
        on_value = wq.gather(-1, (2 * match + 1)[:, None, :, None].expand(B, w.shape[1], -1, 1))
        on_key = wq.gather(-1, (2 * match)[:, None, :, None].expand(B, w.shape[1], -1, 1))
        vpos = torch.arange(1, first, 2)
        prev = w[:, :, vpos, vpos - 1]  # (B, H, P)
        for h in range(w.shape[1]):
            rows.append((name, h, float(on_value[:, h].mean()), float(on_key[:, h].mean()), float(prev[:, h].mean())))
    return rows


def _uniform_roles(length: int, n_pairs: int) -> tuple[float, float]:
    """What a uniform causal spread gives the roles of :func:`_head_roles`: a row at position ``p`` (0-based)
    puts ``1/(p+1)`` on each key, so ``(mean over queries, mean over values)`` of that."""
    first = 2 * n_pairs
    on_pair = [1 / (p + 1) for p in range(first, length, 2)]  # query rows
    prev = [1 / (p + 1) for p in range(1, first, 2)]  # value rows
    return sum(on_pair) / len(on_pair), sum(prev) / len(prev)


def _circuit(roles, before: dict, uniform_pair: float, uniform_prev: float):
    """``(recall, previous, recall_ok, previous_ok)``: the head that most attends from a query to its pair's
    value, the head of another layer that most attends from a value to its key, and whether each clearly
    does more than both a uniform spread and the same head before training (``before`` maps ``(layer,
    head)`` to its roles at initialisation: ALiBi alone already puts about 25% on the previous token).
    An untrained model passes neither test."""
    recall = max(roles, key=lambda r: r[2])
    previous = max((r for r in roles if r[0] != recall[0]), key=lambda r: r[4], default=recall)
    recall_ok = recall[2] >= 3 * max(uniform_pair, before[recall[:2]][0])
    previous_ok = previous[4] >= 1.5 * max(uniform_prev, before[previous[:2]][2])
    return recall, previous, recall_ok, previous_ok


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def run(
    out_dir: str | Path = "attnkit-demo", *, quick: bool = False, seed: int = 0, threads: int | None = 1, console=None
) -> int:
    """Run the demo, writing ``attention.png`` and ``doctor.md`` into ``out_dir``; returns the exit code
    (0 when every step worked, 1 when the model missed the accuracy it must reach or the cached tokens
    differ from recomputed ones).

    Example::

        >>> from attnkit._demo import DemoSizes
        >>> DemoSizes.quick().max_steps
        10
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .decoding import generate
    from .diagnostics import doctor
    from .explain import ARTICLE, ARTICLE_CLAIMS, check, trace
    from .nn import DecoderConfig, DecoderLM
    from .nn.tasks import IGNORE, accuracy, associative_recall, copy_task, train_lm
    from .plot import plot_attention

    console = console or Console(highlight=False, soft_wrap=True)  # long lines are not cut at 80 columns
    sizes = DemoSizes.quick() if quick else DemoSizes()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)  # tiny matrices: one thread avoids synchronisation costs
    ok = True
    started = time.perf_counter()
    try:
        # ------------------------------------------------------------------ 1. four steps
        console.rule("[bold]1. Attention in four steps, by hand (the first article, section 3)")
        t = trace(ARTICLE["X"], ARTICLE["W_q"], ARTICLE["W_k"], ARTICLE["W_v"])
        console.print(str(t), markup=False)
        console.print()
        console.print("Checking the article's claimed results of every step against the exact ones:", markup=False)
        report = check(ARTICLE_CLAIMS)
        console.print(str(report), markup=False)
        console.print()

        # ------------------------------------------------------------------ 2. training
        console.rule("[bold]2. A small DecoderLM learns associative recall")
        P, Q = sizes.n_pairs, sizes.n_queries
        task = dict(n_pairs=P, n_queries=Q)
        model = _recall_model(seed)
        roles_batch = associative_recall(256, **task, generator=torch.Generator().manual_seed(seed + 4))
        before = {(name, h): r for name, h, *r in _head_roles(model, roles_batch, P)}  # at init: ALiBi's recency
        example = associative_recall(1, **task, generator=torch.Generator().manual_seed(seed + 7))
        console.print(
            f"Each sequence holds {P} key-value pairs, then {Q} keys whose values must be recalled, e.g.\n"
            f"  {' '.join(_labels(example.ids[0].tolist()))}\n"
            f"The model ({sum(p.numel() for p in model.parameters()):,} parameters, 2 layers x 4 heads, "
            f"ALiBi) is scored on the value after each query.",
            markup=False,
        )
        console.print(
            f"Training starts with copying ({sizes.copy_length} distinct symbols, a separator, the same "
            f"symbols again): it needs the same two-step circuit (find the current token earlier, read the "
            f"token after it), forms it within a few hundred steps because every copied position is "
            f"scored, and recall then reuses it.",
            markup=False,
        )
        g = torch.Generator().manual_seed(seed + 1)
        held_out = associative_recall(256, **task, generator=torch.Generator().manual_seed(seed + 2))
        copy_check = copy_task(
            256,
            length=sizes.copy_length,
            n_symbols=32,
            distinct=True,
            generator=torch.Generator().manual_seed(seed + 6),
        )
        state = {"phase": "copy", "acc": 0.0, "switched": None}
        columns = [
            TextColumn("{task.description:8s}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("held-out accuracy {task.fields[acc]}"),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=console) as bar:
            job = bar.add_task("copy", total=sizes.max_steps, loss="-", acc="-")

            def make_batch(step):
                if state["phase"] == "copy":
                    return copy_task(sizes.batch, length=sizes.copy_length, n_symbols=32, distinct=True, generator=g)
                return associative_recall(sizes.batch, **task, generator=g)

            def on_step(step: int, loss: float) -> bool:
                bar.update(job, advance=1, loss=f"{loss:.3f}")
                if state["phase"] == "copy" and step + 1 >= sizes.copy_steps:
                    state["phase"] = "recall"
                if (step + 1) % sizes.eval_every:
                    return False
                check_batch = copy_check if state["phase"] == "copy" else held_out
                with torch.no_grad():
                    state["acc"] = accuracy(model(check_batch.ids), check_batch.targets)
                model.train()
                bar.update(job, acc=f"{state['acc']:.1%}")
                if state["phase"] == "copy":
                    if state["acc"] >= sizes.copy_target:
                        state["phase"] = "recall"
                    if state["phase"] == "recall" or (step + 1) % (sizes.eval_every * 4) == 0:
                        bar.console.print(
                            f"  step {step + 1:5d}  copy    loss {loss:.3f}  held-out accuracy {state['acc']:.1%}",
                            markup=False,
                        )
                    if state["phase"] == "recall":
                        state["switched"] = step + 1
                        bar.update(job, description="recall", acc="-")
                    return False
                if (step + 1) % (sizes.eval_every * 4) == 0 or state["acc"] >= sizes.target:
                    bar.console.print(
                        f"  step {step + 1:5d}  recall  loss {loss:.3f}  held-out accuracy {state['acc']:.1%}",
                        markup=False,
                    )
                return state["acc"] >= sizes.target

            losses, seconds = _timed(
                lambda: train_lm(model, make_batch, steps=sizes.max_steps, lr=sizes.lr, on_step=on_step)
            )
            bar.update(job, total=len(losses), completed=len(losses))
        test = associative_recall(sizes.test_size, **task, generator=torch.Generator().manual_seed(seed + 3))
        with torch.no_grad():
            test_acc = accuracy(model(test.ids), test.targets)
        copy_steps = state["switched"] or len(losses)
        console.print(
            f"Trained {len(losses)} steps in {seconds:.1f} s ({copy_steps} copying, "
            f"{len(losses) - copy_steps} recall): recall accuracy on {sizes.test_size} new sequences "
            f"({sizes.test_size * Q} queries): {test_acc:.1%}",
            markup=False,
        )
        if test_acc < sizes.required:
            ok = False
            console.print(f"[red]The model stayed below the {sizes.required:.0%} it must reach.[/red]")
        console.print()

        # ------------------------------------------------------------------ 3. heads and doctor
        console.rule("[bold]3. Where the model looks: heatmaps and the attention doctor")
        roles = _head_roles(model, roles_batch, P)
        uniform_pair, uniform_prev = _uniform_roles(roles_batch.ids.shape[1], P)
        table = Table(
            "layer",
            "head",
            "query -> value of its pair",
            "query -> its key",
            "value -> previous token",
            title=f"mean attention weight (a uniform spread gives {uniform_pair:.2f} for a query's pair, "
            f"{uniform_prev:.2f} for a value's previous token)",
        )
        for name, h, on_value, on_key, prev in roles:
            table.add_row(name, str(h), f"{on_value:.2f}", f"{on_key:.2f}", f"{prev:.2f}")
        console.print(table)
        recall, previous, recall_ok, previous_ok = _circuit(roles, before, uniform_pair, uniform_prev)
        recall_init, prev_init = before[recall[:2]][0], before[previous[:2]][2]
        if recall_ok:
            console.print(
                f"The recall head is {recall[0]} head {recall[1]}: {recall[2]:.0%} of each query's "
                f"attention goes to the value stored with the queried key ({recall_init:.0%} before "
                f"training, {uniform_pair:.0%} for a uniform spread).",
                markup=False,
            )
        if recall_ok and previous_ok:
            console.print(
                f"It builds on {previous[0]} head {previous[1]}, which has learned to look at the token "
                f"before each value, its key: {previous[4]:.0%} of a value's attention, against "
                f"{prev_init:.0%} before training and {uniform_prev:.0%} for a uniform spread. Together: "
                f"an induction circuit.",
                markup=False,
            )
        elif recall_ok:
            console.print(
                f"No head of the other layer looks at the previous token much more than before training "
                f"(at most {previous[4]:.0%}, against {prev_init:.0%}): the key reaches its value some "
                f"other way.",
                markup=False,
            )
        else:
            console.print(
                f"No induction circuit has formed in {len(losses)} training steps: the most any head "
                f"puts on the queried pair's value is {recall[2]:.0%} ({recall_init:.0%} before training, "
                f"{uniform_pair:.0%} for a uniform spread).",
                markup=False,
            )
        sample = associative_recall(8, **task, generator=torch.Generator().manual_seed(seed + 5))

        def recall_loss(logits, ids):
            return F.cross_entropy(logits.flatten(0, 1), sample.targets.flatten(), ignore_index=IGNORE)

        diagnosis = doctor(model, sample.ids, recall_loss)
        png = out / "attention.png"
        plot_attention(
            diagnosis.weights,
            tokens=_labels(sample.ids[0].tolist()),
            path=png,
            title="attention of the trained recall model (first layer on top)",
        )
        md = out / "doctor.md"
        md.write_text(diagnosis.to_markdown("Attention doctor: the demo's associative-recall model"), encoding="utf-8")
        console.print(str(diagnosis), markup=False)
        console.print(f"Wrote {png} and {md}.", markup=False)
        console.print()

        # ------------------------------------------------------------------ 4. generation
        console.rule("[bold]4. Generation with a KV cache")
        prompts = [row[: 2 * P + 1].tolist() for row in test.ids[:64]]  # the pairs and the first query
        answers = generate(model, prompts, max_new_tokens=1)
        right = sum(a[0] == int(t) for a, t in zip(answers, test.targets[:64, 2 * P]))
        console.print(
            f"The recall model answers {right} of 64 prompts right through attnkit.generate (static KV cache).",
            markup=False,
        )
        cfg = DecoderConfig(
            vocab_size=512, d_model=sizes.gen_d_model, n_layers=sizes.gen_layers, n_heads=8, max_seq_len=512
        )
        torch.manual_seed(seed)
        lm = DecoderLM(cfg).eval()
        prompt = [torch.randint(0, 512, (sizes.gen_prompt,), generator=torch.Generator().manual_seed(seed)).tolist()]
        generate(lm, prompt, 4)  # warm up both paths
        generate(lm, prompt, 4, cache=None)
        cached, t_cached = _timed(lambda: generate(lm, prompt, sizes.gen_new))
        full, t_full = _timed(lambda: generate(lm, prompt, sizes.gen_new, cache=None))
        same = cached == full
        n = sizes.gen_new
        table = Table(
            "decoding",
            "time",
            "tokens/s",
            title=f"{cfg.n_layers}-layer DecoderLM (d_model "
            f"{cfg.d_model}, random weights), {sizes.gen_prompt}-token prompt, {n} new tokens, greedy",
        )
        table.add_row("recompute every position (cache=None)", f"{t_full:.2f} s", f"{n / t_full:.0f}")
        table.add_row("static KV cache", f"{t_cached:.2f} s", f"{n / t_cached:.0f}")
        console.print(table)
        console.print(
            f"The KV cache is {t_full / t_cached:.1f}x faster here; the tokens are "
            f"{'identical' if same else 'DIFFERENT'}.",
            markup=False,
        )
        if not same:
            ok = False
        console.print()
        console.rule(f"[bold]done in {time.perf_counter() - started:.0f} s" + ("" if ok else " [red](with failures)"))
    finally:
        torch.set_num_threads(old_threads)
    return 0 if ok else 1

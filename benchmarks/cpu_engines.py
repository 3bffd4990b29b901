"""CPU decoding: attnkit against llama.cpp (``llama-cpp-python``) and CTranslate2, with Hugging Face as a third
column, on one random-weight Llama, the same prompt ids and the same thread count.

The model is built once as a Hugging Face ``LlamaForCausalLM`` folder (safetensors, and a word-level tokenizer
that CTranslate2's converter reads); CTranslate2 converts it with its transformers converter, and llama.cpp
reads it as a GGUF file made by llama.cpp's own converter (``convert_hf_to_gguf.py`` from the sources that
llama-cpp-python vendors, given ``--llama-converter``; the folder gets a sentencepiece ``tokenizer.model`` with
the same pieces, the vocabulary format that converter reads for a Llama) or, without it, by this script's
writer (the ``gguf`` package, q and k rows permuted as the converter does), quantized to q8_0 / q4_0 with
llama.cpp's quantizer.  Each engine and precision runs in a process of its own: greedy decoding of ``--new``
tokens after ``--prompt`` prompt tokens, at batch 1 and 8.  Prefill is the time to the first new token (the
prompt's forward); decode is the time of the remaining steps, in generated tokens per second over the whole
batch.  Agreement is the fraction of greedy tokens equal to HF float32's, position by position.  For
attnkit's quantized modes the quality cost is also measured on the float32 model's own greedy continuation: its
perplexity under the quantized model against under float32, and the teacher-forced top-1 agreement.

Optional to run, never part of the test suite.  Setup (llama-cpp-python builds llama.cpp from source: about
40 minutes on 2 quiet cores with the options below; CPU only, tuned for the building machine)::

    pip install -e '.[bench]' ctranslate2
    python -m venv /tmp/llama-venv
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp && tar xzf /tmp/llama_cpp_python-*.tar.gz -C /tmp
    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF" /tmp/llama-venv/bin/pip install /tmp/llama_cpp_python-*/
    /tmp/llama-venv/bin/pip install torch==2.13.0 numpy sentencepiece transformers safetensors protobuf \
        /tmp/llama_cpp_python-*/vendor/llama.cpp/gguf-py          # what the converter imports

    python benchmarks/cpu_engines.py --llama-python /tmp/llama-venv/bin/python \
        --llama-converter /tmp/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py   # 58.5M model
    python benchmarks/cpu_engines.py --size 336M --llama-python ... --llama-converter ...

Without llama-cpp-python (or without ctranslate2) the script says how to install it and runs the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SIZES = {  # hidden, layers, heads, kv heads, intermediate (vocab 32000): about 58.5M and 336M parameters
    "58.5M": (512, 8, 8, 8, 1408),
    "336M": (1024, 20, 16, 16, 2816),
}
VOCAB = 32000
INSTALL_LLAMA = (
    "llama-cpp-python is not installed for {python}: build it (about 40 minutes on 2 cores) as this script's "
    "docstring says, and pass --llama-python /tmp/llama-venv/bin/python (and --llama-converter)"
)
INSTALL_CT2 = "ctranslate2 is not installed for {python}: pip install ctranslate2 (wheels, a minute)"


# ---------------------------------------------------------------------------------------------------------
# the model folder (main process: torch and transformers)


def build_model(folder: Path, size: str, seed: int = 0) -> None:
    """A random-weight LlamaForCausalLM saved in ``folder`` with a word-level tokenizer of its vocabulary."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, layers, heads, kv, inter = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a larger spread than the 0.02 init, and an output head whose logits have clear
        for name, p in model.named_parameters():  # maxima (std ~3): greedy tokens and perplexity mean something
            if p.dim() == 2:
                p.normal_(0.0, (3.0 if name == "lm_head.weight" else 0.5) / math.sqrt(p.shape[1]))
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)


def prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------
# workers: one engine and precision each, in a process of their own; print one JSON line


def _timed_runs(run, repeat: int) -> tuple[float, float, list]:
    """``run(new)`` generates ``new`` tokens; the median time of 1 token (prefill) and of all of them."""
    import statistics

    run(2)  # warm-up (one-time setup, weight packing, measured kernel choices)
    t1, tn, tokens = [], [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        run(1)
        t1.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        tokens = run(None)
        tn.append(time.perf_counter() - t0)
    return statistics.median(t1), statistics.median(tn), tokens


def worker_torch(spec: dict) -> dict:
    """HF (float32) or attnkit (float32, int8, int8 with int8 activations, int4)."""
    import torch

    torch.set_num_threads(spec["threads"])
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(spec["folder"], dtype=torch.float32, attn_implementation="sdpa").eval()
    ids, new = spec["prompts"], spec["new"]
    extra = {}
    if spec["engine"] == "hf":
        x = torch.tensor(ids)

        def run(n):
            n = n or new
            with torch.inference_mode():
                out = hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            return out[:, x.shape[1] :].tolist()
    else:
        import attnkit
        from attnkit.integrations.hf import from_hf

        model = from_hf(hf).eval()
        del hf
        mode = spec["mode"]
        if mode != "float32":
            ref = _teacher(model, ids, spec["reference"]) if spec.get("reference") else None
            if mode == "int8":
                attnkit.quantize(model, "int8")
            elif mode == "int8 act":
                attnkit.quantize(model, "int8", activations="int8")
            elif mode == "int4":
                attnkit.quantize(model, "int4")
            if ref is not None:
                extra = _quality(model, ids, spec["reference"], ref)

        def run(n):
            with torch.inference_mode():
                return attnkit.generate(model, ids, n or new)

    prefill, total, tokens = _timed_runs(run, spec["repeat"])
    out = {"prefill_s": prefill, "total_s": total, "tokens": tokens, **extra}
    if spec["engine"] == "attnkit":
        from attnkit.nn import decode_products

        out["products"] = str(decode_products())
    return out


def _teacher(model, ids, continuation):
    """Float32 log-probabilities of ``continuation`` (the float32 model's greedy tokens) after ``ids``."""
    import torch

    seq = torch.tensor([p + c for p, c in zip(ids, continuation)])  # (B, P + N)
    with torch.inference_mode():
        logits = model(seq[:, :-1]).float()  # (B, P + N - 1, V)
    P = len(ids[0])
    return logits[:, P - 1 :]  # (B, N, V): the predictions of the continuation


def _quality(model, ids, continuation, ref_logits) -> dict:
    import torch

    got = _teacher(model, ids, continuation)
    target = torch.tensor(continuation)  # (B, N)
    nll = lambda lg: -torch.log_softmax(lg, -1).gather(-1, target[..., None]).mean()  # noqa: E731
    return {
        "ppl": float(torch.exp(nll(got))),
        "ppl_float32": float(torch.exp(nll(ref_logits))),
        "top1": float((got.argmax(-1) == ref_logits.argmax(-1)).float().mean()),
    }


def worker_ct2(spec: dict) -> dict:
    import ctranslate2

    out_dir = Path(spec["work"]) / f"ct2-{spec['mode']}"
    if not (out_dir / "model.bin").exists():
        ctranslate2.converters.TransformersConverter(spec["folder"]).convert(
            str(out_dir), quantization=spec["mode"], force=True
        )
    gen = ctranslate2.Generator(
        str(out_dir), device="cpu", compute_type=spec["mode"], intra_threads=spec["threads"], inter_threads=1
    )
    toks = [[f"t{i}" if i >= 3 else ("<unk>", "<s>", "</s>")[i] for i in p] for p in spec["prompts"]]
    new = spec["new"]

    def run(n):
        n = n or new
        res = gen.generate_batch(
            toks, max_length=n, min_length=n, sampling_topk=1, include_prompt_in_result=False, beam_size=1
        )
        return [list(r.sequences_ids[0]) for r in res]

    prefill, total, tokens = _timed_runs(run, spec["repeat"])
    return {"prefill_s": prefill, "total_s": total, "tokens": tokens}


def _safetensors(path: Path) -> dict:
    """The tensors of a safetensors file as numpy arrays (the format: a JSON header, then raw data)."""
    import numpy as np

    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    dtypes = {"F32": np.float32, "F16": np.float16}
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
    return out


def write_gguf(folder: Path, path: Path) -> None:
    """The HF folder's Llama as an f32 GGUF file (llama.cpp's layout: q and k rows permuted for its rope)."""
    import gguf
    import numpy as np

    cfg = json.loads((folder / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hidden = cfg["hidden_size"]
    t = _safetensors(folder / "model.safetensors")

    def permute(w, n):  # (out, in): llama.cpp's rope pairs adjacent features, HF's the two halves
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(hidden // heads)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    w.add_file_type(0)  # all float32
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("llama")
    tokens = [b"<unk>", b"<s>", b"</s>", *(f"t{i}".encode() for i in range(3, cfg["vocab_size"]))]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))  # unknown, control, control, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(t["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", f32(t["model.norm.weight"]))
    w.add_tensor("output.weight", f32(t["lm_head.weight"]))
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, g_name in names.items():
            a = t[f"model.layers.{i}.{hf_name}.weight"]
            if g_name == "attn_q":
                a = permute(a, heads)
            elif g_name == "attn_k":
                a = permute(a, kv)
            w.add_tensor(f"blk.{i}.{g_name}.weight", f32(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_sentencepiece(folder: Path) -> None:
    """``tokenizer.model`` for the folder: a sentencepiece model with the word-level tokenizer's pieces (ids
    equal), which is the vocabulary format llama.cpp's converter reads for a Llama."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    cfg = json.loads((folder / "config.json").read_text())
    m = spm.ModelProto()
    m.trainer_spec.model_type = spm.TrainerSpec.UNIGRAM
    m.trainer_spec.vocab_size = cfg["vocab_size"]
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 0, 1, 2, -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    piece_type = spm.ModelProto.SentencePiece
    kinds = {0: piece_type.UNKNOWN, 1: piece_type.CONTROL, 2: piece_type.CONTROL}
    for i, piece in enumerate(["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, cfg["vocab_size"]))]):
        m.pieces.add(piece=piece, score=0.0, type=kinds.get(i, piece_type.NORMAL))
    (folder / "tokenizer.model").write_bytes(m.SerializeToString())


def convert_gguf(folder: Path, path: Path, converter: str) -> None:
    """The folder as an f32 GGUF file, by llama.cpp's own converter (``convert_hf_to_gguf.py`` of the sources
    llama-cpp-python vendors)."""
    if not (folder / "tokenizer.model").exists():
        write_sentencepiece(folder)
    cmd = [sys.executable, converter, str(folder), "--outtype", "f32", "--outfile", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError("llama.cpp's converter failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1])


def worker_llama(spec: dict) -> dict:
    import ctypes

    import llama_cpp as L
    import numpy as np

    work = Path(spec["work"])
    f32 = work / ("model-f32.gguf" if spec.get("converter") else "model-f32-writer.gguf")
    if not f32.exists():
        if spec.get("converter"):
            convert_gguf(Path(spec["folder"]), f32, spec["converter"])
        else:
            write_gguf(Path(spec["folder"]), f32)
    path = f32
    if spec["mode"] != "f32":
        path = f32.with_name(f32.name.replace("f32", spec["mode"]))
        if not path.exists():
            params = L.llama_model_quantize_default_params()
            params.ftype = {"q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0}[spec["mode"]]
            params.nthread = spec["threads"]
            if L.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params)) != 0:
                raise RuntimeError(f"llama.cpp could not quantize to {spec['mode']}")
    L.llama_backend_init()
    load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
    model = load(str(path).encode(), L.llama_model_default_params())
    vocab = spec["vocab"]
    ids, new = spec["prompts"], spec["new"]
    B, P = len(ids), len(ids[0])

    def run(n):
        n = n or new
        cp = L.llama_context_default_params()
        cp.n_ctx = max(256, B * (P + n + 8))
        cp.n_batch = cp.n_ubatch = max(B * P, 64)
        cp.n_seq_max = B
        cp.n_threads = cp.n_threads_batch = spec["threads"]
        make = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        ctx = make(model, cp)
        batch = L.llama_batch_init(B * P, 0, B)
        try:
            out = [[] for _ in range(B)]
            feed = [(s, pos, tok) for s in range(B) for pos, tok in enumerate(ids[s])]
            for step in range(n):
                batch.n_tokens = len(feed)
                for i, (s, pos, tok) in enumerate(feed):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0] = s
                    batch.logits[i] = step > 0 or pos == P - 1
                if L.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")
                last = [i for i in range(len(feed)) if batch.logits[i]]
                nxt = []
                for s, i in enumerate(last):
                    row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))
                    tok = int(row.argmax())
                    out[s].append(tok)
                    nxt.append((s, P + step, tok))
                feed = nxt
            return out
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)

    prefill, total, tokens = _timed_runs(run, spec["repeat"])
    return {"prefill_s": prefill, "total_s": total, "tokens": tokens}


WORKERS = {"hf": worker_torch, "attnkit": worker_torch, "ct2": worker_ct2, "llama": worker_llama}


# ---------------------------------------------------------------------------------------------------------
# the driver


def has(python: str, module: str) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


def spawn(python: str, spec: dict, timeout: float) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")) if p),
    }
    try:
        proc = subprocess.run(
            [python, str(HERE), "--worker", json.dumps(spec)], capture_output=True, text=True, timeout=timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    if proc.returncode != 0 or line is None:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(line)


def agreement(a, b) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(1, len(pairs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="58.5M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-python", default=sys.executable, help="a Python with llama_cpp, numpy and gguf")
    ap.add_argument(
        "--llama-converter",
        default=None,
        help="llama.cpp's convert_hf_to_gguf.py (in the llama-cpp-python sources, vendor/llama.cpp/); without it "
        "the GGUF file is written by this script's own writer",
    )
    ap.add_argument("--ct2-python", default=sys.executable, help="a Python with ctranslate2, torch, transformers")
    ap.add_argument("--work", default=None, help="folder for the model files (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine process")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--engines", nargs="+", default=["hf", "attnkit", "ct2", "llama"], choices=list(WORKERS))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        fn = WORKERS[spec["engine"]]
        print(json.dumps({"results": [fn({**spec, **b}) for b in spec["batches"]]}))
        return 0

    work = Path(args.work or tempfile.mkdtemp(prefix="attnkit-cpu-engines-"))
    folder = work / f"llama-{args.size}"
    if not (folder / "model.safetensors").exists():
        build_model(folder, args.size)
    engines = [("hf", "float32", sys.executable)] * ("hf" in args.engines)
    if "attnkit" in args.engines:
        engines += [("attnkit", m, sys.executable) for m in ("float32", "int8", "int8 act", "int4")]
    if "ct2" in args.engines and has(args.ct2_python, "ctranslate2"):
        engines += [("ct2", m, args.ct2_python) for m in ("float32", "int8")]
    elif "ct2" in args.engines:
        print(INSTALL_CT2.format(python=args.ct2_python))
    if "llama" in args.engines and has(args.llama_python, "llama_cpp") and has(args.llama_python, "gguf"):
        engines += [("llama", m, args.llama_python) for m in ("f32", "q8_0", "q4_0")]
    elif "llama" in args.engines:
        print(INSTALL_LLAMA.format(python=args.llama_python))
    try:
        load = open("/proc/loadavg").read().split()[:3]
    except OSError:
        load = ["?"]
    print(
        f"model {args.size} (random weights), {args.threads} threads, prompt {args.prompt}, {args.new} new "
        f"tokens, load average {' '.join(load)} at the start"
    )
    batches = {B: prompts(B, args.prompt) for B in args.batches}
    refs: dict[int, list | None] = dict.fromkeys(batches)
    rows: dict[int, list[dict]] = {B: [] for B in batches}
    for engine, mode, python in engines:  # one process per engine and mode, running every batch size
        spec = {
            "engine": engine,
            "mode": mode,
            "folder": str(folder),
            "work": str(work),
            "new": args.new,
            "threads": args.threads,
            "repeat": args.repeat,
            "vocab": VOCAB,
            "converter": args.llama_converter and str(Path(args.llama_converter).resolve()),
            "batches": [{"prompts": ids, "reference": refs[B]} for B, ids in batches.items()],
        }
        got = spawn(python, spec, args.timeout)
        for i, B in enumerate(batches):
            r = got["results"][i] if "results" in got else got
            if engine == "hf" and "tokens" in r:
                refs[B] = r["tokens"]
            rows[B].append({"batch": B, "engine": engine, "mode": mode, **r})
        print(f"  {engine} {mode}: {'failed: ' + got['error'] if 'error' in got else 'done'}", flush=True)
    results = []
    for B, brows in rows.items():
        for r in brows:
            if "error" not in r:
                r["prefill_tok_s"] = B * args.prompt / r["prefill_s"]
                r["decode_tok_s"] = B * (args.new - 1) / max(1e-9, r["total_s"] - r["prefill_s"])
                r["agree"] = agreement(r["tokens"], refs[B]) if refs[B] else float("nan")
        f32 = next((r for r in brows if r["engine"] == "attnkit" and r["mode"] == "float32" and "total_s" in r), None)
        print(f"\nbatch {B}")
        print(
            f"{'engine':8} {'mode':13} {'prefill tok/s':>13} {'decode tok/s':>12} {'vs attnkit f32':>14} "
            f"{'agree HF f32':>12}  quality"
        )
        for r in brows:
            if "error" in r:
                print(f"{r['engine']:8} {r['mode']:13} failed: {r['error']}")
                continue
            pre, dec = r["prefill_tok_s"], r["decode_tok_s"]
            vs = f"{dec / f32['decode_tok_s']:.2f}x" if f32 else "-"
            q = f"ppl {r['ppl']:.3f} (f32 {r['ppl_float32']:.3f}), top-1 {r['top1']:.3f}" if "ppl" in r else ""
            print(f"{r['engine']:8} {r['mode']:13} {pre:13.1f} {dec:12.1f} {vs:>14} {r['agree']:12.3f}  {q}")
        if f32 and "products" in f32:
            print(f32["products"])
        results += brows
    if args.out:
        for r in results:
            r.pop("tokens", None)
        Path(args.out).write_text(json.dumps({"load": load, "args": vars(args), "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

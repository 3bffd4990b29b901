"""The machine a measured choice holds for, and the small JSON files that keep such choices between processes.

Some of attnkit's choices are measured, not read off a table (which kernel streams a decode product fastest:
``attnkit.nn._products``; how many threads a decode step runs at: ``attnkit._threads``).  A measurement holds for the machine it ran on, so it is stored under a key of that
machine, :func:`machine`: the CPU's model name, its core count, the instruction-set extensions the kernels
dispatch on (AVX2, AVX-512 and its VNNI / bf16 parts, AMX; NEON/SVE on ARM), and torch's version and BLAS /
oneDNN build.  A new process on the same machine reads the stored choice instead of timing again; another
machine, another torch or another BLAS finds no file of its own and measures.

Where: one JSON file per kind of choice and machine, ``<kind>-<machine id>.json`` in :func:`cache_dir` (the
decode-time choices, products' kernels and thread counts, share the kind :data:`DECODE`):
``$ATTNKIT_CACHE_DIR`` when set (set to the empty string, nothing is read or written: every process
measures), else ``$XDG_CACHE_HOME/attnkit``, else ``~/.cache/attnkit``.  A file is written whole to a
temporary file beside it and moved into place (``os.replace``), so a reader never sees half of one; a missing,
unreadable or malformed file, or one of another machine, reads as empty, and a directory that cannot be
written leaves the choices to the process that measured them.  Nothing here raises on a file's account.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import tempfile
from pathlib import Path

import torch

ENV = "ATTNKIT_CACHE_DIR"
FORMAT = 1  # the files' format; a file of another format reads as empty
DECODE = "decode-choices"  # the kind of the decode-time choices (products' kernels, thread counts): one file

# the CPU flags (Linux's /proc/cpuinfo names) that decide which kernels a BLAS or oneDNN dispatches to
_ISA = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
)


def cache_dir() -> Path | None:
    """The folder of the stored choices: ``$ATTNKIT_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnkit``, else
    ``~/.cache/attnkit``; None when ``ATTNKIT_CACHE_DIR`` is set to the empty string (store nothing)."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return Path(chosen).expanduser() if chosen.strip() else None
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "attnkit"


def _cpuinfo() -> tuple[str, list[str]]:
    """The CPU's model name and its flags among :data:`_ISA`, from /proc/cpuinfo where there is one."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name in ("model name", "cpu model", "hardware") and not model:
                    model = value.strip()
                elif name in ("flags", "features"):
                    flags.update(value.split())
                elif not line.strip() and model and flags:
                    break  # (the first processor's block says it all)
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), sorted(flags.intersection(_ISA))


def _torch_build() -> dict[str, str]:
    """torch's version and the math libraries it was built with (their versions)."""
    shown = torch.__config__.show()
    libraries = [
        line.strip(" -")
        for line in shown.splitlines()
        if any(word in line for word in ("Math Kernel Library", "MKL-DNN", "oneDNN", "OpenBLAS", "OpenMP"))
    ]
    blas = re.search(r"BLAS_INFO=([^,\s]+)", shown)
    return {
        "torch": torch.__version__,
        "blas": blas.group(1) if blas else "",
        "libraries": "; ".join(libraries),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


@functools.cache
def machine() -> dict[str, object]:
    """What a measured choice holds for: the CPU (model name, cores, instruction-set flags) and torch's build.

    Example::

        >>> from attnkit._machine import machine
        >>> sorted(machine())
        ['blas', 'capability', 'cores', 'cpu', 'isa', 'libraries', 'torch']
    """
    model, isa = _cpuinfo()
    return {"cpu": model, "cores": os.cpu_count() or 0, "isa": isa, **_torch_build()}


def machine_id(key: dict[str, object] | None = None) -> str:
    """A short digest of :func:`machine` (or of ``key``): the part of a file's name that tells machines apart."""
    text = json.dumps(machine() if key is None else key, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(kind: str) -> Path | None:
    """The file of this machine's stored choices of ``kind``; None when storing is off (``ATTNKIT_CACHE_DIR=""``)."""
    folder = cache_dir()
    return None if folder is None else folder / f"{kind}-{machine_id()}.json"


def load(kind: str) -> dict[str, dict]:
    """This machine's stored choices of ``kind`` (choice key -> its record); empty when storing is off or the
    file is missing, unreadable, malformed, of another format or of another machine."""
    where = path(kind)
    if where is None:
        return {}
    try:
        with open(where, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if (
        not isinstance(data, dict)
        or data.get("format") != FORMAT
        or data.get("machine") != json.loads(json.dumps(machine()))
        or not isinstance(data.get("choices"), dict)
    ):
        return {}
    return {k: v for k, v in data["choices"].items() if isinstance(k, str) and isinstance(v, dict)}


def save(kind: str, choices: dict[str, dict]) -> str | None:
    """Writes ``choices`` (choice key -> a JSON-able record) as this machine's stored choices of ``kind``,
    whole or not at all.  Returns None when written (or when storing is off), else why not (the folder
    cannot be made or written, the disk is full): the caller keeps its choices for itself."""
    where = path(kind)
    if where is None:
        return None
    text = json.dumps({"format": FORMAT, "machine": machine(), "choices": choices}, indent=1, sort_keys=True)
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{where.name}.", suffix=".tmp", dir=where.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, where)
        return None
    except OSError as e:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return f"could not write {where}: {e.strerror or e}"


def merge(kind: str, new: dict[str, dict]) -> tuple[dict[str, dict], str | None]:
    """Adds ``new`` to this machine's stored choices of ``kind``, read again first (another process, or another
    kind of choice sharing the file, may have added its own since); returns the records now stored and
    :func:`save`'s answer (None when written or storing is off, else why not)."""
    records = {**load(kind), **new}
    return records, save(kind, records)


def remove(kind: str) -> Path | None:
    """Deletes this machine's stored choices of ``kind``; returns the file's path if there was one."""
    where = path(kind)
    if where is None:
        return None
    try:
        where.unlink()
    except OSError:
        return None
    return where

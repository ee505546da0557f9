"""Build, cache and load the compiled CPU kernels (kernels/cpu_src/) through ctypes.

The shared library is compiled with the system C++ compiler (``$CXX``, default ``g++``) on
first use, into ``$MEGASERVE_CACHE/cpu_ext/<isa>-<hash>/`` (default cache:
~/.cache/megaserve); the hash covers the source, the flags and the compiler's version, so a
changed source builds anew and an unchanged one loads in milliseconds. Concurrent
processes (parallel pytest workers, spawned servers) serialise on an ``flock`` of a lock
file next to the library: the first one builds, the others wait and load its result; the
library is written under a temporary name and renamed into place, so no process ever
loads a half-written file, and a builder killed mid-way leaves no stale lock (the kernel
drops an ``flock`` with its holder).

Bits do not depend on the machine: the flags fix the arithmetic (``-ffp-contract=off``, no
``-ffast-math``, no ``-march=native``); the ISA flags (``avx512`` / ``avx2`` / ``baseline``,
picked from torch's CPU capability or ``$MEGASERVE_CPU_ISA``) only widen the vectors and
make the sources' explicit fused multiply-adds one instruction (the baseline build calls
libm's correctly rounded ``fmaf``: the same bits, much slower; see the header of
cpu_src/common.h). torch reports AVX2 and AVX512 only on CPUs with FMA3, so the picked
build always runs; ``$MEGASERVE_CPU_ISA`` must not name a build the CPU lacks. Raises :class:`CpuKernelBuildError` when no compiler is found
or the build fails; there is no fallback.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("cpu_src")  # *.cpp compiled into one library, common.h
# Arithmetic-fixing flags: never add -ffast-math, -march=native or FMA contraction here
# (-mfma only makes the sources' explicit fused multiply-adds one instruction).
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
              "-fno-fast-math", "-fno-math-errno")
ISA_FLAGS = {
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma"),
    "avx2": ("-mavx2", "-mfma"),
    "baseline": (),
}

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SIGNATURES = {
    "ms_linear": [_P, _I64, _I64, _P, _I64, _P, _P, _INT],
    "ms_expert_ffn": [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _INT],
    "ms_rms_norm": [_P, _P, _P, _I64, _I64, _F32, _P, _P, _INT],
    "ms_log_softmax": [_P, _I64, _I64, _P, _INT],
    "ms_topk_route": [_P, _I64, _I64, _I64, _INT, _P, _P, _INT],
    "ms_combine": [_P, _P, _I64, _I64, _I64, _P, _INT],
    "ms_rotary_and_cache": [_P, _P, _P, _P, _I64, _P, _P, _F32, _P, _P, _P, _I64, _I64, _I64,
                            _I64, _P, _INT],
    "ms_paged_attention_f32": [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                               _I64, _F32, _P, _INT],
    "ms_paged_attention_bf16": [_P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                                _I64, _F32, _P, _INT],
}

_lib: ctypes.CDLL | None = None


class CpuKernelBuildError(RuntimeError):
    """The compiled CPU kernels could not be built or loaded."""


def default_isa() -> str:
    """``$MEGASERVE_CPU_ISA`` if set, else the widest of ISA_FLAGS this CPU runs."""
    isa = os.environ.get("MEGASERVE_CPU_ISA")
    if isa:
        if isa not in ISA_FLAGS:
            raise ValueError(f"MEGASERVE_CPU_ISA={isa!r}: expected one of {sorted(ISA_FLAGS)}")
        return isa
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "baseline")


def cache_dir() -> Path:
    return Path(os.environ.get("MEGASERVE_CACHE", Path.home() / ".cache" / "megaserve")) / "cpu_ext"


def library_path(isa: str) -> Path:
    """Where the library for ``isa`` lives (built or not); raises CpuKernelBuildError
    when no compiler is found or the source is missing."""
    files = _source_files()
    compiler = compiler_path()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False).stdout
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    for part in (" ".join(compile_flags(isa)).encode(), version.encode()):
        digest.update(part)
    return cache_dir() / f"{isa}-{digest.hexdigest()[:16]}" / "megaserve_cpu_ext.so"


def build(isa: str) -> Path:
    """Compile the library for ``isa`` unless it is cached; returns its path."""
    path = library_path(isa)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if path.is_file():  # another process built it while we waited
            return path
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        sources = [str(f) for f in _source_files() if f.suffix == ".cpp"]
        cmd = [compiler_path(), *compile_flags(isa), *sources, "-o", str(tmp)]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise CpuKernelBuildError(
                f"compiling the CPU kernels failed ({' '.join(cmd)}):\n{out.stderr[-4000:]}")
        os.replace(tmp, path)
        logger.info("built the CPU kernels (%s) in %.1f s: %s", isa, time.perf_counter() - start,
                    path)
    return path


def load(isa: str | None = None) -> ctypes.CDLL:
    """The loaded library (built on first use); the ``isa=None`` one is kept per process."""
    global _lib
    if isa is None and _lib is not None:
        return _lib
    lib = ctypes.CDLL(str(build(isa or default_isa())))
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    lib.ms_panel_width.argtypes, lib.ms_panel_width.restype = [], ctypes.c_int
    lib.ms_expert_ffn.restype = lib.ms_rotary_and_cache.restype = ctypes.c_int
    if isa is None:
        _lib = lib
    return lib


def _source_files() -> list[Path]:
    files = sorted(SOURCE_DIR.glob("*.cpp")) + sorted(SOURCE_DIR.glob("*.h"))
    if not any(f.suffix == ".cpp" for f in files):
        raise CpuKernelBuildError(
            f"no kernel sources in {SOURCE_DIR}: this install of megaserve lacks the CPU "
            "kernels' source (install from the repository, e.g. `pip install -e .`)")
    return files


def compile_flags(isa: str) -> list[str]:
    """The compiler flags of the ``isa`` build (``ISA_FLAGS``' keys)."""
    return [*BASE_FLAGS, *ISA_FLAGS[isa]]


def compiler_path() -> str:
    """The C++ compiler (``$CXX``, default g++) on PATH; CpuKernelBuildError without one."""
    name = os.environ.get("CXX", "g++")
    path = shutil.which(name)
    if path is None:
        raise CpuKernelBuildError(
            f"the CPU kernels need a C++ compiler and {name!r} was not found on PATH: "
            "install one (e.g. `apt-get install g++`) or point $CXX at it")
    return path

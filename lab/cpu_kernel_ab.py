"""A/B of CPU kernel sources: builds each ``NAME=DIR`` (a copy of kernels/cpu_src) with the
extension's flags into its own library, loads them side by side and times the expert FFN
and the paged attention of each in alternation on the same inputs (medians), checking
that every build writes the same bits.

    mkdir /tmp/old && git archive HEAD~1 kernels/cpu_src | tar -x -C /tmp/old
    python lab/cpu_kernel_ab.py old=/tmp/old/kernels/cpu_src new=kernels/cpu_src

Shapes: the tiny Mixtral of ``megaserve bench cpu`` (8 experts, hidden 256, expert width
512, top-2; 8 query heads over 2 KV heads of 32). The FFN cycles 4 layers' weights, as a
decode step does; attention runs a decode step and 64-token prefill chunks of 64 sequences.
The weights are packed as this checkout's kernels read them (cpu.packed_gate_up,
cpu.packed): sources with another packed layout give other expert FFN bits.
"""

from __future__ import annotations

import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megaserve.kernels import cpu, cpu_ext


def build(name: str, src: Path, out_dir: Path) -> ctypes.CDLL:
    out = out_dir / f"{name}.so"
    sources = sorted(str(f) for f in src.glob("*.cpp"))
    flags = cpu_ext.compile_flags(cpu_ext.default_isa())
    subprocess.run([cpu_ext.compiler_path(), *flags, *sources,
                    "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    for fn_name, argtypes in cpu_ext.SIGNATURES.items():
        if hasattr(lib, fn_name):  # an older source may lack a kernel
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = argtypes, None
    lib.ms_expert_ffn.restype = ctypes.c_int
    return lib


def alternate(libs: dict, call, rounds: int = 7, seconds: float = 0.3) -> dict:
    """Median seconds a call of each library over ``rounds`` alternations."""
    times = {name: [] for name in libs}
    for _ in range(rounds):
        for name, lib in libs.items():
            start, count = time.perf_counter(), 0
            while time.perf_counter() - start < seconds:
                count += call(name, lib)
            times[name].append((time.perf_counter() - start) / count)
    return {name: statistics.median(t) for name, t in times.items()}


def expert_ffn(libs: dict) -> None:
    e, d, inter, layers = 8, 256, 512, 4
    weights = [(cpu.packed_gate_up(torch.randn(e, 2 * inter, d) * 0.02),
                cpu.packed(torch.randn(e, d, inter) * 0.02)) for _ in range(layers)]
    for rows in (128, 2):  # a 64-sequence decode step's routed rows; a lone request's
        x, ids = torch.randn(rows, d), torch.randint(0, e, (rows,))
        outs = {name: torch.full((rows, d), float("nan")) for name in libs}

        def call(name, lib):
            for gate_up, down in weights:
                lib.ms_expert_ffn(x.data_ptr(), ids.data_ptr(), rows, d, inter, e,
                                  gate_up.data_ptr(), down.data_ptr(), outs[name].data_ptr(),
                                  cpu.EXPERT_ROW_TILE, 1)
            return layers

        _report(f"expert FFN, {rows} rows", alternate(libs, call), outs)


def attention(libs: dict) -> None:
    seqs, hq, hkv, dh, bs, blocks_per_seq = 64, 8, 2, 32, 16, 16
    for new, ctx in ((1, 96), (64, 64)):
        blocks = seqs * blocks_per_seq
        caches = [torch.randn(blocks, bs, hkv, dh) for _ in range(2)]
        tables = torch.randperm(blocks).int().view(seqs, blocks_per_seq).contiguous()
        lens = torch.full((seqs,), ctx, dtype=torch.int32)
        starts = (torch.arange(seqs + 1, dtype=torch.int32) * new).int()
        q = torch.randn(seqs * new, hq, dh)
        outs = {name: torch.full((seqs * new, hq, dh), float("nan")) for name in libs}

        def call(name, lib):
            lib.ms_paged_attention_f32(q.data_ptr(), caches[0].data_ptr(), caches[1].data_ptr(),
                                       tables.data_ptr(), blocks_per_seq, lens.data_ptr(),
                                       starts.data_ptr(), seqs, seqs * new, hq, hkv, dh, bs,
                                       dh**-0.5, outs[name].data_ptr(), 1)
            return 1

        _report(f"attention, {seqs} x {new} new of {ctx}", alternate(libs, call, seconds=0.2),
                outs)


def _report(what: str, times: dict, outs: dict) -> None:
    first = next(iter(outs.values()))
    same = all(torch.equal(o, first) for o in outs.values()) and not first.isnan().any()
    print(f"{what}: " + "  ".join(f"{n} {t * 1e6:,.0f} us" for n, t in times.items())
          + f"  (bits equal: {same})")


def main() -> None:
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {name: build(name, Path(src), Path(tmp))
                for name, src in (arg.split("=", 1) for arg in sys.argv[1:])}
        if not libs:
            sys.exit("usage: cpu_kernel_ab.py NAME=DIR [NAME=DIR ...]")
        expert_ffn(libs)
        attention(libs)


if __name__ == "__main__":
    main()

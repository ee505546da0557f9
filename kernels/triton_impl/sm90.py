"""Compiles for an H100/H200 (sm_90) on any machine, GPU or not, with Triton's bundled
ptxas: what a Triton or Gluon kernel costs in registers, spilled bytes and shared memory
at a launch, and whether its tensor-core instructions survived (``fp8_bench
--resources``, lab/kernel_resources.py, the sm_90 compile tests in tests/kernels)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import mangle_type

_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@dataclass(frozen=True)
class Sm90Build:
    """One compiled launch: registers a thread, stack bytes (spills: 0 where nothing
    spills), shared memory bytes a program, its SASS and TTGIR."""

    regs: int
    stack: int
    smem: int
    sass: str
    ttgir: str

    def count(self, opcode: str) -> int:
        """Occurrences of ``opcode`` in the SASS (e.g. "QGMMA": FP8 wgmma, "HGMMA": bf16)."""
        return self.sass.count(opcode)


def compile_sm90(fn, args: dict, constexprs: dict, *, num_warps: int = 4,
                 num_stages: int = 3, maxnreg: int | None = None,
                 divisible: tuple[str, ...] = ()) -> Sm90Build:
    """Compile ``fn`` (``triton.jit`` or ``gluon.jit``) for sm_90.

    args: every non-constexpr argument by name, as a type string ("*bf16", "i32", "fp32")
    or an example value (a tensor on any device, an int, a TensorDescriptor; None for an
    absent optional one), specialised as a launch would: pointers and example ints that
    are multiples of 16 count as 16-divisible, and so do the arguments named in
    ``divisible``; an example int of 1 becomes the constant 1, as the JIT makes it.
    constexprs: the constexpr arguments by name."""
    sig, attrs, const = {}, {}, {}
    for name, value in args.items():
        index = fn.arg_names.index(name)
        if value is None or (isinstance(value, int) and not isinstance(value, bool)
                             and value == 1):
            sig[name], const[(index,)] = "constexpr", value
            continue
        sig[name] = value if isinstance(value, str) else mangle_type(value)
        if (sig[name].startswith("*") or name in divisible  # a tensor's type is "*<dtype>"
                or (isinstance(value, int) and value % 16 == 0)):
            attrs[(index,)] = [["tt.divisibility", 16]]
    for name, value in constexprs.items():
        sig[name], const[(fn.arg_names.index(name),)] = "constexpr", value
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    options = dict(num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(source(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    return Sm90Build(regs=int(m[1]), stack=int(m[2]), smem=compiled.metadata.shared,
                     sass=sass, ttgir=compiled.asm["ttgir"])

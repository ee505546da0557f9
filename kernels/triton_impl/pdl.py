"""Programmatic dependent launch (PDL, Hopper and later): a kernel's programs start while
the kernel before it on the stream is finishing, and wait for it in hardware.

A decode step at batch 1 is ~12 short kernels per layer; most of each boundary is the
next grid's launch and ramp-up, not work. With PDL the next grid is launched as soon as
every program of the current one has started (``gdc_launch_dependents``), and each of its
programs blocks in ``gdc_wait`` until the previous grid has completed and its memory is
visible. Nothing changes a single bit: every kernel still reads its inputs only after
``gdc_wait``, so the order of all memory operations is the stream order.

Usage, in every kernel a PDL launch may start early::

    @triton.jit
    def _kernel(..., PDL: tl.constexpr):
        pdl.wait_then_release(PDL)  # first statement: no load or store before it
        ...

    _kernel[grid](..., **pdl.launch_args(device))

NOTE: a kernel launched with ``launch_pdl`` calls :func:`wait_then_release` before it
writes anything and before it reads anything the kernel just before it may write; a grid
launched early that did otherwise would race with its predecessor. A grid starts only
once every program of the kernel before it has passed its own wait, so every kernel two
or more launches back has completed: a kernel may *read* before its wait what only those
kernels, or the host, write. (A program that exits before its wait counts as having
passed it: a grid may skip the wait in some programs only while others in it always
wait, which is why decode attention's fold waits even where it has nothing to fold.)
The kernels that read before their wait read weights, tables (cos/sin), a decode step's
input columns (positions, slots, context lengths, block tables: copied in before the
step, or computed at its start) and the routing of the kernel two launches back:
rotary_and_cache, decode attention and its fold (``one_token_per_seq``), and the expert
FFN's down GEMM (moe's EARLY_IDS). Kernels of
other libraries (torch) never get the attribute: they start after their predecessor
completes, as always. Gluon kernels call :func:`gluon_wait_then_release` first, before
their partitions start (every thread of the program waits).

A module whose kernels take PDL one by one (what gained in a measured run) names them in
a set that :func:`named_launch_args` reads, with an environment variable that replaces
the set for tuning runs (moe's ``$MEGASERVE_MOE_PDL``, the FP8 kernels'
``$MEGASERVE_FP8_PDL``).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "MEGASERVE_PDL"  # "0" turns PDL off (A/B runs); on by default where supported


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """Wait for the previous grid on the stream, then let the next one launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@gluon.jit
def gluon_wait_then_release(PDL: gl.constexpr):
    """:func:`wait_then_release` in a Gluon kernel (the same two PTX instructions)."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: CUDA, compute capability 9.0 or later, not
    under the Triton interpreter, and ``$MEGASERVE_PDL`` is not "0"."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_args(device: torch.device) -> dict:
    """Keyword arguments of a launch of a kernel that calls :func:`wait_then_release`."""
    on = enabled(device)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


def named_launch_args(device: torch.device, name: str, names: frozenset[str], env: str) -> dict:
    """:func:`launch_args` for kernel ``name`` if it is in ``names`` (``$env``, comma-separated
    names, replaces the set where set), else a launch without PDL."""
    text = os.environ.get(env)
    on = name in (names if text is None else set(text.split(",")))
    return launch_args(device) if on else {"PDL": False}


__all__ = ["ENV", "enabled", "gluon_wait_then_release", "launch_args", "named_launch_args",
           "wait_then_release"]

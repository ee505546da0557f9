"""Batch-invariant linear (``x @ W.T``) on CUDA through Triton, with TMA descriptors.

Shape legend: M = rows (tokens), K = reduction, N = output features.

NOTE: the reduction order of one output element is fixed by (N, K, dtype) alone:

    K ──┬── split 0 ──┬── split 1 ──┬ ... ┬── split S-1 ──┐   S = cdiv(K, split_len)
        │ BLOCK_K steps│ BLOCK_K steps│     │               │   (split_len from N, K only)
        part_0          part_1                part_{S-1}       fp32, tensor-core dots
    total = ((part_0 + part_1) + part_2) + ... + part_{S-1}      fp32, ascending s
    out   = cast(total (+ bias))

Two launch modes compute exactly that, bit for bit, with the same tile config (same MMA
instructions) and differ only in where the parts live:

* **fold** (many rows): one program per output tile walks the splits and folds each part
  into ``total`` in registers;
* **split** (few rows, where one program per tile would leave most SMs idle): one program
  per (tile, split) stores its part (fp32) to a workspace; the last program to finish a
  tile (an atomic counter) loads the S parts and folds them in the same ascending order;
* **swap** (decode, M <= 64): split mode with the MMA operands swapped (weight rows are
  the MMA's M side, the few tokens its N side, padded to a power of two >= 16).

Swap mode relies on one hardware fact, checked bitwise on the device by the GPU tests: a
tensor-core k16 step rounds each output element the same way whatever the instruction's
M/N tile shape and operand roles (the products are exact in fp32; only their sum with
the accumulator is rounded, per element).

Choosing the mode from M is allowed because it does not change a single rounding step;
the tile shape, split length and fold order never depend on M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# Programs we want in flight for a memory-bound (small M) product: about two per SM of
# an H100/H200. A constant, so the split length is a function of (N, K) only.
_TARGET_PROGRAMS = 256
_MIN_SPLIT_STEPS = 4  # each split runs at least this many BLOCK_K steps


@dataclass(frozen=True)
class MatmulConfig:
    """Fixed tiling for one (N, K, dtype) family; never derived from M."""

    block_m: int
    block_n: int
    block_k: int
    split_len: int  # multiple of block_k
    num_warps: int
    num_stages: int
    group_m: int = 8
    flat: int = 2  # fold-loop shape (0 nested, 1/2 flat); never changes the arithmetic
    # Swap mode (M <= swap_max_m): weight rows per program, warps, pipeline depth.
    swap_max_m: int = 64  # 128 measured slower (round 3): 0.19-0.62x cuBLAS at M = 128
    swap_block_f: int = 128
    swap_warps: int = 4
    swap_stages: int = 4

    def __post_init__(self) -> None:
        if self.split_len % self.block_k:
            raise ValueError(f"split_len {self.split_len} must be a multiple of {self.block_k}")
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")


def config_for(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The one tiling used for every M with weights `[n, k]` of ``dtype``."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear supports bfloat16/float16 on CUDA, got {dtype}")
    block_m, block_n, block_k = 128, 128, 64
    tiles_n = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles_n), steps // _MIN_SPLIT_STEPS))
    split_len = triton.cdiv(steps, splits) * block_k
    return MatmulConfig(block_m, block_n, block_k, split_len, num_warps=8, num_stages=4)


@triton.jit
def _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_hi,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 `[BLOCK_M, BLOCK_N]` = A[off_m:, k_lo:k_hi] @ B[off_n:, k_lo:k_hi].T."""
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_lo, k_hi, BLOCK_K):
        a = a_desc.load([off_m, kk])
        b = b_desc.load([off_n, kk])
        part = tl.dot(a, b.T, part)
    return part


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped (L2-friendly) order of output tiles; only placement, never arithmetic."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm,
               HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        total = total + bias[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
             total.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _linear_fold_kernel(a_desc, b_desc, c_ptr, bias_ptr, M, N, K, stride_cm,
                        SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, FLAT: tl.constexpr):
    off_m, off_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    if FLAT == 0:
        # One pipelined loop per split (the pipeline drains at every split boundary).
        total = _split_part(a_desc, b_desc, off_m, off_n, 0, SPLIT_LEN,
                            BLOCK_M, BLOCK_N, BLOCK_K)
        for k_lo in range(SPLIT_LEN, K, SPLIT_LEN):
            part = _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_lo + SPLIT_LEN,
                               BLOCK_M, BLOCK_N, BLOCK_K)
            total = total + part
    else:
        # One flat pipelined loop; the part restarts at each split and is folded at its
        # end. Same arithmetic as above: total = part_0, then total + part_s.
        STEPS: tl.constexpr = SPLIT_LEN // BLOCK_K
        num_steps = tl.cdiv(K, BLOCK_K)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, num_steps):
            a = a_desc.load([off_m, step * BLOCK_K])
            b = b_desc.load([off_n, step * BLOCK_K])
            if FLAT == 1:
                part = tl.dot(a, b.T, tl.where(step % STEPS == 0, 0.0, part))
            else:
                part = tl.dot(a, b.T, part)
            if (step % STEPS == STEPS - 1) | (step == num_steps - 1):
                total = tl.where(step < STEPS, part, total + part)
                if FLAT == 2:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _linear_split_kernel(a_desc, b_desc, c_ptr, bias_ptr, ws_ptr, count_ptr, M, N, K, stride_cm,
                         NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_m, off_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = split * SPLIT_LEN
    part = _split_part(a_desc, b_desc, off_m, off_n, k_lo, k_lo + SPLIT_LEN,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    # ws: [NUM_SPLITS, M, N] float32
    offs = rows[:, None] * N + cols[None, :]
    tl.store(ws_ptr + split * M * N + offs, part, mask=mask)
    # Every thread's stores precede the counter bump (barrier, then a gpu-scope release).
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        # Last program of this tile: fold the parts in ascending split order (L2 reads).
        total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in range(1, NUM_SPLITS):
            total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0,
                                    cache_modifier=".cg")
        _store_out(total, c_ptr, bias_ptr, off_m, off_n, M, N, stride_cm, HAS_BIAS,
                   BLOCK_M, BLOCK_N)
        tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


@triton.jit
def _linear_swap_kernel(w_desc, x_desc, c_ptr, bias_ptr, ws_ptr, count_ptr, M, N, K, stride_cm,
                        NUM_SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_F: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Split mode with the operands swapped, for M <= BLOCK_T (decode): the weight tile
    `[BLOCK_F, BLOCK_K]` is the MMA's A operand and the few token rows its B operand, so
    no MMA rows are wasted on padding. Per output element it performs the same chain of
    k16 products per split and the same ascending fold as the other modes (see NOTE)."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    off_n = tile * BLOCK_F
    k_lo = split * SPLIT_LEN
    part = tl.zeros((BLOCK_F, BLOCK_T), dtype=tl.float32)
    for kk in range(k_lo, tl.minimum(k_lo + SPLIT_LEN, K), BLOCK_K):
        w = w_desc.load([off_n, kk])
        x = x_desc.load([0, kk])
        part = tl.dot(w, x.T, part)  # [BLOCK_F, BLOCK_T] fp32
    feats = off_n + tl.arange(0, BLOCK_F)
    toks = tl.arange(0, BLOCK_T)
    mask = (feats[:, None] < N) & (toks[None, :] < M)
    # ws: [NUM_SPLITS, N, M] float32, feature-major so that the MMA layout's neighbouring
    # token columns land in neighbouring addresses.
    offs = feats[:, None] * M + toks[None, :]
    tl.store(ws_ptr + split * M * N + offs, part, mask=mask)
    tl.debug_barrier()
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if done == NUM_SPLITS - 1:
        # Unrolled, so every part's load can be in flight before the ascending-order adds.
        total = tl.load(ws_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, NUM_SPLITS):
            total = total + tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0,
                                    cache_modifier=".cg")
        if HAS_BIAS:
            bias = tl.load(bias_ptr + feats, mask=feats < N, other=0.0).to(tl.float32)
            total = total + bias[:, None]
        tl.store(c_ptr + toks[None, :] * stride_cm + feats[:, None],
                 total.to(c_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, reset by the kernel itself after use.

    NOTE: shared per device: two split launches must not run concurrently on different
    streams of one device.
    """
    buf = _counters.get(device)
    if buf is None or buf.numel() < num_tiles:
        buf = torch.zeros(max(num_tiles, 1024), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def use_split_mode(m: int, n: int, k: int, cfg: MatmulConfig, num_sms: int = 132) -> bool:
    """Launch choice only (both modes give identical bits): a rough time estimate of each.

    fold: waves of output tiles, each walking all of K. split: waves of (tile, split)
    programs plus the fp32 parts written and read back (2 * S * M * N * 4 bytes).
    """
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    splits = triton.cdiv(k, cfg.split_len)
    step_us = 2 * cfg.block_m * cfg.block_n * cfg.block_k / 5.0e6  # ~5 TFLOP/s per SM
    fold_us = triton.cdiv(tiles, num_sms) * triton.cdiv(k, cfg.block_k) * step_us
    split_us = (triton.cdiv(tiles * splits, num_sms) * (cfg.split_len // cfg.block_k) * step_us
                + 2 * splits * m * n * 4 / 2.5e6)
    return split_us < fold_us


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           *, mode: str | None = None, config: MatmulConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, fp32 accumulation, bitwise row-invariant.

    x: `[M, K]` bf16/fp16 (any leading-dim stride, unit last stride); weight: `[N, K]`
    same dtype; bias: `[N]` or None. Returns `[M, N]` in x.dtype. ``mode`` ('fold' or
    'split' or 'swap') forces a launch mode and ``config`` a tiling, for tests and tuning;
    the launch mode never changes the bits (checked bitwise on an H200 by
    tests/kernels/test_triton_gpu.py).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: shapes {tuple(x.shape)} and {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or config_for(n, k, x.dtype)
    # TMA needs a unit last stride, 16-byte aligned rows and base address.
    if x.stride(1) != 1 or (x.stride(0) * x.element_size()) % 16 or x.data_ptr() % 16:
        x = x.contiguous()
    if weight.stride(1) != 1 or (weight.stride(0) * weight.element_size()) % 16:
        raise ValueError(f"linear: weight rows must be contiguous and 16-byte aligned (K={k})")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    bias_arg = bias if bias is not None else out
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    num_splits = triton.cdiv(k, cfg.split_len)
    if mode is None:
        if m <= cfg.swap_max_m:
            mode = "swap"
        else:
            mode = "split" if num_splits > 1 and use_split_mode(m, n, k, cfg) else "fold"
    if mode == "swap":
        if m > cfg.swap_max_m:
            raise ValueError(f"linear: swap mode takes at most {cfg.swap_max_m} rows, got {m}")
        block_t = max(16, triton.next_power_of_2(m))
        x_desc = TensorDescriptor.from_tensor(x, [block_t, cfg.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [cfg.swap_block_f, cfg.block_k])
        tiles_f = triton.cdiv(n, cfg.swap_block_f)
        ws = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles_f)
        _linear_swap_kernel[(tiles_f, num_splits)](
            w_desc, x_desc, out, bias_arg, ws, counters, m, n, k, out.stride(0),
            NUM_SPLITS=num_splits, SPLIT_LEN=cfg.split_len, HAS_BIAS=bias is not None,
            BLOCK_F=cfg.swap_block_f, BLOCK_T=block_t, BLOCK_K=cfg.block_k,
            num_warps=cfg.swap_warps, num_stages=cfg.swap_stages)
        return out
    a_desc = TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if mode == "fold":
        _linear_fold_kernel[(tiles,)](a_desc, b_desc, out, bias_arg, m, n, k, out.stride(0),
                                      SPLIT_LEN=cfg.split_len, FLAT=cfg.flat, **common)
    elif mode == "split":
        ws = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles)
        _linear_split_kernel[(tiles, num_splits)](
            a_desc, b_desc, out, bias_arg, ws, counters, m, n, k, out.stride(0),
            NUM_SPLITS=num_splits, SPLIT_LEN=cfg.split_len, **common)
    else:
        raise ValueError(f"linear: mode must be 'fold' or 'split', got {mode!r}")
    return out

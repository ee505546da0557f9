"""Batch-invariant linear (``x @ W.T``) on CUDA through Triton, with TMA descriptors.

Shape legend: M = rows (tokens), K = reduction, N = output features.

NOTE: the reduction order of one output element is fixed by (N, K, dtype) alone:

    K ──┬── split 0 ──┬── split 1 ──┬ ... ┬── split S-1 ──┐   S = cdiv(K, split_len)
        │ BLOCK_K steps│ BLOCK_K steps│     │               │   (split_len from N, K only)
        part_0          part_1                part_{S-1}       fp32, tensor-core dots
    total = ((part_0 + part_1) + part_2) + ... + part_{S-1}      fp32, ascending s
    out   = cast(total (+ bias))

Three launch modes compute exactly that, bit for bit, and differ only in tile shapes,
operand roles and where the parts live:

* **fold** (many rows): one program per output tile walks the splits and folds each part
  into ``total`` in registers;
* **split** (few rows, where one program per tile would leave most SMs idle): one program
  per (tile, split) stores its part (fp32) to a workspace; the last program to finish a
  tile (an atomic counter), or a second, fully parallel fold kernel, loads the S parts
  and folds them in the same ascending order;
* **swap** (decode, M <= 64): split mode with the MMA operands swapped (weight rows are
  the MMA's M side, the few tokens its N side, padded to a power of two >= 16).

Swap mode relies on one hardware fact, checked bitwise on the device by the GPU tests: a
tensor-core k16 step rounds each output element the same way whatever the instruction's
M/N tile shape and operand roles (the products are exact in fp32; only their sum with
the accumulator is rounded, per element).

The same fact lets the tile shape (64 or 128 rows, 64 or 128 columns, swapped or not) and
the launch (grid, warps, stages, persistent or not) depend on M: none of them changes a
single rounding step. So may a launch's K step (``Launch.block_k``, a divisor of the split
length): a dot over 128 of K is the same chain of eight k16 steps as two dots over 64.
The split length, the config's BLOCK_K and the fold order never depend on M.

Families with small K (K <= ``SmallKRule.max_k``) take their split length and decode
launches from one measured rule (``SMALL_K_RULE``; lab/matmul_smallk.py and
lab/linear_decode.py measure it):
with only 16-64 K steps, fewer, longer splits (at most one program per SM) beat the
generic rule's many short ones.
``plan_launch`` picks the launch from (M, N, K) with measured rules
(docs/benchmarks.md in git history).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from . import matmul_kernels as mk
from . import pdl
from .parts import Parts
from .rowwise import rms_norm

# Programs we want in flight for a memory-bound (small M) product: about two per SM of
# an H100/H200. A constant, so the split length is a function of (N, K) only.
_TARGET_PROGRAMS = 256
_MIN_SPLIT_STEPS = 4  # each split runs at least this many BLOCK_K steps
_MODES = ("fold", "split", "swap")
SWAP_MAX_M = 128  # the token tile of swap mode is at most 128 wide


@dataclass(frozen=True)
class MatmulConfig:
    """The arithmetic of one (N, K, dtype) family: K step and split length; never from M."""

    block_k: int
    split_len: int  # multiple of block_k

    def __post_init__(self) -> None:
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k={self.block_k} must be a power of two >= 16")
        if self.split_len <= 0 or self.split_len % self.block_k:
            raise ValueError(f"split_len {self.split_len} must be a positive multiple of "
                             f"{self.block_k}")


@dataclass(frozen=True)
class Launch:
    """How one product is launched. May depend on M; never changes a bit of the result.

    block_m: rows per tile (swap mode: weight rows per tile); block_n: columns per tile
    (fold/split). fold_last (split/swap): the last program of a tile folds the parts
    (atomic counter) instead of a second, parallel fold kernel. persistent (fold): grid
    of that many programs looping over tiles (0 = one program per tile); flatten: let
    Triton flatten that loop nest. flat: fold-loop shape (0 nested, 1/2 flat).
    """

    mode: str
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8
    flat: int = 2
    fold_last: bool = True
    persistent: int = 0
    flatten: bool = False
    block_k: int = 0  # K step of this launch; 0 = the config's (see the NOTE on k16 steps)

    def __post_init__(self) -> None:
        if self.block_k and (self.block_k < 16 or self.block_k & (self.block_k - 1)):
            raise ValueError(f"block_k={self.block_k} must be 0 or a power of two >= 16")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {self.mode!r}")
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name}={v} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"bad num_warps={self.num_warps} / num_stages={self.num_stages}")
        if self.flat not in (0, 1, 2) or self.persistent < 0 or self.group_m < 1:
            raise ValueError(f"bad flat={self.flat} / persistent={self.persistent} / "
                             f"group_m={self.group_m}")


@dataclass(frozen=True)
class SmallKRule:
    """Split length and decode (M <= 64) launches of the families with K <= ``max_k``.

    splits = max(1, min(P, cdiv(K, 64) // min_steps)) with P = cdiv(target_programs,
    cdiv(N, 64)), or P = target_programs // cdiv(N, 64) where ``at_most_target`` (the
    (tile, split) programs of 64 weight rows never exceed target_programs: one wave of
    one program per SM); split_len = cdiv(K, splits) rounded up to ``quantum`` (a multiple
    of 64); BLOCK_K 64. A function of (N, K) only. ``swap``: ascending ``(max_m, Launch)``
    buckets; M <= 64 takes the first bucket with M <= max_m whose K step divides the split
    length.
    """

    max_k: int
    target_programs: int
    min_steps: int = 4
    quantum: int = 128
    swap: tuple[tuple[int, Launch], ...] = ()
    at_most_target: bool = False

    def __post_init__(self) -> None:
        if min(self.max_k, self.target_programs, self.min_steps) < 1:
            raise ValueError(f"SmallKRule: max_k, target_programs, min_steps must be >= 1: {self}")
        if self.quantum < 64 or self.quantum % 64:
            raise ValueError(f"SmallKRule: quantum={self.quantum} must be a multiple of 64")
        if any(lp.mode != "swap" for _, lp in self.swap) or list(self.swap) != sorted(
                self.swap, key=lambda b: b[0]):
            raise ValueError("SmallKRule: swap must be ascending (max_m, swap Launch) buckets")

    def config(self, n: int, k: int) -> MatmulConfig:
        tiles = triton.cdiv(n, 64)
        per_tile = (self.target_programs // tiles if self.at_most_target
                    else triton.cdiv(self.target_programs, tiles))
        splits = max(1, min(per_tile, triton.cdiv(k, 64) // self.min_steps))
        return MatmulConfig(64, triton.cdiv(triton.cdiv(k, splits), self.quantum) * self.quantum)

    def to_json(self) -> str:
        d = asdict(self)
        d["swap"] = [[m, asdict(lp)] for m, lp in self.swap]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SmallKRule:
        d = json.loads(text)
        d["swap"] = tuple((int(m), Launch(**lp)) for m, lp in d.get("swap", ()))
        return cls(**d)


# The measured rule (lab/linear_decode.py on an H100, weights cycled past the L2):
# K <= 4096; as many splits as keep the programs of 64 weight rows within 132 (one per SM
# of an H100/H200): one split for qkv [5120, 2048] and lm_head, 4 for o_proj [2048, 4096],
# 8 (min_steps) for the [128, 2048] router; swap launch with 64-row weight tiles, K step
# 256 (else 128), 3 stages at every M <= 64. More programs than SMs (2-8 splits for qkv,
# 16 for o_proj) or 16/32/128-row tiles were slower at M = 1, 8, 64: the bytes a program
# has in flight bound decode. Per call at M = 1: qkv 10.96 -> 9.67 us, o_proj 10.12 ->
# 9.32 us; the router (4.3 us) and lm_head (205 us, 3.0 TB/s) unchanged.
# MEGASERVE_MATMUL_SMALL_K (a SmallKRule JSON, or "none") overrides it for tuning runs;
# it changes the bits of the families with K <= max_k.
SMALL_K_RULE: SmallKRule | None = SmallKRule(
    4096, 132, at_most_target=True,
    swap=((64, Launch("swap", 64, num_warps=4, num_stages=3, block_k=256)),
          (64, Launch("swap", 64, num_warps=4, num_stages=3, block_k=128))))
SMALL_K_RULE_ENV = "MEGASERVE_MATMUL_SMALL_K"


@functools.lru_cache(maxsize=8)
def _parse_rule(text: str) -> SmallKRule | None:
    return None if text.strip().lower() == "none" else SmallKRule.from_json(text)


def small_k_rule() -> SmallKRule | None:
    """The small-K rule in force: ``$MEGASERVE_MATMUL_SMALL_K`` if set, else ``SMALL_K_RULE``."""
    text = os.environ.get(SMALL_K_RULE_ENV)
    return SMALL_K_RULE if text is None else _parse_rule(text)


def config_for(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The one arithmetic used for every M with weights `[n, k]` of ``dtype``."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear supports bfloat16/float16 on CUDA, got {dtype}")
    rule = small_k_rule()
    if rule is not None and k <= rule.max_k:
        return rule.config(n, k)
    block_n, block_k = 128, 64
    tiles_n = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles_n), steps // _MIN_SPLIT_STEPS))
    return MatmulConfig(block_k, triton.cdiv(steps, splits) * block_k)


# Cost model of the launches for M > 64 (us on an H200; fitted to a sweep of every
# tile shape, lab/matmul_sweep.py): SM time of one BLOCK_K step per tile shape, fp32
# workspace bandwidth, and the second launch of the parallel fold.
_STEP_US = {(128, 128): 0.45, (64, 128): 0.26, (128, 64): 0.26, (128, 256): 0.80}
_WS_BYTES_PER_US = 3.0e6
_FOLD_LAUNCH_US = 3.0
# 128x256 folds take 4 stages: on an H100 (lab/prefill_linears.py: Qwen3-30B-A3B's qkv
# and o_proj and a 4096 x 4096 weight, 3 and 4 stages timed back to back) 4 stages ran 2-8%
# faster at 16,384 rows and within 3% either way at 1,024-4,096 (docs/benchmarks.md in git history).
_TALL = {(128, 128): Launch("fold"), (128, 256): Launch("fold", 128, 256, 8, 4),
         (64, 128): Launch("fold", 64, 128, 4, 4),
         (128, 64): Launch("split", 128, 64, 4, 4, fold_last=False)}


def launch_cost_us(m: int, n: int, k: int, cfg: MatmulConfig, lp: Launch,
                   num_sms: int = 132) -> float:
    """Rough time of a fold or split launch (for choosing one; the bits never change).

    fold: waves of output tiles, each walking all K steps. split: waves of (tile, split)
    programs of split_len steps, plus the fp32 parts written and read back
    (2 * S * M * N * 4 bytes) and the fold kernel's launch.
    """
    tiles = triton.cdiv(m, lp.block_m) * triton.cdiv(n, lp.block_n)
    step_us = _STEP_US.get((lp.block_m, lp.block_n), 0.45)
    if lp.mode == "fold":
        return triton.cdiv(tiles, num_sms) * triton.cdiv(k, cfg.block_k) * step_us
    splits = triton.cdiv(k, cfg.split_len)
    return (triton.cdiv(tiles * splits, num_sms) * (cfg.split_len // cfg.block_k) * step_us
            + 2 * splits * m * n * 4 / _WS_BYTES_PER_US + _FOLD_LAUNCH_US)


def plan_launch(m: int, n: int, k: int, cfg: MatmulConfig, mode: str | None = None,
                num_sms: int = 132) -> Launch:
    """The launch for an `[m, k] x [n, k]^T` product (``mode`` forces a launch mode).

    M <= 64: the small-K rule's launch where one applies (:class:`SmallKRule`), else swap
    mode; the parts are folded by a second, parallel kernel where a tile has
    many of them (S >= 16, or S >= 8 and M <= 16), else by the tile's last program; 64-row
    weight tiles from M = 8. M > 64: the cheapest of fold 128x128, 128x256 (4 stages),
    64x128 and split 128x64 (parallel fold) by :func:`launch_cost_us`. Rules measured on
    an H200.
    """
    splits = triton.cdiv(k, cfg.split_len)
    if mode is None and m <= 64 or mode == "swap":
        rule = small_k_rule()
        if rule is not None and k <= rule.max_k:
            for max_m, lp in rule.swap:
                if m <= max_m and cfg.split_len % (lp.block_k or cfg.block_k) == 0:
                    return lp
        if m < 8:
            return Launch("swap", 128, num_warps=4, num_stages=4)
        if splits >= 16 or (splits >= 8 and m <= 16):
            return Launch("swap", 128, num_warps=4, num_stages=4, fold_last=False)
        return Launch("swap", 64, num_warps=4, num_stages=3)
    if mode is not None:
        return Launch(mode)
    cands = [lp for lp in _TALL.values() if lp.mode == "fold" or splits > 1]
    return min(cands, key=lambda lp: launch_cost_us(m, n, k, cfg, lp, num_sms))


# Swap mode's parts are left unfolded for calls of at most this many rows: a consumer
# program reads one token's parts at a stride of M elements, so each 32-byte sector it
# loads serves it alone; at 8 rows that is 8x the bytes of the folded row, all from L2.
# Split mode's parts (token-major) are read whole at any M.
PARTS_MAX_M = 8
PARTS_ENV = "MEGASERVE_LINEAR_PARTS"  # "0": never leave parts unfolded (A/B runs)


_counters: dict[torch.device, torch.Tensor] = {}
# Buffers replaced by larger ones stay alive (and zeroed): a captured CUDA graph keeps
# launching with the address it was captured with.
_retired_counters: list[torch.Tensor] = []


def _tile_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, reset by the kernel itself after use.

    NOTE: shared per device: two split launches must not run concurrently on different
    streams of one device.
    """
    buf = _counters.get(device)
    if buf is None or buf.numel() < num_tiles:
        if buf is not None:
            _retired_counters.append(buf)
        buf = torch.zeros(max(num_tiles, 1024), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device for launch planning; an H100's 132 elsewhere (the
    interpreter), where only the planning uses it."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 132


def _fold_parts(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
                inner: int, stride_outer: int, stride_inner: int, bias_inner: bool) -> None:
    """Second launch of split/swap mode with ``fold_last=False``."""
    numel = ws[0].numel()
    block = 1024
    mk.fold_parts_kernel[(triton.cdiv(numel, block),)](
        ws, out, bias if bias is not None else out, numel, inner, stride_outer, stride_inner,
        NUM_SPLITS=ws.shape[0], HAS_BIAS=bias is not None, BIAS_INNER=bias_inner,
        BLOCK=block, num_warps=4, **pdl.launch_args(out.device))


def tma_readable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read ``t``: unit last stride, 16-byte aligned base
    address and leading strides."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s * size % 16 == 0 for s in t.stride()[:-1]))


def linear_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 *, launch: Launch | None = None) -> torch.Tensor | Parts:
    """:func:`linear`, or where its launch would fold split parts in a second pass (swap
    mode with more than one split and at most ``PARTS_MAX_M`` rows; split mode with a fold
    launch) those parts unfolded (:class:`Parts`), which the consumer kernel folds. The
    same bits either way. ``launch``: as :func:`linear`'s (tests)."""
    return _linear(x, weight, bias, launch=launch,
                   fold=os.environ.get(PARTS_ENV, "1") == "0")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           *, mode: str | None = None, config: MatmulConfig | None = None,
           launch: Launch | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, fp32 accumulation, bitwise row-invariant.

    x: `[M, K]` bf16/fp16 (any leading-dim stride, unit last stride); weight: `[N, K]`
    same dtype; bias: `[N]` or None. Returns `[M, N]` in x.dtype. ``mode`` ('fold',
    'split' or 'swap') forces a launch mode, ``launch`` a whole launch and ``config`` the
    arithmetic, for tests and tuning; the launch never changes the bits (checked bitwise
    on an H200 by tests/kernels/test_triton_gpu.py and lab/matmul_sweep.py).
    """
    out = _linear(x, weight, bias, mode=mode, config=config, launch=launch)
    assert isinstance(out, torch.Tensor)  # fold=True
    return out


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            *, mode: str | None = None, config: MatmulConfig | None = None,
            launch: Launch | None = None, fold: bool = True) -> torch.Tensor | Parts:
    """:func:`linear`; ``fold=False``: :func:`linear_parts`."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: shapes {tuple(x.shape)} and {tuple(weight.shape)} do not match")
    if x.dtype != weight.dtype:
        raise ValueError(f"linear: x is {x.dtype} but weight is {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    cfg = config or config_for(n, k, x.dtype)
    if not tma_readable(x):
        x = x.contiguous()
    if weight.stride(1) != 1 or (weight.stride(0) * weight.element_size()) % 16:
        raise ValueError(f"linear: weight rows must be contiguous and 16-byte aligned (K={k})")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    lp = launch or plan_launch(m, n, k, cfg, mode, num_sms(x.device))
    block_k = lp.block_k or cfg.block_k
    if cfg.split_len % block_k:
        raise ValueError(f"linear: launch block_k={block_k} does not divide split_len="
                         f"{cfg.split_len}")
    bias_arg = bias if bias is not None else out
    num_splits = triton.cdiv(k, cfg.split_len)
    warps = dict(num_warps=lp.num_warps, num_stages=lp.num_stages, **pdl.launch_args(x.device))
    if lp.mode == "swap":
        if m > SWAP_MAX_M:
            raise ValueError(f"linear: swap mode takes at most {SWAP_MAX_M} rows, got {m}")
        block_t = max(16, triton.next_power_of_2(m))
        x_desc = TensorDescriptor.from_tensor(x, [block_t, block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [lp.block_m, block_k])
        tiles_f = triton.cdiv(n, lp.block_m)
        # One split: the part is the total, stored directly (no workspace, no fold).
        ws = (torch.empty(num_splits, n, m, dtype=torch.float32, device=x.device)
              if num_splits > 1 else out)
        counters = _tile_counters(x.device, tiles_f)
        unfolded = not fold and num_splits > 1 and m <= PARTS_MAX_M
        mk.linear_swap_kernel[(tiles_f, num_splits)](
            w_desc, x_desc, out, bias_arg, ws, counters, m, n, k, out.stride(0),
            NUM_SPLITS=num_splits, SPLIT_LEN=cfg.split_len, HAS_BIAS=bias is not None,
            FOLD_LAST=lp.fold_last and not unfolded, BLOCK_F=lp.block_m, BLOCK_T=block_t,
            BLOCK_K=block_k, **warps)
        if unfolded:
            return Parts(ws, bias, x.dtype)
        if not lp.fold_last and num_splits > 1:
            _fold_parts(ws, out, bias, m, 1, out.stride(0), bias_inner=False)
        return out
    a_desc = TensorDescriptor.from_tensor(x, [lp.block_m, block_k])
    b_desc = TensorDescriptor.from_tensor(weight, [lp.block_n, block_k])
    tiles = triton.cdiv(m, lp.block_m) * triton.cdiv(n, lp.block_n)
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=lp.block_m, BLOCK_N=lp.block_n,
                  BLOCK_K=block_k, GROUP_M=lp.group_m, **warps)
    if lp.mode == "fold" and lp.persistent:
        progs = min(tiles, lp.persistent)
        mk.linear_persist_kernel[(progs,)](
            a_desc, b_desc, out, bias_arg, m, n, k, out.stride(0), SPLIT_LEN=cfg.split_len,
            num_progs=progs, FLATTEN=lp.flatten, **common)
    elif lp.mode == "fold":
        mk.linear_fold_kernel[(tiles,)](a_desc, b_desc, out, bias_arg, m, n, k, out.stride(0),
                                        SPLIT_LEN=cfg.split_len, FLAT=lp.flat, **common)
    else:
        ws = torch.empty(num_splits, m, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device, tiles)
        mk.linear_split_kernel[(tiles, num_splits)](
            a_desc, b_desc, out, bias_arg, ws, counters, m, n, k, out.stride(0),
            NUM_SPLITS=num_splits, SPLIT_LEN=cfg.split_len, FOLD_LAST=lp.fold_last, **common)
        if not (lp.fold_last or fold):  # rows of N contiguous parts: any M reads them whole
            return Parts(ws, bias, x.dtype, token_major=True)
        if not lp.fold_last:
            _fold_parts(ws, out, bias, n, out.stride(0), 1, bias_inner=True)
    return out


def linear_rms_norm(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See ``megaserve.kernels.api.linear_rms_norm``: the norm folds the linear's parts
    where :func:`linear_parts` leaves them (decode rows)."""
    return rms_norm(linear_parts(x, weight), norm_weight, eps, residual)

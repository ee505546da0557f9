"""Dispatch and combine frames: what travels between attention and expert workers.

A dispatch frame carries each token row once per destination worker, with the
(row, expert id) pairs it needs there; the combine frame returns one output row per pair,
in pair order::

    dispatch:  | header 20 B | rows  [num_rows, D] dtype | pairs [num_pairs, 2] int32 |
    combine:   | header 20 B | out   [num_pairs, D] dtype |

    header = (num_rows, num_pairs, hidden, dtype code, participants) as 5 little-endian
    uint32; ``participants`` is 0 under per-layer aggregation, and under lockstep the
    number of replicas whose frames make up this (layer, micro-batch) tick.

Frames are read straight from the receiver's slot, a host buffer or (cuda_ipc) GPU
memory; tensors returned by ``decode_*`` are copies, so the slot can be released at once.
"""

from __future__ import annotations

import struct

import torch

_HEADER = struct.Struct("<5I")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Immediate tags (4 bits): which direction a frame travels.
TAG_DISPATCH = 0
TAG_COMBINE = 1


def frames_on_host(endpoint) -> bool:
    """True where ``endpoint`` moves host bytes (inproc, tcp, nccl over gloo); False where
    its slots live on a GPU (cuda_ipc, nccl over NCCL), so frame parts stay on the GPU."""
    device = getattr(endpoint, "device", None)
    return device is None or torch.device(device).type == "cpu"


def _as_bytes(t: torch.Tensor, host: bool) -> torch.Tensor:
    """A flat uint8 view of a tensor's bytes, copied to the host when ``host``."""
    t = t.detach().contiguous()
    if host:
        t = t.cpu()
    return t.view(torch.uint8).reshape(-1)


def encode_dispatch(rows: torch.Tensor, pairs: torch.Tensor, host: bool = True,
                    participants: int = 0) -> list:
    """rows: `[n, D]`; pairs: `[p, 2]` (row index, global expert id). ``host=False`` keeps
    the parts on the GPU (see :func:`frames_on_host`)."""
    header = _header(rows.shape[0], pairs.shape[0], rows.shape[1], rows.dtype, participants)
    return [header, _as_bytes(rows, host), _as_bytes(pairs.to(torch.int32), host)]


def encode_combine(out: torch.Tensor, host: bool = True) -> list:
    """out: `[p, D]`, one row per pair of the dispatch frame it answers."""
    return [_header(0, out.shape[0], out.shape[1], out.dtype), _as_bytes(out, host)]


def _header(num_rows: int, num_pairs: int, hidden: int, dtype: torch.dtype,
            participants: int = 0) -> torch.Tensor:
    packed = _HEADER.pack(num_rows, num_pairs, hidden, _DTYPES.index(dtype), participants)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def _as_u8(data) -> torch.Tensor:
    """The slot's bytes as a uint8 tensor: a CUDA tensor (cuda_ipc) or a host buffer view."""
    if isinstance(data, torch.Tensor):
        return data
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


def _unpack_header(u8: torch.Tensor) -> tuple[int, int, int, torch.dtype, int]:
    num_rows, num_pairs, hidden, code, participants = _HEADER.unpack(
        bytes(u8[: _HEADER.size].cpu().numpy()))
    return num_rows, num_pairs, hidden, _DTYPES[code], participants


def _read(u8: torch.Tensor, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A copy of ``count`` values of ``dtype`` at byte ``offset``."""
    return u8[offset: offset + count * dtype.itemsize].clone().view(dtype)


def decode_dispatch(data) -> tuple[torch.Tensor, torch.Tensor, int]:
    """→ (rows `[n, D]`, pairs `[p, 2]` int64, participants), copies on the slot's device."""
    u8 = _as_u8(data)
    num_rows, num_pairs, hidden, dtype, participants = _unpack_header(u8)
    rows = _read(u8, _HEADER.size, num_rows * hidden, dtype).view(num_rows, hidden)
    offset = _HEADER.size + rows.numel() * rows.element_size()
    pairs = _read(u8, offset, num_pairs * 2, torch.int32).view(num_pairs, 2).long()
    return rows, pairs, participants


def decode_combine(data) -> torch.Tensor:
    """→ out `[p, D]` (a copy on the slot's device)."""
    u8 = _as_u8(data)
    _, num_pairs, hidden, dtype, _ = _unpack_header(u8)
    return _read(u8, _HEADER.size, num_pairs * hidden, dtype).view(num_pairs, hidden)


def frame_bytes(num_rows: int, num_pairs: int, hidden: int, itemsize: int) -> int:
    """Size of the larger of a dispatch frame and its combine frame."""
    dispatch = _HEADER.size + num_rows * hidden * itemsize + num_pairs * 8
    combine = _HEADER.size + num_pairs * hidden * itemsize
    return max(dispatch, combine)

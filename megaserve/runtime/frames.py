"""Dispatch and combine frames: what travels between attention and expert workers.

A dispatch frame carries each token row once per destination worker, with the
(row, expert id) pairs it needs there; the combine frame returns one output row per pair,
in pair order::

    dispatch:  | header 16 B | rows  [num_rows, D] dtype | pairs [num_pairs, 2] int32 |
    combine:   | header 16 B | out   [num_pairs, D] dtype |

    header = (num_rows, num_pairs, hidden, dtype code) as 4 little-endian uint32

Frames are read straight from the receiver's slot (no intermediate copy); tensors
returned by ``decode_*`` are copies, so the slot can be released right away.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

_HEADER = struct.Struct("<4I")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# Immediate tags (4 bits): which direction a frame travels.
TAG_DISPATCH = 0
TAG_COMBINE = 1


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU uint8 view of a tensor's bytes (copied to the host if needed)."""
    return t.detach().contiguous().cpu().view(torch.uint8).reshape(-1)


def encode_dispatch(rows: torch.Tensor, pairs: torch.Tensor) -> list:
    """rows: `[n, D]`; pairs: `[p, 2]` int32 (row index, global expert id)."""
    header = _HEADER.pack(rows.shape[0], pairs.shape[0], rows.shape[1], _DTYPES.index(rows.dtype))
    return [header, _as_bytes(rows), _as_bytes(pairs.to(torch.int32))]


def encode_combine(out: torch.Tensor) -> list:
    """out: `[p, D]`, one row per pair of the dispatch frame it answers."""
    header = _HEADER.pack(0, out.shape[0], out.shape[1], _DTYPES.index(out.dtype))
    return [header, _as_bytes(out)]


def _read(data, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = np.frombuffer(data, dtype=np.uint8, count=count * itemsize, offset=offset)
    return torch.from_numpy(raw.copy()).view(dtype)


def decode_dispatch(data) -> tuple[torch.Tensor, torch.Tensor]:
    """→ (rows `[n, D]`, pairs `[p, 2]` int64), both copies."""
    num_rows, num_pairs, hidden, code = _HEADER.unpack_from(data, 0)
    dtype = _DTYPES[code]
    rows = _read(data, _HEADER.size, num_rows * hidden, dtype).view(num_rows, hidden)
    offset = _HEADER.size + rows.numel() * rows.element_size()
    pairs = _read(data, offset, num_pairs * 2, torch.int32).view(num_pairs, 2).long()
    return rows, pairs


def decode_combine(data) -> torch.Tensor:
    """→ out `[p, D]` (a copy)."""
    _, num_pairs, hidden, code = _HEADER.unpack_from(data, 0)
    return _read(data, _HEADER.size, num_pairs * hidden, _DTYPES[code]).view(num_pairs, hidden)


def frame_bytes(num_rows: int, num_pairs: int, hidden: int, itemsize: int) -> int:
    """Size of the larger of a dispatch frame and its combine frame."""
    dispatch = _HEADER.size + num_rows * hidden * itemsize + num_pairs * 8
    combine = _HEADER.size + num_pairs * hidden * itemsize
    return max(dispatch, combine)

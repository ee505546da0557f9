"""A micro-batch's model inputs from (token ids, position of the first, block table) per
sequence: the host arrays, and the :class:`~megaserve.models.forward.MicroBatch` of their
device tensors. The model runner and the speculative decoder's draft model both build them.

Shape legend: T = tokens of the micro-batch, S = sequences, W = blocks of the longest
block table.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from megaserve.models.attention_part import AttentionMetadata
from megaserve.models.forward import MicroBatch


def micro_batch_arrays(
    inputs: list[tuple[list[int], int, list[int]]], block_size: int
) -> list[np.ndarray]:
    """The host arrays of a micro-batch from (token ids, position of the first, block
    table) per sequence: token ids, positions, slots `[T]` int64 (every token's K/V go
    to its slot in the sequence's blocks), block tables `[S, W]` int32 (zero-padded to
    the longest), context lengths `[S]` int32, query start offsets `[S + 1]` int32."""
    num_seqs = len(inputs)
    lengths = np.fromiter((len(ids) for ids, _, _ in inputs), np.int64, num_seqs)
    begins = np.fromiter((begin for _, begin, _ in inputs), np.int64, num_seqs)
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    num_tokens = int(starts[-1])
    ids = np.fromiter(itertools.chain.from_iterable(ids for ids, _, _ in inputs), np.int64,
                      num_tokens)
    tables = np.zeros((num_seqs, max(len(b) for _, _, b in inputs)), dtype=np.int32)
    for row, (_, _, block_ids) in zip(tables, inputs):
        row[:len(block_ids)] = block_ids
    owner = np.repeat(np.arange(num_seqs), lengths)  # [T] sequence of each token
    positions = np.arange(num_tokens) + np.repeat(begins - starts[:-1], lengths)  # [T]
    slots = (tables[owner, positions // block_size].astype(np.int64) * block_size
             + positions % block_size)  # [T]
    return [ids, positions, slots, tables, (begins + lengths).astype(np.int32),
            starts.astype(np.int32)]


def build_micro_batch(
    inputs: list[tuple[list[int], int, list[int]]], block_size: int, device: torch.device
) -> MicroBatch:
    """A micro-batch from (token ids, position of the first, block table) per sequence
    (:func:`micro_batch_arrays`), copied to ``device`` one array at a time (blocking)."""
    arrays = micro_batch_arrays(inputs, block_size)
    return micro_batch_from_tensors(iter([torch.from_numpy(a).to(device) for a in arrays]), None)


def micro_batch_from_tensors(staged, sampled_tokens: torch.Tensor | None) -> MicroBatch:
    """The MicroBatch of :func:`micro_batch_arrays`' tensors, taken from the iterator
    ``staged``; with ``sampled_tokens`` (the last step's tokens on the device) the next
    tensor is the source rows `[T]` int64 and those tokens replace the ids where >= 0."""
    ids, positions, slots, tables, context_lens, starts = (next(staged) for _ in range(6))
    if sampled_tokens is not None:
        sources = next(staged)
        ids = torch.where(sources >= 0, sampled_tokens[sources.clamp(min=0)], ids)
    meta = AttentionMetadata(positions=positions, slot_mapping=slots, block_tables=tables,
                             context_lens=context_lens, query_start_loc=starts)
    return MicroBatch(ids, meta)

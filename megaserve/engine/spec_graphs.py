"""CUDA graphs for the speculative path: forwards of a fixed number of query rows per
sequence (Q), replayed with the batch padded up to the next captured size.

The target's verification step runs a sequence's last token and its j <= k drafts
(Q = k + 1); the draft model's catch-up runs one or two tokens and its proposal rounds
one (Q = 2 and Q = 1). Without graphs each such step is an eager forward whose launch
overhead (hundreds of Triton and torch launches) dwarfs the GPU time of a small batch.
:class:`megaserve.engine.cuda_graphs.DecodeGraphs` is the one-token, target-only case;
this class takes its inputs in ``build_micro_batch``'s form, so it serves both models.

Shape legend: n = sequences of the step, b = captured batch size (>= n), Q = query rows
per sequence, W = block-table width (blocks of a ``max_positions + Q - 1`` sequence),
V = vocab.

NOTE: static inputs, one int32 row per query row (sequence i owns rows i*Q .. i*Q+Q-1),
copied host → device in one transfer:

    col   0       1          2       3          4 .. 4+W-1
          token   position   slot    context    block table (zero past the sequence)
                                     (read from each sequence's first row only)
    rows of sequences 0..n-1   its q_i <= Q real tokens, then Q - q_i padding rows
    rows of sequences n..b-1   padding: a copy of sequence 0's rows, slot = -1

A padding row writes no K/V (the KV write skips negative slots), and everything it reads
is finite (the pool is zero-initialised and only ever written with finite K/V), so it
cannot send NaN into the router. A sequence's padding rows come after its real rows
(its context is first position + Q) and a row never attends past its own position, so
they change nothing for the real rows; their RoPE position is clamped into the table.
Every kernel is batch-invariant: a row's bits depend on its own inputs only, whatever the
other rows of the step and whatever context lies beyond the row (the invariance chunked
prefill relies on). So the real rows are bitwise those of the eager forward.
"""

from __future__ import annotations

import logging

import torch

from megaserve import kernels
from megaserve.engine.cuda_graphs import capture_forward, capture_sizes, padded_size
from megaserve.models.attention_part import AttentionMetadata, AttentionPart
from megaserve.models.expert_part import ExpertPart
from megaserve.models.forward import LocalExperts, MicroBatch, run_layers

logger = logging.getLogger(__name__)

_TOKEN, _POSITION, _SLOT, _CONTEXT, _TABLE = 0, 1, 2, 3, 4

# One sequence's rows of a step, as ``micro_batch.build_micro_batch`` takes them:
# (token ids, position of the first, block table).
StepInput = tuple[list[int], int, list[int]]


# Verification steps of more sequences run eagerly: the graphs' log-prob buffer holds
# MAX_GRAPH_BATCH x Q rows of the vocabulary (Q = 5, Qwen's 152k: 778 MB).
MAX_GRAPH_BATCH = 256


class MultiTokenGraphs:
    """Forwards of ``query_len`` rows per sequence over static buffers, one CUDA graph
    per padded batch size (captured on first use).

    ``max_positions``: rows of the model's RoPE table. ``capture=False`` runs the same
    padded forward eagerly (CPU, tests). In-process experts only. Not thread-safe.
    Raises ``ValueError`` for a bad ``max_batch`` or ``query_len``.
    """

    def __init__(self, attention: AttentionPart, experts: ExpertPart,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_batch: int, max_positions: int, query_len: int,
                 capture: bool = True) -> None:
        if isinstance(query_len, bool) or not isinstance(query_len, int) or query_len < 1:
            raise ValueError(f"query_len must be a positive integer, got {query_len!r}")
        self.attention = attention
        self.experts = LocalExperts(experts)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_batch)
        self.query_len = query_len  # Q
        self.max_positions = max_positions
        self.table_width = -(-(max_positions + query_len - 1) // block_size)  # W
        self.capture = capture
        device = attention.device
        rows, cols = self.sizes[-1] * query_len, _TABLE + self.table_width
        self._static = torch.zeros(rows, cols, dtype=torch.int32, device=device)
        self._staging = torch.zeros(rows, cols, dtype=torch.int32,
                                    pin_memory=device.type == "cuda")
        self._host = self._staging.numpy()
        self._query_start_loc = torch.arange(0, (self.sizes[-1] + 1) * query_len, query_len,
                                             dtype=torch.int32, device=device)
        # One log-prob buffer for every size's `[b * Q, V]` rows (as DecodeGraphs').
        self._logprobs = torch.empty(rows, attention.lm_head.shape[0], dtype=torch.float32,
                                     device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._copied = torch.cuda.Event() if capture else None
        self.num_steps = 0  # padded forwards run

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def can_run(self, inputs: list[StepInput]) -> bool:
        """True where the step fits: 1 .. Q tokens per sequence, at most the largest
        size, block tables within W."""
        return (0 < len(inputs) <= self.sizes[-1]
                and all(0 < len(ids) <= self.query_len and len(blocks) <= self.table_width
                        for ids, _, blocks in inputs))

    def run(self, inputs: list[StepInput]) -> torch.Tensor:
        """Log-probabilities `[n * Q, V]` float32: row ``i * Q + r`` follows sequence i's
        r-th token (rows past its tokens are padding), bitwise equal to the eager
        forward. Writes the tokens' K/V. Call :meth:`can_run` first.

        The result is the graph's output buffer: read it before the next call.
        """
        n, q = len(inputs), self.query_len
        b = padded_size(n, self.sizes)
        assert b is not None and self.can_run(inputs)
        self._fill(inputs, b)
        self._static[:b * q].copy_(self._staging[:b * q], non_blocking=True)
        self.num_steps += 1
        if not self.capture:
            return self._forward(b)[:n * q]
        self._copied.record()
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._capture(b)
        graph, out = entry
        graph.replay()
        return out[:n * q]

    def _fill(self, inputs: list[StepInput], b: int) -> None:
        """Rows of the static layout (module NOTE) into the host staging buffer."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging rows
        host, bs, q = self._host, self.block_size, self.query_len
        last_position = self.max_positions - 1
        for i, (token_ids, begin, blocks) in enumerate(inputs):
            first = i * q
            for r in range(q):
                p = begin + r
                if r < len(token_ids):
                    host[first + r, _TOKEN] = token_ids[r]
                    host[first + r, _SLOT] = blocks[p // bs] * bs + p % bs
                else:  # padding after the real rows: no K/V write
                    host[first + r, _TOKEN] = token_ids[-1]
                    host[first + r, _SLOT] = -1
                host[first + r, _POSITION] = min(p, last_position)
            host[first, _CONTEXT] = begin + q
            host[first, _TABLE:_TABLE + len(blocks)] = blocks
            host[first, _TABLE + len(blocks):] = 0
        n = len(inputs)
        if b > n:
            host[n * q:b * q].reshape(b - n, q, host.shape[1])[:] = host[:q]
            host[n * q:b * q, _SLOT] = -1

    def _forward(self, b: int) -> torch.Tensor:
        """The forward over static rows ``[:b * Q]``: `[b * Q, V]` float32 log-probs."""
        rows = self._static[:b * self.query_len]  # [b * Q, 4 + W]
        first = rows[::self.query_len]  # [b, 4 + W]: each sequence's context and table
        batch = MicroBatch(rows[:, _TOKEN].long(), AttentionMetadata(
            positions=rows[:, _POSITION].long(),
            slot_mapping=rows[:, _SLOT].long(),
            block_tables=first[:, _TABLE:].contiguous(),
            context_lens=first[:, _CONTEXT].contiguous(),
            query_start_loc=self._query_start_loc[:b + 1],
        ))
        hidden = run_layers(self.attention, self.experts, [batch], self.kv_caches)[0]
        return kernels.log_softmax(self.attention.logits(hidden),
                                   out=self._logprobs[:b * self.query_len])  # [b * Q, V]

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        entry = self._graphs[b] = capture_forward(self._forward, b, self._pool)
        logger.info("captured a CUDA graph of %d query rows per sequence for batch size %d",
                    self.query_len, b)
        return entry


def verify_logprobs(graphs: MultiTokenGraphs, scheduled: list, rows: list[int]) -> torch.Tensor | None:
    """Log-probs `[B, V]` float32 of a verification step's logit ``rows`` (in
    ``ModelRunner._logit_rows`` order: per sequence its last token's row, then its drafts'),
    from ``graphs`` (Q = k + 1); None where the step does not fit them (a prompt chunk,
    prompt logprobs, too many sequences): the eager path runs it then.

    scheduled: the step's ``ScheduledSeq`` list, every sampling sequence's drafts filled.
    """
    q = graphs.query_len
    expected: list[int] = []  # the rows such a step has
    index: list[int] = []  # where they sit in the graph's output
    offset = 0
    for i, s in enumerate(scheduled):
        if s.num_new_tokens != 1 or not s.samples:
            return None
        expected.extend(range(offset, offset + s.num_draft_tokens + 1))
        index.extend(range(i * q, i * q + s.num_draft_tokens + 1))
        offset += s.num_step_tokens
    if rows != expected:
        return None
    inputs = [(s.seq.token_ids(s.seq.num_computed_tokens, s.seq.num_computed_tokens + 1)
               + list(s.draft_token_ids), s.seq.num_computed_tokens, s.seq.block_ids)
              for s in scheduled]
    if not graphs.can_run(inputs):
        return None
    out = graphs.run(inputs)  # [n * Q, V]
    return out[torch.tensor(index, device=out.device)]  # [B, V]

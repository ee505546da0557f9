"""CUDA graphs for decode steps: captured forwards (embedding .. log-softmax) replayed
with the batch padded up to the next captured size, and the sampling of their tokens.

Shape legend: n = sequences of the step (one new token each), b = captured batch size
(>= n), W = block-table width (blocks of a ``max_model_len`` sequence), V = vocab.

NOTE: static inputs, one int32 row per batch slot, copied host → device in one transfer:

    col   0       1          2       3          4 .. 4+W-1
          token   position   slot    context    block table (zero past the sequence)
    col   4+W     source: row of the previous step's sampled tokens holding this row's
                  input token (async scheduling: the host has not read it), or -1 (token)
          +1      top_k      +2 logprobs (host only: -1 = none)
          +3..+5  temperature, top_p, min_p (float32 bits)
          +6..+7  seed (int64: low word first; the row width is even, so it is aligned)
    rows 0..n-1   the step's sequences
    rows n..b-1   padding: a copy of row 0 with slot = -1

The sampling columns (source to seed) and the block table are kept between steps: a row
still holding the same sequence gets only its new blocks written (``_fill``).

A padding row writes no K/V (the KV write skips negative slots), reads only row 0's
blocks, and its inputs are finite, so it routes like row 0 and cannot send NaN into the
router. Every kernel is batch-invariant (a row's bits depend on its own inputs only), so
padding and the fixed block-table width leave rows 0..n-1 bitwise equal to eager
execution; their results are all that is read back.

Host synchronisations and data-chosen launch grids break capture; the decode path has
none (the expert FFN finds its group offsets with an align kernel on the device).
Sampling stays outside the graph (``kernels.sample`` reads the sampling parameters on
the host, so it is given the staging rows' host copies; a step of greedy rows takes the
greedy tokens the forward's log-softmax computed, ``greedy_out``, and launches nothing):
:meth:`DecodeGraphs.sample` writes the tokens to a static device
buffer (:class:`SampledTokens`, shared with the model runner's eager steps), which the
next step reads for rows whose source is set, and copies them to the host with one
transfer (:class:`DecodeStep`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from megaserve import kernels
from megaserve.engine.scheduler import ScheduledSeq
from megaserve.models.attention_part import AttentionMetadata, AttentionPart
from megaserve.models.expert_part import ExpertPart
from megaserve.models.forward import ExpertClient, LocalExperts, MicroBatch, run_layers

logger = logging.getLogger(__name__)

_TOKEN, _POSITION, _SLOT, _CONTEXT, _TABLE = 0, 1, 2, 3, 4
# Columns after the block table (offsets from 4 + W; module NOTE).
_SOURCE, _TOP_K, _LOGPROBS, _TEMPERATURE, _TOP_P, _MIN_P, _SEED = range(7)
_NUM_SAMPLING_COLS = 8  # the seed takes two int32 columns


@dataclass
class SampledTokens:
    """The last sampling step's tokens on the device, one row per sampling sequence: the
    next step reads a sequence's input token here while the host has not read it (async
    scheduling). Decode graphs capture ``tokens``' address, so it is allocated once."""

    tokens: torch.Tensor  # `[max_batch]` int64 on the device
    rows: dict[object, int]  # sequence → its row of ``tokens`` (the last sampling step's)

    @classmethod
    def allocate(cls, size: int, device: torch.device) -> SampledTokens:
        return cls(torch.zeros(size, dtype=torch.int64, device=device), {})


@dataclass
class TokenCopy:
    """A step's sampled tokens on their way to the host (:meth:`HostTokens.copy`)."""

    tokens: torch.Tensor  # `[n]` int64 on the host (pinned on CUDA)
    copied: torch.cuda.Event | None  # recorded after the copy (None on CPU: no copy)
    index: int  # which copy of its HostTokens this is

    def ids(self) -> list[int]:
        """The tokens (waits for their copy: an event, no stream synchronisation)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.tokens.tolist()


class HostTokens:
    """Sampled tokens `[n]` int64 from the device to the host, through two pinned host
    buffers taken in turn (grown where a step needs more), each with an event recorded
    after its copy. A copy never overwrites the one before it, which the host may still be
    reading (async scheduling reads step n after launching n + 1): read a copy before the
    second one after it (:meth:`holds`). On CPU the tokens are the copy."""

    def __init__(self, device: torch.device, size: int) -> None:
        self.device = device
        self.size = size  # the smallest buffer allocated
        self._host: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self.count = 0

    def copy(self, tokens: torch.Tensor) -> TokenCopy:
        """Start copying ``tokens`` (device) to the host; CPU: ``tokens`` themselves,
        which the caller does not write again."""
        self.count += 1
        if self.device.type != "cuda":
            return TokenCopy(tokens, None, self.count)
        k, n = self.count % 2, tokens.shape[0]
        host = self._host[k]
        if host is None or host.shape[0] < n:
            host = self._host[k] = torch.empty(max(n, self.size), dtype=torch.int64,
                                               pin_memory=True)
        host = host[:n]
        host.copy_(tokens, non_blocking=True)
        if self._copied[k] is None:
            self._copied[k] = torch.cuda.Event()
        self._copied[k].record()
        return TokenCopy(host, self._copied[k], self.count)

    def holds(self, copy: TokenCopy) -> bool:
        """Whether ``copy``'s buffer still holds its tokens (no later copy reused it)."""
        return self.count - copy.index < 2


@dataclass
class DecodeStep:
    """A decode step whose sampled tokens are on their way to the host.

    ``token_ids()`` waits for the copy (the only synchronisation of a greedy decode step)
    and returns one token per scheduled sequence; then ``check`` (the device data plane's
    ``check_steps``) raises if the step was abandoned, so garbage is never read as tokens.
    ``token_logprobs``: one dict per sequence (None for those not asking), or None where
    none asks; the model runner fills them at sampling time, since the next replay
    overwrites the graph's log-probs.
    """

    scheduled: list[ScheduledSeq]
    copy: TokenCopy
    # (row, number of top logprobs) of each sequence asking for logprobs
    logprob_rows: list[tuple[int, int]]
    token_logprobs: list[dict[int, float] | None] | None = None
    check: Callable[[], None] | None = None

    def token_ids(self) -> list[int]:
        ids = self.copy.ids()
        if self.check is not None:
            self.check()
        return ids


def capture_sizes(max_batch: int, multiple: int = 1) -> list[int]:
    """Batch sizes to capture, vLLM's: 1, 2, 4, multiples of 8 below 256, then of 16 up to
    ``max_batch`` (which is always included; 83 sizes for 1,024, each padding at most 15
    rows), each rounded up to a multiple of ``multiple`` (the micro-batch count, so every
    micro-batch of a captured size has the same rows). Raises ``ValueError`` for
    ``max_batch < 1``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    sizes = ([s for s in (1, 2, 4) if s < max_batch] + list(range(8, min(max_batch, 256), 8))
             + list(range(256, max_batch, 16)))
    return sorted({-(-s // multiple) * multiple for s in sizes + [max_batch]})


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_seqs`` rows; None if none does."""
    for size in sizes:
        if size >= num_seqs:
            return size
    return None


def capture_forward(forward, b: int, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Warm ``forward(b)`` up eagerly on the step's real inputs (compiles the kernels; its
    K/V writes are the same values the replay writes again), then capture it into the
    graph memory ``pool``: (graph, its output buffer)."""
    forward(b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward(b)
    return graph, out


class DecodeGraphs:
    """Decode forwards of padded batch sizes over static input buffers.

    ``capture=False`` runs the same padded forward eagerly (CPU, tests). ``sampled``: the
    sampled-token buffer to share with eager steps (one of at least the largest size; by
    default its own). Not thread-safe; one engine thread drives it. Raises ``ValueError``
    at construction for bad sizes.
    """

    def __init__(self, attention: AttentionPart, experts: ExpertPart | ExpertClient,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_batch: int, max_model_len: int, capture: bool = True,
                 microbatches: int = 1, sampled: SampledTokens | None = None) -> None:
        self.attention = attention
        # An ExpertPart runs in this graph; an ExpertClient with ``graph_step`` (the device
        # data plane) is told before each replay, and its dispatch/combine are captured.
        self.experts = LocalExperts(experts) if isinstance(experts, ExpertPart) else experts
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.microbatches = microbatches
        self.sizes = capture_sizes(max_batch, microbatches)
        self.table_width = -(-max_model_len // block_size)  # W
        self.capture = capture
        device = attention.device
        max_batch = self.sizes[-1]
        self._extra = _TABLE + self.table_width + (self.table_width % 2)  # even: seed aligned
        cols = self._extra + _NUM_SAMPLING_COLS
        self._static = torch.zeros(max_batch, cols, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._staging = torch.zeros(max_batch, cols, dtype=torch.int32, pin_memory=pin)
        self._host = self._staging.numpy()
        self._host_f32 = self._host.view(np.float32)
        self._host_i64 = self._host.view(np.int64)
        # Per staging row: the block_ids list whose first _row_lens[i] blocks it holds, and
        # the sequence whose sampling parameters it holds.
        self._row_lists: list[list[int] | None] = [None] * max_batch
        self._row_lens: list[int] = [0] * max_batch
        self._row_seqs: list[object | None] = [None] * max_batch
        # The last sampled step's tokens (read by the next graph through the source
        # column) and the row of each of its sequences, and two host buffers the tokens
        # are copied to in turn (a step's copy never overwrites the one before, which the
        # host may still be reading).
        if sampled is None or sampled.tokens.shape[0] < max_batch:
            sampled = SampledTokens.allocate(max_batch, device)
        self.sampled = sampled
        self._host_tokens = HostTokens(device, max_batch)
        # Every size's forward writes its `[b, V]` float32 log-probs into the first b rows
        # of one buffer (outside the graph pool), so captured sizes do not each keep their
        # own; one step runs at a time and its rows are read before the next runs.
        self._logprobs = torch.empty(max_batch, attention.lm_head.shape[0], dtype=torch.float32,
                                     device=device)
        self._out: torch.Tensor | None = None  # the last run's `[b, V]` log-probs
        # The forward's greedy tokens (argmax of each row's log-probs, first maximum)
        self._greedy = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self._query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._copied = torch.cuda.Event() if capture else None
        self.num_steps = 0  # decode steps served (padded forwards run)

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def can_run(self, scheduled: list[ScheduledSeq]) -> bool:
        """True for a decode-shaped step that fits: one new token per sequence, at most
        the largest size, block tables within W."""
        return (0 < len(scheduled) <= self.sizes[-1]
                and all(s.num_new_tokens == 1 for s in scheduled)
                and all(len(s.seq.block_ids) <= self.table_width for s in scheduled))

    def run(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Log-probabilities `[n, V]` float32 of the next token of each sequence (its one
        new token's row), bitwise equal to the eager forward. Call :meth:`can_run` first.

        Writes the new tokens' K/V into the cache; captures the size on first use.
        """
        n = len(scheduled)
        b = padded_size(n, self.sizes)
        assert b is not None and self.can_run(scheduled)
        self._fill(scheduled, b)
        self._static[:b].copy_(self._staging[:b], non_blocking=True)
        if not self.capture:
            self.num_steps += 1
            self._out = self._forward(b)
            return self._out[:n]
        self._copied.record()
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._capture(b)
        graph, out = entry
        graph_step = getattr(self.experts, "graph_step", None)
        if graph_step is not None:
            graph_step(b, self.microbatches)
        graph.replay()
        finish_step = getattr(self.experts, "finish_step", None)
        if finish_step is not None:  # bounded: the step's reader checks (DecodeStep.check)
            finish_step(block=False)
        self.num_steps += 1
        self._out = out
        return out[:n]

    def sample(self, scheduled: list[ScheduledSeq]) -> DecodeStep:
        """Sample the next token of each sequence of the last :meth:`run` (``scheduled``
        must be its list) from its log-probs and the rows' sampling columns, on the
        device, and start copying the tokens to the host. No host synchronisation:
        ``kernels.sample`` reads its parameters on the host and gets the staging rows'
        copies of them.
        """
        n = len(scheduled)
        rows = self._host[:n]  # this step's staging rows (the next _fill has not run)
        extra = self._extra
        tokens = self._sample_tokens(n)
        self.sampled.tokens[:n].copy_(tokens)
        self.sampled.rows = {s.seq: i for i, s in enumerate(scheduled)}
        wanted = np.flatnonzero(rows[:, extra + _LOGPROBS] >= 0).tolist()
        return DecodeStep(scheduled, self._host_tokens.copy(tokens),
                          [(i, int(rows[i, extra + _LOGPROBS])) for i in wanted],
                          check=getattr(self.experts, "check_steps", None))

    def _sample_tokens(self, n: int) -> torch.Tensor:
        """`[n]` int64 tokens of the last run's rows ``[:n]`` (device work only)."""
        logprobs, extra = self._out[:n], self._extra  # [n, V] fp32
        if (self._host_f32[:n, extra + _TEMPERATURE] > 0).any():
            # The filter parameters from the host rows (the sampler reads them there: no
            # device-to-host copy); seeds and positions from the device rows.
            floats = torch.from_numpy(self._host_f32[:n, extra + _TEMPERATURE:extra + _MIN_P + 1])
            top_ks = torch.from_numpy(self._host[:n, extra + _TOP_K]).long()
            seeds = self._static[:n, extra + _SEED:extra + _SEED + 2].view(torch.int64)[:, 0]
            return kernels.sample(
                logprobs, floats[:, 0], top_ks, floats[:, 1], floats[:, 2], seeds,
                self._static[:n, _POSITION].long() + 1)
        # kernels.sample's rule for greedy rows (argmax, first maximum), computed by the
        # forward's log-softmax. On CPU, HostTokens keeps the tensor itself as the host's
        # copy: one the next forward does not overwrite.
        greedy = self._greedy[:n]
        return greedy if greedy.is_cuda else greedy.clone()

    def last_logprobs(self, n: int) -> torch.Tensor:
        """The last run's log-probs `[n, V]` float32 (valid until the next run)."""
        return self._out[:n]

    def capture_all(self) -> int:
        """Capture every size not captured yet, over padding rows only (slot -1: no K/V is
        written), the largest first as vLLM does (the smaller ones reuse its blocks of
        the graph pool); the number captured."""
        if not self.capture:
            return 0
        self._host[:] = 0
        self._forget_rows(0)
        self._host[:, _SLOT] = -1
        self._host[:, _CONTEXT] = 1
        self._host[:, self._extra + _SOURCE] = -1
        todo = [b for b in reversed(self.sizes) if b not in self._graphs]
        for b in todo:
            self._static[:b].copy_(self._staging[:b])
            self._capture(b, logging.DEBUG)
        return len(todo)

    def _fill(self, scheduled: list[ScheduledSeq], b: int) -> None:
        """Rows of the static layout (module NOTE) into the host staging buffer.

        The block-table columns are kept between steps: a row still holding the same
        sequence (the same ``block_ids`` list object, which only grows in place; releasing
        blocks replaces the list, see ``Sequence``) gets only its new blocks written. The
        other columns are written for all rows at once."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the staging rows
        host, bs, n = self._host, self.block_size, len(scheduled)
        row_lists, row_lens, row_seqs = self._row_lists, self._row_lens, self._row_seqs
        sampled_rows = self.sampled.rows
        positions = [0] * n
        tokens = [0] * n
        sources = [-1] * n
        for i, s in enumerate(scheduled):
            seq = s.seq
            pos = positions[i] = seq.num_computed_tokens
            num_prompt = len(seq.prompt_token_ids)
            if pos < num_prompt:
                tokens[i] = seq.prompt_token_ids[pos]
            elif pos - num_prompt < len(seq.output_token_ids):
                tokens[i] = seq.output_token_ids[pos - num_prompt]
            else:  # sampled by the last step, not read by the host yet
                sources[i] = sampled_rows[seq]
            if row_seqs[i] is not seq:
                self._write_sampling(i, seq)
                row_seqs[i] = seq
            blocks, done = seq.block_ids, row_lens[i]
            if row_lists[i] is not blocks or done > len(blocks):
                host[i, _TABLE:_TABLE + len(blocks)] = blocks
                host[i, _TABLE + len(blocks):_TABLE + self.table_width] = 0
                row_lists[i], row_lens[i] = blocks, len(blocks)
            elif done < len(blocks):
                host[i, _TABLE + done:_TABLE + len(blocks)] = blocks[done:]
                row_lens[i] = len(blocks)
        pos = np.array(positions, dtype=np.int32)  # [n]
        rows = host[:n]
        rows[:, _TOKEN] = tokens
        rows[:, self._extra + _SOURCE] = sources
        rows[:, _POSITION] = pos
        rows[:, _SLOT] = rows[np.arange(n), _TABLE + pos // bs] * bs + pos % bs
        rows[:, _CONTEXT] = pos + 1
        host[n:b] = host[0]
        host[n:b, _SLOT] = -1
        self._forget_rows(n)

    def _write_sampling(self, i: int, seq) -> None:
        """Staging row ``i``'s sampling columns from ``seq``'s parameters."""
        params, col = seq.params, self._extra
        self._host[i, col + _TOP_K] = params.top_k
        self._host[i, col + _LOGPROBS] = -1 if params.logprobs is None else params.logprobs
        self._host_f32[i, col + _TEMPERATURE:col + _MIN_P + 1] = (
            params.temperature, params.top_p, params.min_p)
        self._host_i64[i, (col + _SEED) // 2] = seq.seed

    def _forget_rows(self, start: int) -> None:
        """Rows ``start..`` no longer hold a sequence's block table or sampling parameters
        (padding overwrote them)."""
        self._row_lists[start:] = [None] * (len(self._row_lists) - start)
        self._row_lens[start:] = [0] * (len(self._row_lens) - start)
        self._row_seqs[start:] = [None] * (len(self._row_seqs) - start)

    def _forward(self, b: int) -> torch.Tensor:
        """The decode forward over static rows ``[:b]``: `[b, V]` float32 log-probs."""
        rows = self._static[:b]
        m = self.microbatches
        part = b // m  # captured sizes are multiples of m
        batches = []
        for i in range(m):
            r = rows[i * part:(i + 1) * part]
            # every column a layer reads is made contiguous once here, not by each
            # layer's kernels (rotary's .contiguous(): two copy launches a layer)
            batches.append(MicroBatch(r[:, _TOKEN], AttentionMetadata(
                positions=r[:, _POSITION].contiguous(),
                slot_mapping=r[:, _SLOT].contiguous(),
                block_tables=r[:, _TABLE:_TABLE + self.table_width].contiguous(),
                context_lens=r[:, _CONTEXT].contiguous(),
                query_start_loc=self._query_start_loc[: part + 1],
                one_token_per_seq=True,
            ), sources=r[:, self._extra + _SOURCE], sampled=self.sampled.tokens))
        hidden = run_layers(self.attention, self.experts, batches, self.kv_caches)
        hidden = torch.cat(hidden) if m > 1 else hidden[0]  # [b, D]
        return kernels.log_softmax(self.attention.logits(hidden), self._greedy[:b],
                                   out=self._logprobs[:b])

    def _capture(self, b: int, level: int = logging.INFO) -> tuple[torch.cuda.CUDAGraph,
                                                                     torch.Tensor]:
        entry = self._graphs[b] = capture_forward(self._forward, b, self._pool)
        logger.log(level, "captured a decode CUDA graph for batch size %d", b)
        return entry


"""ModelRunner: turns a scheduled step into model inputs, runs the layers, samples.

Shape legend: T = tokens in the step, S = scheduled sequences, B = rows whose logits are
needed (sampling rows, plus prompt rows of requests asking for prompt logprobs), n = rows
that sample, V = vocab.

NOTE: an eager step (prefill, mixed, drafts) is launched without a host synchronisation
on CUDA: its inputs (token ids, positions, slots, block tables, context lengths, row
offsets, logit rows, seeds) are packed into one pinned host buffer and copied with one
non-blocking transfer (:class:`PinnedStaging`); the sampler gets its filter parameters as
host tensors; the sampled tokens go to a pinned host buffer with an event
(:class:`EagerStep`), waited for only where the host reads them (:meth:`ModelRunner.results`).
Reading logprobs (token or prompt) synchronises, at that read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from megaserve import kernels
from megaserve.comm import CommError
from megaserve.engine import logits_processing, spec_decode, spec_graphs
from megaserve.engine.cuda_graphs import (DecodeGraphs, DecodeStep, HostTokens, SampledTokens,
                                          TokenCopy, capture_sizes)
from megaserve.engine.micro_batch import micro_batch_arrays, micro_batch_from_tensors
from megaserve.engine.scheduler import ScheduledSeq
from megaserve.models.attention_part import AttentionPart
from megaserve.models.forward import ExpertClient, LocalExperts, run_layers

logger = logging.getLogger(__name__)


@dataclass
class SeqResult:
    """What one step produced for one sequence."""

    # Tokens the step produced: none, one sampled token, or with speculative decoding
    # the accepted drafts followed by one target token (a correction or the bonus).
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[dict[int, float]] | None = None  # one per token (when requested)
    num_accepted: int = 0  # draft tokens accepted (their K/V are valid)
    # (position p, logprobs of prompt token p + 1) for prompt rows computed this step
    prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)


@dataclass
class EagerStep:
    """An eagerly launched step whose sampled tokens are on their way to the host.

    :meth:`ModelRunner.results` turns it into one :class:`SeqResult` per scheduled
    sequence; read it before the second eager step launched after it (the host buffer
    its tokens land in is then reused).
    """

    scheduled: list[ScheduledSeq]
    row_owner: list[tuple[int, int]]  # (sequence index, position) of each logit row
    picks: list[tuple[int, int, int]]  # (logit row, sequence index, position) sampled
    logprobs: torch.Tensor | None  # `[B, V]` float32 on the device; None: no logit rows
    copy: TokenCopy | None  # the tokens, one per pick, on their way to the host; None: no picks

    def token_ids(self) -> list[int]:
        """The sampled tokens, one per pick (waits for their copy: no stream sync)."""
        return self.copy.ids()


# Bytes between the arrays of one staged transfer: every device view starts aligned as a
# fresh allocation would be for the kernels' pointer arguments (Triton specialises on 16).
_STAGING_ALIGN = 64
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32}


class PinnedStaging:
    """Host arrays → device tensors with one non-blocking transfer per call.

    On CUDA the arrays are packed into one of two pinned host buffers, taken in turn, and
    copied into one device buffer; both grow where a call needs more. On CPU the arrays
    become tensors as they are (no copy).

    NOTE hazards: a non-blocking copy reads its pinned source when the stream reaches
    it, so a host buffer is rewritten only after the event recorded behind its last copy
    (two calls back) has passed. The device buffer is rewritten by the next call's copy,
    which the stream orders after every kernel already launched on this call's tensors:
    launch all work on them before the next call, and never read them on the host.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host: list[torch.Tensor | None] = [None, None]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._device_buffer: torch.Tensor | None = None

    def to_device(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """One tensor per array (int64, int32 or float32; same shape) on the device."""
        if self.device.type != "cuda":
            return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _STAGING_ALIGN) * _STAGING_ALIGN
        k = self._next
        self._next ^= 1
        if self._copied[k] is None:
            self._copied[k] = torch.cuda.Event()
        else:
            self._copied[k].synchronize()  # the copy out of this buffer two calls back ran
        host = self._host[k]
        if host is None or host.numel() < total:
            host = self._host[k] = torch.empty(_grown(total, host), dtype=torch.uint8,
                                               pin_memory=True)
        staged = host.numpy()
        for a, offset in zip(arrays, offsets):
            staged[offset:offset + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = self._device_buffer
        if dev is None or dev.numel() < total:
            dev = self._device_buffer = torch.empty(_grown(total, dev), dtype=torch.uint8,
                                                    device=self.device)
        dev[:total].copy_(host[:total], non_blocking=True)
        self._copied[k].record()
        return [dev[offset:offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, offset in zip(arrays, offsets)]


def _grown(need: int, old: torch.Tensor | None) -> int:
    """A buffer size of at least ``need`` bytes, doubling ``old``'s (fewer regrowths)."""
    return max(need, 2 * old.numel() if old is not None else 0, 1 << 16)


def decode_results(step: DecodeStep) -> list[SeqResult]:
    """A decode step's tokens (waits for their copy) as one SeqResult per sequence."""
    logprobs = step.token_logprobs
    return [SeqResult([token], None if logprobs is None or logprobs[i] is None
                      else [logprobs[i]])
            for i, token in enumerate(step.token_ids())]


def split_microbatches(scheduled: list[ScheduledSeq], m: int) -> list[list[ScheduledSeq]]:
    """Split sequences into at most ``m`` contiguous groups of about equal token counts."""
    if m <= 1 or len(scheduled) <= 1:
        return [scheduled]
    total = sum(s.num_step_tokens for s in scheduled)
    groups: list[list[ScheduledSeq]] = [[]]
    acc = 0
    for s in scheduled:
        target = total * len(groups) / m
        if groups[-1] and acc >= target and len(groups) < m:
            groups.append([])
        groups[-1].append(s)
        acc += s.num_step_tokens
    return groups


class ModelRunner:
    """Executes steps for one attention worker (its KV cache and attention part).

    ``cuda_graphs``: on CUDA with in-process experts, decode steps of up to
    ``max_num_seqs`` sequences replay captured CUDA graphs (megaserve.engine.cuda_graphs);
    the outputs are bitwise those of eager execution. A public attribute: setting it to
    False switches back to eager steps (the captured graphs are kept). ``cpu_decode_graphs``:
    on CPU, run decode steps through the same padded forward, uncaptured (async
    scheduling needs its split of launch and sampling).

    Decode steps on the graphs run in two calls, :meth:`launch_decode` (the forward) and
    :meth:`sample_decode` (tokens on their way to the host), so that the host can work
    between them and while the tokens copy; other steps likewise in :meth:`launch` and
    :meth:`results`. :meth:`execute` runs any step at once.

    A sequence whose last token was sampled by the step before and not read by the host
    yet (``num_pending_tokens``, async scheduling) takes it from that step's tokens on the
    device (:class:`SampledTokens`, shared by the decode graphs and the eager steps).
    """

    def __init__(
        self,
        attention: AttentionPart,
        experts: ExpertClient,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_num_seqs: int,
        microbatches: int = 1,
        cuda_graphs: bool = True,
        num_speculative_tokens: int = 0,
        cpu_decode_graphs: bool = False,
    ) -> None:
        self.attention = attention
        self.experts = experts
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.microbatches = microbatches
        self.device = attention.device
        self.cuda_graphs = cuda_graphs
        self.max_num_seqs = max_num_seqs
        self.cpu_decode_graphs = cpu_decode_graphs
        # The model's EOS ids (min_tokens bans them); set by the engine.
        self.eos_token_ids: tuple[int, ...] = ()
        # Structured outputs' grammar masks (needs a tokenizer); set by the engine.
        self.grammars = None
        # Built on the first eager-capable decode step; tests may set one (capture=False).
        self.decode_graphs: DecodeGraphs | None = None
        # Speculative verification steps (k + 1 rows per sequence) replay graphs of their
        # own (megaserve.engine.spec_graphs), built on the first one; 0 runs them eagerly.
        self.num_speculative_tokens = num_speculative_tokens
        self.verify_graphs: spec_graphs.MultiTokenGraphs | None = None
        self._graphs_failed = False
        # Eager steps: inputs through pinned staging, tokens out through two pinned host
        # buffers used in turn (EagerStep says when a step must be read).
        self.staging = PinnedStaging(self.device)
        self.sampled = SampledTokens.allocate(
            capture_sizes(max(1, max_num_seqs), max(1, microbatches))[-1], self.device)
        self._host_tokens = HostTokens(self.device, max_num_seqs)

    def execute(self, scheduled: list[ScheduledSeq]) -> list[SeqResult]:
        """Run one step; returns one SeqResult per scheduled sequence, in order."""
        if self.launch_decode(scheduled):
            return decode_results(self.sample_decode(scheduled))
        return self.results(self.launch(scheduled))

    def launch(self, scheduled: list[ScheduledSeq]) -> EagerStep:
        """Launch a step eagerly (any kind of step): the forward, the logits of its logit
        rows, the sampling of its sampling rows on the device, and the tokens' copy to the
        host. On CUDA nothing here waits for the device, except a verification step on the
        verify graphs (speculative decoding). Read the step with :meth:`results`."""
        rows, row_owner = self._logit_rows(scheduled)
        picks = [
            (r, i, p) for r, (i, p) in enumerate(row_owner)
            if scheduled[i].samples and p >= scheduled[i].seq.num_tokens_with_pending - 1
        ]
        logprobs = self._verify_graph_logprobs(scheduled, rows)  # [B, V] fp32, or None
        groups = split_microbatches(scheduled, self.microbatches) if logprobs is None else []
        sampled = self._sampled_tokens()
        arrays: list[np.ndarray] = []
        fed = []  # per group: whether some input token comes from the device
        for group in groups:
            inputs, sources = self._group_inputs(group, sampled.rows)
            arrays += micro_batch_arrays(inputs, self.block_size)
            fed.append(sources is not None)
            if sources is not None:
                arrays.append(sources)
        gather = bool(groups) and bool(rows)
        if gather:
            arrays.append(np.array(rows, dtype=np.int64))  # [B]
        greedy = all(scheduled[i].seq.params.greedy for _, i, _ in picks)
        every_row = len(picks) == len(rows)  # the picks are rows 0..B-1
        if picks and not (greedy and every_row):
            # (logit row, seed, position of the token being generated: it keys the draw)
            arrays.append(np.array([[r for r, _, _ in picks],
                                    [scheduled[i].seq.seed for _, i, _ in picks],
                                    [p + 1 for _, _, p in picks]], dtype=np.int64))  # [3, n]
        staged = iter(self.staging.to_device(arrays))
        if groups:
            batches = [micro_batch_from_tensors(staged, sampled.tokens if f else None) for f in fed]
            self.experts.begin_step(len(groups))
            hidden = run_layers(self.attention, self.experts, batches, self.kv_caches)
            h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]  # [T, D]
            self._wait_experts()
            if gather:
                logprobs = kernels.log_softmax(self.attention.logits(h[next(staged)]))  # [B, V]
        if not picks:
            return EagerStep(scheduled, row_owner, picks, logprobs, None)
        cols = next(staged) if not (greedy and every_row) else None  # [3, n] int64
        picked = logprobs if every_row else logprobs[cols[0]]  # [n, V]
        if any(scheduled[i].seq.params.adjusts_logits for _, i, _ in picks):
            picked = self._adjusted(scheduled, picks, picked, sampled)  # [n, V], a copy
        if greedy:  # kernels.sample's rule for greedy rows: argmax, first maximum
            tokens = picked.argmax(dim=-1)
        else:
            tokens = self._sample_rows(scheduled, picks, picked, cols)
        if not any(s.num_draft_tokens for s in scheduled):
            n = tokens.shape[0]  # one pick per sampling sequence
            if n <= sampled.tokens.shape[0]:
                sampled.tokens[:n].copy_(tokens)
                sampled.rows = {scheduled[i].seq: j for j, (_, i, _) in enumerate(picks)}
        return EagerStep(scheduled, row_owner, picks, logprobs, self._host_tokens.copy(tokens))

    def results(self, step: EagerStep) -> list[SeqResult]:
        """The host's part of a launched eager step: waits for its tokens (an event, no
        stream synchronisation), verifies drafts, reads logprobs where asked (those reads
        synchronise). One SeqResult per scheduled sequence, in order."""
        assert step.copy is None or self._host_tokens.holds(step.copy), \
            "an eager step read after its token buffer was reused"
        results = [SeqResult() for _ in step.scheduled]
        if step.picks:
            self._apply_samples(step, step.token_ids(), results)
        if step.logprobs is not None:
            self._prompt_logprobs(step.scheduled, step.row_owner, step.logprobs, results)
        return results

    def launch_decode(self, scheduled: list[ScheduledSeq]) -> bool:
        """Start a decode step on the decode graphs (its forward; inputs of sequences
        with a pending token come from the last sampled step on the device); False, with
        nothing run, where the step is not one (drafts, prefill rows, prompt logprobs,
        too large) or the graphs are off: then :meth:`execute` runs it eagerly. Follow a
        True with :meth:`sample_decode` before the next launch."""
        if not self._is_graph_decode(scheduled):
            return False
        try:
            self.decode_graphs.run(scheduled)
        except CommError:
            raise  # a lost expert worker is not a capture failure
        except RuntimeError as e:
            # Capture failed (a host sync in some kernel). The warm-up wrote the same K/V
            # values the eager step writes again, so falling back is safe.
            logger.warning("decode CUDA graph capture failed, running eagerly: %s", e)
            self._graphs_failed = True
            return False
        return True

    def sample_decode(self, scheduled: list[ScheduledSeq]) -> DecodeStep:
        """Sample the launched decode step's tokens (its logprobs too, where asked: that
        waits for the tokens) and start copying them to the host."""
        step = self.decode_graphs.sample(scheduled)
        if step.logprob_rows:
            token_ids = step.token_ids()
            logprobs = self.decode_graphs.last_logprobs(len(scheduled))
            step.token_logprobs = [None] * len(scheduled)
            for i, num in step.logprob_rows:
                step.token_logprobs[i] = _top_logprobs(logprobs[i], num, token_ids[i])
        return step

    def _is_graph_decode(self, scheduled: list[ScheduledSeq]) -> bool:
        """True for a step the decode graphs run: every sequence samples after one new
        token (no drafts, no prompt rows), within the graphs' sizes."""
        if not scheduled or not self.cuda_graphs or self._graphs_failed:
            return False
        for s in scheduled:
            if not s.samples or s.num_new_tokens != 1 or s.num_draft_tokens \
                    or s.seq.params.adjusts_logits:  # adjusted in eager steps only
                return False
        if self.decode_graphs is None and not self._build_decode_graphs():
            return False
        return self.decode_graphs.can_run(scheduled)

    def _verify_graph_logprobs(
        self, scheduled: list[ScheduledSeq], rows: list[int]
    ) -> torch.Tensor | None:
        """Log-probs `[B, V]` from the verify graphs for a verification step; None where
        the eager path must run."""
        if not self.cuda_graphs or self._graphs_failed:
            return None
        if any(s.num_draft_tokens for s in scheduled):
            return self._verify_logprobs(scheduled, rows)
        return None

    def _verify_logprobs(
        self, scheduled: list[ScheduledSeq], rows: list[int]
    ) -> torch.Tensor | None:
        """Log-probs `[B, V]` of a verification step from the verify graphs (CUDA,
        in-process experts); None where the eager path must run."""
        if self.verify_graphs is None:
            if (not self.num_speculative_tokens or self.device.type != "cuda"
                    or not isinstance(self.experts, LocalExperts)):
                return None
            self.verify_graphs = spec_graphs.MultiTokenGraphs(
                self.attention, self.experts.experts, self.kv_caches, self.block_size,
                min(self.max_num_seqs, spec_graphs.MAX_GRAPH_BATCH),
                int(self.attention.cos.shape[0]),
                query_len=self.num_speculative_tokens + 1)
        try:
            return spec_graphs.verify_logprobs(self.verify_graphs, scheduled, rows)
        except RuntimeError as e:  # capture failed; falling back is safe (see above)
            logger.warning("verification CUDA graph capture failed, running eagerly: %s", e)
            self._graphs_failed = True
            return None

    def _wait_experts(self) -> None:
        """On the device data plane, wait (bounded by the client's timeout) until the
        experts' rows of this eager step are in: a dead expert worker raises, never hangs."""
        finish_step = getattr(self.experts, "finish_step", None)
        if finish_step is not None:
            finish_step()

    def capture_decode_graphs(self) -> int:
        """Capture every decode graph size now instead of on first use (replicas that
        share expert workers: megaserve.runtime.device_engine says why; a server's
        engine: megaserve.runtime.async_engine); the number captured."""
        if not self.cuda_graphs or self._graphs_failed:
            return 0
        if self.decode_graphs is None and not self._build_decode_graphs():
            return 0
        return self.decode_graphs.capture_all()

    def _build_decode_graphs(self) -> bool:
        """Create the decode graphs (CUDA; in-process experts, or the device data plane,
        whose dispatch and combine are captured too); False where off."""
        if isinstance(self.experts, LocalExperts):
            client, microbatches = self.experts.experts, 1
        elif hasattr(self.experts, "graph_step"):
            client, microbatches = self.experts, self.microbatches
        else:
            return False
        capture = self.device.type == "cuda"
        if not capture and not self.cpu_decode_graphs:
            return False
        try:
            self.decode_graphs = DecodeGraphs(
                self.attention, client, self.kv_caches, self.block_size,
                self.max_num_seqs, int(self.attention.cos.shape[0]), capture=capture,
                microbatches=microbatches, sampled=self.sampled,
            )
        except ValueError as e:  # e.g. max_num_seqs < 1
            logger.info("decode CUDA graphs off: %s", e)
            self._graphs_failed = True
            return False
        return True

    def _sampled_tokens(self) -> SampledTokens:
        """Where the last sampling step's tokens are on the device (the decode graphs'
        buffer where graphs exist: the runner's own unless a caller set other graphs)."""
        return self.decode_graphs.sampled if self.decode_graphs is not None else self.sampled

    @staticmethod
    def _group_inputs(
        group: list[ScheduledSeq], sampled_rows: dict[object, int]
    ) -> tuple[list[tuple[list[int], int, list[int]]], np.ndarray | None]:
        """``group``'s (token ids, first position, block ids) per sequence, for
        :func:`micro_batch_arrays`: new tokens, then draft tokens; and the group's source
        rows `[T]` int64 (row of the last step's sampled tokens holding a token the host
        has not read, else -1), None where every token is on the host."""
        inputs = []
        sources: list[tuple[int, int]] = []  # (token row in the group, sampled row)
        offset = 0
        for s in group:
            seq = s.seq
            begin = seq.num_computed_tokens
            end = begin + s.num_new_tokens
            known = seq.num_tokens
            token_ids = seq.token_ids(begin, min(end, known))
            if end > known:  # sampled by the step in flight (async scheduling)
                assert end == known + 1 and seq.num_pending_tokens, (seq.request_id, end, known)
                sources.append((offset + len(token_ids), sampled_rows[seq]))
                token_ids = token_ids + [0]
            if s.draft_token_ids:
                token_ids = token_ids + list(s.draft_token_ids)
            inputs.append((token_ids, begin, seq.block_ids))
            offset += len(token_ids)
        if not sources:
            return inputs, None
        source_rows = np.full(offset, -1, dtype=np.int64)
        for row, sampled_row in sources:
            source_rows[row] = sampled_row
        return inputs, source_rows

    def _adjusted(self, scheduled: list[ScheduledSeq], picks: list[tuple[int, int, int]],
                  picked: torch.Tensor, sampled: SampledTokens) -> torch.Tensor:
        """``logits_processing.adjust`` of the picked rows `[n, V]`. Each row sees the
        tokens generated before the one it samples: the host's, the one the step before
        sampled (async scheduling: read from the device) and the drafts before it."""
        requests = []
        for _, i, p in picks:
            item, seq = scheduled[i], scheduled[i].seq
            generated = list(seq.output_token_ids)
            if seq.num_pending_tokens:
                generated.append(int(sampled.tokens[sampled.rows[seq]]))
            generated += list(item.draft_token_ids or ())
            requests.append((seq.params, seq.prompt_token_ids,
                             generated[:p + 1 - seq.num_prompt_tokens], seq))
        return logits_processing.adjust(picked, requests, self.eos_token_ids, self.grammars)

    def _sample_rows(self, scheduled: list[ScheduledSeq], picks: list[tuple[int, int, int]],
                     logprobs: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """``kernels.sample`` of the picked rows' log-probs `[n, V]`: `[n]` int64 on the
        device. Its filter parameters go as host tensors (it reads them on the host: no
        device-to-host copy); seeds and positions (``cols[1:]``) are on the device."""
        params = [scheduled[i].seq.params for _, i, _ in picks]
        floats = torch.tensor([(q.temperature, q.top_p, q.min_p) for q in params],
                              dtype=torch.float32)  # [n, 3]
        top_ks = torch.tensor([q.top_k for q in params], dtype=torch.int64)
        return kernels.sample(logprobs, floats[:, 0], top_ks, floats[:, 1], floats[:, 2],
                              cols[1], cols[2])

    @staticmethod
    def _logit_rows(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[tuple[int, int]]]:
        """Rows of the step's hidden states that need logits, and (sequence index,
        position) for each: the last new row and every draft row of sampling sequences
        and, for prompt logprobs, every row whose next token is still a prompt token.
        A token the host has not read yet (async scheduling) counts in the positions."""
        rows: list[int] = []
        owner: list[tuple[int, int]] = []
        offset = 0
        for i, s in enumerate(scheduled):
            begin = s.seq.num_computed_tokens
            if s.seq.wants_prompt_logprobs():
                for p in range(begin, min(begin + s.num_new_tokens, s.seq.num_prompt_tokens - 1)):
                    rows.append(offset + p - begin)
                    owner.append((i, p))
            if s.samples:
                for d in range(s.num_draft_tokens + 1):
                    rows.append(offset + s.num_new_tokens - 1 + d)
                    owner.append((i, s.seq.num_tokens_with_pending - 1 + d))
            offset += s.num_step_tokens
        return rows, owner

    def _apply_samples(self, step: EagerStep, tokens: list[int],
                       results: list[SeqResult]) -> None:
        """Each sampling sequence's result from its picked tokens: the token, or with
        drafts their verification (megaserve.engine.spec_decode); logprobs where asked."""
        scheduled, logprobs = step.scheduled, step.logprobs
        per_seq: dict[int, list[tuple[int, int]]] = {}
        for (r, i, _), token in zip(step.picks, tokens):
            per_seq.setdefault(i, []).append((r, token))
        for i, rows in per_seq.items():
            item, seq = scheduled[i], scheduled[i].seq
            if item.num_draft_tokens:
                draft_rows = None if seq.params.greedy else logprobs[
                    torch.tensor([r for r, _ in rows], device=self.device)]
                ids, accepted = spec_decode.verify(item, draft_rows, [t for _, t in rows])
            else:
                ids, accepted = [rows[0][1]], 0
            results[i].token_ids, results[i].num_accepted = ids, accepted
            if seq.params.logprobs is not None:
                results[i].token_logprobs = [
                    _top_logprobs(logprobs[r], seq.params.logprobs, t)
                    for (r, _), t in zip(rows, ids)
                ]

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledSeq],
        row_owner: list[tuple[int, int]],
        logprobs: torch.Tensor,
        results: list[SeqResult],
    ) -> None:
        """Record the logprobs of each prompt token whose preceding row ran this step."""
        for r, (i, p) in enumerate(row_owner):
            seq = scheduled[i].seq
            if p + 1 < seq.num_prompt_tokens and seq.wants_prompt_logprobs():
                next_token = seq.prompt_token_ids[p + 1]
                results[i].prompt_logprobs.append(
                    (p, _top_logprobs(logprobs[r], seq.params.prompt_logprobs, next_token))
                )


def _top_logprobs(row: torch.Tensor, n: int, token: int) -> dict[int, float]:
    """The ``n`` most likely tokens of a `[V]` logprob row, plus ``token``."""
    out: dict[int, float] = {}
    if n > 0:
        values, ids = torch.topk(row, min(n, row.shape[0]))
        out = dict(zip(ids.tolist(), values.tolist()))
    out[token] = float(row[token])
    return out

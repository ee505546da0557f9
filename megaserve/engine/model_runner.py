"""ModelRunner: turns a scheduled step into model inputs, runs the layers, samples.

Shape legend: T = tokens in the step, S = scheduled sequences, B = rows whose logits are
needed (sampling rows, plus prompt rows of requests asking for prompt logprobs), V = vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from megaserve import kernels
from megaserve.comm import CommError
from megaserve.engine import spec_decode, spec_graphs
from megaserve.engine.cuda_graphs import DecodeGraphs, DecodeStep
from megaserve.engine.scheduler import ScheduledSeq
from megaserve.models.attention_part import AttentionMetadata, AttentionPart
from megaserve.models.forward import ExpertClient, LocalExperts, MicroBatch, run_layers

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
    between them and while the tokens copy; :meth:`execute` runs any step at once.
    """

    def __init__(
        self,
        attention: AttentionPart,
        experts: ExpertClient,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        microbatches: int = 1,
        cuda_graphs: bool = True,
        max_num_seqs: int = 64,
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
        # Built on the first eager-capable decode step; tests may set one (capture=False).
        self.decode_graphs: DecodeGraphs | None = None
        # Speculative verification steps (k + 1 rows per sequence) replay graphs of their
        # own (megaserve.engine.spec_graphs), built on the first one; 0 runs them eagerly.
        self.num_speculative_tokens = num_speculative_tokens
        self.verify_graphs: spec_graphs.MultiTokenGraphs | None = None
        self._graphs_failed = False

    def execute(self, scheduled: list[ScheduledSeq]) -> list[SeqResult]:
        """Run one step; returns one SeqResult per scheduled sequence, in order."""
        if self.launch_decode(scheduled):
            step = self.sample_decode(scheduled)
            logprobs = step.token_logprobs
            return [SeqResult([token], None if logprobs is None or logprobs[i] is None
                              else [logprobs[i]])
                    for i, token in enumerate(step.token_ids())]
        rows, row_owner = self._logit_rows(scheduled)
        results = [SeqResult() for _ in scheduled]
        logprobs = self._verify_graph_logprobs(scheduled, rows)  # [B, V] fp32, or None
        if logprobs is None:
            groups = split_microbatches(scheduled, self.microbatches)
            self.experts.begin_step(len(groups))
            hidden = run_layers(
                self.attention, self.experts, [self._micro_batch(g) for g in groups],
                self.kv_caches,
            )
            h = torch.cat(hidden) if len(hidden) > 1 else hidden[0]  # [T, D]
            self._wait_experts()
            if not rows:
                return results
            logprobs = kernels.log_softmax(
                self.attention.logits(h[torch.tensor(rows, device=self.device)])
            )  # [B, V] fp32
        self._sample(scheduled, row_owner, logprobs, results)
        self._prompt_logprobs(scheduled, row_owner, logprobs, results)
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
            if not s.samples or s.num_new_tokens != 1 or s.num_draft_tokens:
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
                self.max_num_seqs, int(self.attention.cos.shape[0]),
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

    def capture_decode_graphs(self) -> None:
        """Capture every decode graph size now instead of on first use (replicas that
        share expert workers: megaserve.runtime.device_engine says why)."""
        if not self.cuda_graphs or self._graphs_failed:
            return
        if self.decode_graphs is None and not self._build_decode_graphs():
            return
        self.decode_graphs.capture_all()

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
                microbatches=microbatches,
            )
        except ValueError as e:  # e.g. max_num_seqs < 1
            logger.info("decode CUDA graphs off: %s", e)
            self._graphs_failed = True
            return False
        return True

    def _micro_batch(self, group: list[ScheduledSeq]) -> MicroBatch:
        """The step's tokens of ``group``: new tokens, then draft tokens, per sequence."""
        return build_micro_batch(
            [(s.seq.token_ids(s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens)
              + list(s.draft_token_ids), s.seq.num_computed_tokens, s.seq.block_ids) for s in group],
            self.block_size, self.device,
        )

    @staticmethod
    def _logit_rows(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[tuple[int, int]]]:
        """Rows of the step's hidden states that need logits, and (sequence index,
        position) for each: the last new row and every draft row of sampling sequences
        and, for prompt logprobs, every row whose next token is still a prompt token."""
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
                    owner.append((i, s.seq.num_tokens - 1 + d))
            offset += s.num_step_tokens
        return rows, owner

    def _sample(
        self,
        scheduled: list[ScheduledSeq],
        row_owner: list[tuple[int, int]],
        logprobs: torch.Tensor,
        results: list[SeqResult],
    ) -> None:
        """Sample the next token of every sequence that completed its tokens this step;
        a sequence with drafts gets them verified (megaserve.engine.spec_decode)."""
        # (row, sequence index, position of the row's token) for each generating row.
        picks = [
            (r, i, p) for r, (i, p) in enumerate(row_owner)
            if scheduled[i].samples and p >= scheduled[i].seq.num_tokens - 1
        ]
        if not picks:
            return
        # One pass over the rows, two host-to-device copies: (temperature, top_p, min_p)
        # as float32, (row, top_k, seed, position of the token being generated: it keys
        # the random draw) as int64.
        float_rows, int_rows = [], []
        for r, i, p in picks:
            seq = scheduled[i].seq
            params = seq.params
            float_rows.append((params.temperature, params.top_p, params.min_p))
            int_rows.append((r, params.top_k, seq.seed, p + 1))
        floats = np.array(float_rows, dtype=np.float32).T.copy()  # [3, n]
        ints = np.array(int_rows, dtype=np.int64).T.copy()  # [4, n]
        floats_d = torch.from_numpy(floats).to(self.device)
        ints_d = torch.from_numpy(ints).to(self.device)
        tokens = kernels.sample(
            logprobs[ints_d[0]], floats_d[0], ints_d[1], floats_d[1], floats_d[2],
            ints_d[2], ints_d[3],
        ).tolist()
        per_seq: dict[int, list[tuple[int, int]]] = {}
        for (r, i, _), token in zip(picks, tokens):
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


def build_micro_batch(
    inputs: list[tuple[list[int], int, list[int]]], block_size: int, device: torch.device
) -> MicroBatch:
    """A micro-batch from (token ids, position of the first, block table) per sequence;
    every token's K/V go to its slot in the sequence's blocks."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    context_lens: list[int] = []
    starts = [0]
    max_blocks = max(len(block_ids) for _, _, block_ids in inputs)
    table_rows: list[list[int]] = []  # block tables zero-padded to max_blocks
    for token_ids, begin, block_ids in inputs:
        end = begin + len(token_ids)
        ids += token_ids
        positions += range(begin, end)
        slots += [block_ids[p // block_size] * block_size + p % block_size for p in range(begin, end)]
        context_lens.append(end)
        starts.append(starts[-1] + len(token_ids))
        table_rows.append(list(block_ids) + [0] * (max_blocks - len(block_ids)))
    tables = torch.tensor(table_rows, dtype=torch.int32).view(len(inputs), max_blocks)

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)

    meta = AttentionMetadata(
        positions=dev(positions, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        block_tables=tables.to(device),
        context_lens=dev(context_lens, torch.int32),
        query_start_loc=dev(starts, torch.int32),
    )
    return MicroBatch(dev(ids, torch.int64), meta)


def _top_logprobs(row: torch.Tensor, n: int, token: int) -> dict[int, float]:
    """The ``n`` most likely tokens of a `[V]` logprob row, plus ``token``."""
    out: dict[int, float] = {}
    if n > 0:
        values, ids = torch.topk(row, min(n, row.shape[0]))
        out = dict(zip(ids.tolist(), values.tolist()))
    out[token] = float(row[token])
    return out

"""LLMEngine: the engine of one attention worker. ``step()`` = schedule, execute, make
outputs.

A step runs in two halves: launch (the forward and the sampling, on the device, with no
host synchronisation on CUDA) and read (wait for the tokens' copy to the host, append
them, check stops, make outputs). Decode steps on the decode graphs launch through
``ModelRunner.launch_decode`` / ``sample_decode``, every other step (prefill, mixed,
drafts, prompt logprobs, eager) through ``ModelRunner.launch``. With ``async_scheduling``
a step's tokens are read one step later, so the host's work overlaps the device's:

    host:    schedule n+1 | launch n+1 | read n's tokens, outputs | schedule n+2 ...
    device:  ... step n (forward, sample, copy) | step n+1 forward (inputs: n's tokens) ...

A step of a sequence whose last token is still on the device (``num_pending_tokens``)
takes it from step n's sampled tokens on the device (megaserve.engine.cuda_graphs,
``SampledTokens``). The launch counts the step's tokens as computed and registers its
full prompt blocks in the prefix cache (the K/V writes are ordered on the device stream
before anything a later step reads). A sequence that stops on step n's token (EOS, a stop
string) was already in step n+1: that step's token is dropped and its K/V write lands in
blocks freed meanwhile, harmlessly, for the same reason. Without ``async_scheduling``
each step is read right after its launch.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from megaserve.kernels import api as kernels_api
from megaserve.engine import memory
from megaserve.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from megaserve.engine.cuda_graphs import DecodeStep
from megaserve.engine.kv_cache import BlockPool, allocate_kv_tensors
from megaserve.engine.model_runner import EagerStep, ModelRunner, SeqResult, decode_results
from megaserve.engine.output_processor import OutputProcessor
from megaserve.engine.prefix_cache import root_hash
from megaserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from megaserve.engine.sequence import Sequence, SeqStatus
from megaserve.models.config import ModelConfig
from megaserve.models.forward import ExpertClient, LocalExperts
from megaserve.models.loader import load_model
from megaserve.models.resolved import ResolvedModel
from megaserve.outputs import RequestOutput
from megaserve.sampling_params import SamplingParams
from megaserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    # Prefix cache, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits): the hit
    # rate is hits / queries.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Speculative decoding: drafts proposed and accepted (acceptance rate = ratio).
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


class LLMEngine:
    """Loads a model and serves requests step by step (not thread-safe: one caller).

    Raises ``ValueError`` at construction for a bad config, an unknown model path, a
    corrupt checkpoint or an unsupported architecture, naming the field or file.
    """

    def __init__(self, config: EngineConfig, experts: ExpertClient | None = None,
                 model: ResolvedModel | None = None) -> None:
        """``experts``: where routed tokens go (default: all experts in this process).
        ``model``: ``config.model`` resolved by the caller (a front-end over several
        engines resolves it once); None resolves it here."""
        self.config = config
        if config.device == "cpu":
            kernels_api.set_cpu_threads(config.cpu_threads)
        resolved = model or ResolvedModel.resolve(config.model)
        self.resolved_model = resolved
        path = resolved.path
        self.model_path = Path(path)
        self.tokenizer = load_tokenizer(path)
        self.max_model_len = resolve_max_model_len(config, resolved.config)
        start = memory.snapshot(config.device)  # before the weights (CUDA only)
        model = load_model(resolved, config.dtype, config.device, max_positions=self.max_model_len,
                           expert_ids=[] if experts is not None else None,
                           quantization=config.quantization)
        self.model_config = model.config
        self.model_name = config.model
        self.vocab_size = model.config.vocab_size
        experts = experts or LocalExperts(model.experts)
        # Before sizing the pool: a draft model's weights count as used memory, and its
        # K/V share the pool's block ids (each block costs both models' bytes).
        self.proposer = self._make_proposer()
        self.kv_plan = self._plan_kv_cache(model, experts, start)
        num_blocks = self.kv_plan.num_blocks
        self.pool = BlockPool(num_blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.block_size,
                            enable_prefix_caching=config.enable_prefix_caching,
                            cache_root=cache_root(path, model.attention.dtype, config.block_size,
                                                  config.quantization),
                            max_model_len=self.max_model_len),
            self.pool,
            num_drafts=self.proposer.num_proposals if self.proposer is not None else None,
        )
        self.async_scheduling = self._async_applies(experts)
        kv = allocate_kv_tensors(
            model.config.num_layers, num_blocks, config.block_size, model.config.cache_kv_heads,
            model.config.cache_head_dim, model.attention.dtype, model.attention.device,
            model.config.cache_shares_kv,
        )
        self.runner = ModelRunner(
            model.attention, experts, kv, config.block_size, config.max_num_seqs,
            microbatches=config.microbatches, cuda_graphs=config.cuda_graphs,
            num_speculative_tokens=(config.speculative_config.num_speculative_tokens
                                    if config.speculative_config is not None else 0),
            cpu_decode_graphs=self.async_scheduling,
        )
        self.eos_token_ids = resolve_eos_token_ids(self.tokenizer, model.config)
        self.runner.eos_token_ids = self.eos_token_ids
        if self.tokenizer is not None:
            from megaserve.engine.structured_output import GrammarMasks

            self.runner.grammars = GrammarMasks(self.tokenizer, model.config.vocab_size,
                                                self.eos_token_ids)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._draft_tokens = 0
        self._accepted_tokens = 0
        # The step whose tokens the host has not read yet (async scheduling).
        self._inflight: DecodeStep | EagerStep | None = None
        if self.proposer is not None:
            self.proposer.attach(self)

    def _async_applies(self, experts: ExpertClient) -> bool:
        """Whether ``config.async_scheduling`` can overlap steps here (logs why not)."""
        config = self.config
        if not config.async_scheduling:
            return False
        why = None
        if config.speculative_config is not None:
            why = "speculative decoding"
        elif not (isinstance(experts, LocalExperts) or getattr(experts, "overlaps_steps", False)):
            why = "experts outside this engine"
        elif config.device != "cpu" and not config.cuda_graphs:
            why = "cuda_graphs off"
        if why is not None:
            logger.info("async scheduling does not apply with %s: steps run synchronously", why)
            return False
        return True

    def _make_proposer(self):
        """The speculative proposer of ``config.speculative_config`` (None when off)."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if self.config.max_num_batched_tokens < spec.num_speculative_tokens + 1:
            raise ValueError(
                f"max_num_batched_tokens: {self.config.max_num_batched_tokens} cannot hold a "
                f"token and its {spec.num_speculative_tokens} speculative tokens")
        from megaserve.engine import spec_decode

        if spec.method == "ngram":
            return spec_decode.NgramProposer(spec, self.max_model_len)
        proposer = spec_decode.DraftModelProposer(spec, self.max_model_len)
        proposer.load(self.config, self.vocab_size)
        return proposer

    def _plan_kv_cache(self, model, experts: ExpertClient,
                       start: memory.DeviceSnapshot | None) -> memory.KVCachePlan:
        """Size the KV pool (megaserve.engine.memory) and log what fits."""
        cfg = self.model_config
        bytes_per_block = memory.kv_bytes_per_block(
            cfg.num_layers, self.config.block_size, cfg.cache_kv_heads, cfg.cache_head_dim,
            model.attention.dtype, cfg.cache_shares_kv)
        if self.proposer is not None:
            bytes_per_block += self.proposer.kv_bytes_per_block(self.config.block_size)
        profile = None
        sized = self.config.num_kv_blocks is not None or self.config.kv_cache_memory_bytes is not None
        if start is not None and not sized:
            profile = memory.profile_cuda(start, model.attention, experts, self.config,
                                          self.max_model_len, self.config.cuda_graphs)
        plan = memory.plan_kv_cache(self.config, bytes_per_block, self.max_model_len, profile)
        logger.info("%s", plan.describe())
        if model.attention.device.type == "cpu":
            memory.check_host_kv_memory(plan.memory_bytes, 1, plan.source)
        return plan

    # -- requests ---------------------------------------------------------------------

    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids; ``ValueError`` starting with the offending field."""
        return validate_prompt(prompt, params, self.tokenizer, self.vocab_size, self.max_model_len)

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, seed: int | None = None
    ) -> None:
        """Queue a request; raises ``ValueError`` for bad input or a duplicate id.

        ``seed``: the sampling seed to use when ``params.seed`` is None (a front-end that
        spreads requests over replicas derives it, so it never depends on the replica);
        by default the engine derives one from its own seed and the arrival order.
        """
        if request_id in self._seqs:
            raise ValueError(f"request_id: {request_id!r} is already running")
        ids = self.validate(prompt, params)
        arrival = next(self._arrivals)
        if params.seed is not None:
            seed = params.seed
        else:
            seed = seed if seed is not None else derive_seed(self.config.seed, arrival)
        seq = Sequence(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            seed=seed,
            arrival=arrival,
        )
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason "abort" and free its blocks; None if unknown."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        self.outputs.abort(seq)
        return self.outputs.step_output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs (by each request's output kind)
        of the requests that advanced. With async scheduling a step's requests advance
        when the next step reads its tokens (module docstring)."""
        prev, self._inflight = self._inflight, None
        scheduled = self._fill_drafts(self.scheduler.schedule().scheduled)
        if self.runner.launch_decode(scheduled):
            self._prompt_tokens += self.scheduler.launched(scheduled)
            outputs = self._read(prev)
            step = self.runner.sample_decode(scheduled)
            if self.async_scheduling:
                self._inflight = step
                return outputs
            return outputs + self._read(step)
        if not self.async_scheduling:  # nothing in flight
            return self._execute(scheduled) if scheduled else []
        if not scheduled:
            return self._read(prev)
        step = self.runner.launch(scheduled)
        self._prompt_tokens += self.scheduler.launched(scheduled)
        self._inflight = step
        return self._read(prev)

    def _read(self, step: DecodeStep | EagerStep | None) -> list[RequestOutput]:
        """Read a launched step's tokens into its sequences (none for None); their
        outputs. The step's tokens were counted as computed and pending at launch
        (``Scheduler.launched``); a sequence that finished since (aborted, or stopped by
        the token before) drops its token (no drafts: async scheduling is off with
        speculative decoding)."""
        if step is None:
            return []
        results = (decode_results(step) if isinstance(step, DecodeStep)
                   else self.runner.results(step))
        outputs: list[RequestOutput] = []
        for item, result in zip(step.scheduled, results):
            seq = item.seq
            if item.samples:
                seq.num_pending_tokens -= 1
            if seq.status is SeqStatus.FINISHED:
                continue
            self._record(seq, result)
            self.scheduler.register_blocks(seq)
            if result.token_ids:
                self._advanced(seq, outputs)
        return outputs

    def _record(self, seq: Sequence, result: SeqResult) -> None:
        """A step's prompt logprobs and sampled tokens of ``seq``, appended; tokens after
        one that finishes the request (an accepted draft past a stop) are dropped."""
        for position, logprobs in result.prompt_logprobs:
            if position + 1 == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(logprobs)
        for m, token in enumerate(result.token_ids):
            logprobs = result.token_logprobs[m] if result.token_logprobs is not None else None
            self.outputs.append_token(seq, token, logprobs)
            self._generation_tokens += 1
            if seq.finish_reason is not None:
                break

    def _execute(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """Run a step synchronously (any kind of step): its outputs."""
        results = self.runner.execute(scheduled)
        outputs: list[RequestOutput] = []
        for item, result in zip(scheduled, results):
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self._prompt_tokens += min(item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            self._record(seq, result)
            self.scheduler.postprocess(item, result.num_accepted)
            self._draft_tokens += item.num_draft_tokens
            self._accepted_tokens += result.num_accepted
            if result.token_ids:
                self._advanced(seq, outputs)
        return outputs

    def _advanced(self, seq: Sequence, outputs: list[RequestOutput]) -> None:
        """``seq`` got tokens: end it if they finished it; its output (if its kind
        wants one now) goes to ``outputs``."""
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)
            self._seqs.pop(seq.request_id, None)
        out = self.outputs.step_output(seq)
        if out is not None:
            outputs.append(out)

    def _fill_drafts(self, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The scheduled steps with their planned draft tokens proposed."""
        todo = [i for i, s in enumerate(scheduled) if s.num_draft_tokens]
        if not todo:
            return scheduled
        proposals = self.proposer.propose([scheduled[i] for i in todo])
        filled = list(scheduled)
        for i, (token_ids, probs) in zip(todo, proposals):
            filled[i] = scheduled[i]._replace(draft_token_ids=tuple(token_ids), draft_probs=probs)
        return filled

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=self.pool.num_blocks,
            num_free_kv_blocks=self.pool.num_free,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_preemptions=self.scheduler.total_preemptions,
            prefix_cache_queries=self.scheduler.prefix_stats.queries,
            prefix_cache_hits=self.scheduler.prefix_stats.hits,
            spec_num_draft_tokens=self._draft_tokens,
            spec_num_accepted_tokens=self._accepted_tokens,
        )

    def shutdown(self) -> None:
        """Release resources (worker processes, once disaggregated)."""


def cache_root(model_path: str | Path, dtype: torch.dtype, block_size: int,
               quantization: str | None = None) -> bytes:
    """The prefix cache's hash-chain root: what besides tokens shapes a block's K/V."""
    if quantization is None:
        return root_hash(str(Path(model_path).resolve()), str(dtype), block_size)
    return root_hash(str(Path(model_path).resolve()), str(dtype), block_size, quantization)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's tokenizer; None where it has no tokenizer.json (token ids only)."""
    return Tokenizer.from_dir(path) if (Path(path) / "tokenizer.json").is_file() else None


def resolve_eos_token_ids(tokenizer: Tokenizer | None,
                          model_config: ModelConfig) -> tuple[int, ...]:
    """The tokens that end a request: the tokenizer's, else (no tokenizer, or one that
    names none) the model config's."""
    return tuple((tokenizer.eos_token_ids if tokenizer else ()) or model_config.eos_token_ids)


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """``config.max_model_len``, or the model's context capped at DEFAULT_MAX_MODEL_LEN."""
    return config.max_model_len or min(model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def derive_seed(engine_seed: int, arrival: int) -> int:
    """The seed of an unseeded request: fixed by the engine seed and arrival order."""
    return (engine_seed * 0x9E3779B97F4A7C15 + arrival * 0xBF58476D1CE4E5B9) % (1 << 63)


def validate_prompt(
    prompt: Prompt,
    params: SamplingParams,
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
) -> list[int]:
    """Check a request; returns the prompt's token ids.

    Raises ``ValueError`` whose message starts with the offending field.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: this model has no tokenizer.json; pass prompt_token_ids")
        if not prompt:
            raise ValueError("prompt: empty prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {vocab_size})")
    else:
        raise ValueError(f"prompt: expected text or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt: empty prompt")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={max_model_len}"
        )
    return ids

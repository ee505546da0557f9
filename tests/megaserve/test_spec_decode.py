"""Speculative decoding on CPU, float32: greedy token ids and logprobs are bitwise those of
decoding without speculation (n-gram and draft-model proposers, k in 1..6, crowds arriving
at random steps, prefix-cache hits, chunked prefill, a cramped pool that preempts); seeded
sampling with speculation is reproducible whatever else runs; and the speculative sampling
rule gives the target's distribution (chi-square over a fixed seed set)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from megaserve.engine.config import EngineConfig, SpeculativeConfig
from megaserve.engine.engine import LLMEngine
from megaserve.engine.spec_decode import sampling_probs
from megaserve.models.builtin import resolve_model
from megaserve.sampling_params import SamplingParams
from tests.megaserve.hf_models import make_checkpoint
from tests.megaserve.test_prefix_cache import run as run_arrivals

MAX_MODEL_LEN = 160
SIGNIFICANCE = 1e-3  # chi-square tests below; the seed sets are fixed, so never flaky


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Draft checkpoints for the built-in target (vocabulary 512): the target itself
    (every greedy draft accepted) and a 1-layer random model (most rejected)."""
    other = tmp_path_factory.mktemp("draft") / "other"
    make_checkpoint(other, "qwen3_moe", seed=3, vocab_size=512, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                    num_experts_per_tok=2)
    return {"same": str(resolve_model("builtin:tiny-moe")), "other": str(other)}


class Engines:
    """Engines built on first use, keyed by (method, k, variant)."""

    VARIANTS = {
        "roomy": {},
        "chunked": dict(max_num_batched_tokens=23),
        "cramped": dict(max_num_batched_tokens=40, num_kv_blocks=24),
    }

    def __init__(self, drafts):
        self.drafts = drafts
        self._engines: dict = {}
        self.reference = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                                enable_prefix_caching=False))

    def get(self, method: str, k: int, variant: str | int) -> LLMEngine:
        """``variant``: a name of VARIANTS, or a token budget per step (chunk size)."""
        key = (method, k, variant)
        if key not in self._engines:
            options = (self.VARIANTS[variant] if isinstance(variant, str)
                       else dict(max_num_batched_tokens=variant))
            if method == "ngram":
                spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
            else:
                spec = {"model": self.drafts[method], "num_speculative_tokens": k}
            self._engines[key] = LLMEngine(EngineConfig(
                dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32,
                speculative_config=spec, **options))
        return self._engines[key]


@pytest.fixture(scope="module")
def engines(drafts):
    return Engines(drafts)


def run(engine: LLMEngine, arrivals, step_sizes: list | None = None) -> dict:
    """:func:`test_prefix_cache.run` (every block free afterwards); ``step_sizes``
    collects the draft counts of each step's sampling sequences."""
    if step_sizes is None:
        return run_arrivals(engine, arrivals)
    execute = engine.runner.execute

    def recording(scheduled):
        step_sizes.append(sorted(s.num_draft_tokens for s in scheduled if s.samples))
        return execute(scheduled)
    engine.runner.execute = recording
    try:
        return run_arrivals(engine, arrivals)
    finally:
        engine.runner.execute = execute


def signature(out):
    c = out.outputs[0]
    logprobs = [sorted(d.items()) for d in c.logprobs] if c.logprobs is not None else None
    return c.token_ids, logprobs, c.finish_reason


GREEDY = [
    SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0, logprobs=0, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=0, logprobs=1),  # may stop at EOS
]
SAMPLED = [
    SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=1, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.1, seed=8, top_k=30, top_p=0.9, logprobs=1,
                   ignore_eos=True),
]


def repetitive_arrivals(rng: random.Random, num_requests: int, greedy_only: bool):
    """Prompts repeating short random patterns (so n-gram lookup finds matches), some
    sharing prefixes, arriving at random steps."""
    patterns = [[rng.randrange(512) for _ in range(rng.randrange(2, 8))] for _ in range(3)]
    arrivals = []
    for i in range(num_requests):
        pattern = rng.choice(patterns)
        prompt = (pattern * 40)[: rng.randrange(1, 90)] + [rng.randrange(512) for _ in range(rng.randrange(3))]
        params = rng.choice(GREEDY if greedy_only or rng.random() < 0.6 else SAMPLED)
        arrivals.append((rng.randrange(8), f"r{i}", prompt, params))
    return arrivals


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), num_requests=st.integers(1, 12), k=st.integers(1, 6),
       method=st.sampled_from(["ngram", "same", "other"]),
       variant=st.sampled_from(["roomy", "chunked", "cramped", "budget"]),
       budget=st.integers(0, 40))
def test_speculation_is_bitwise_invisible(engines, seed, num_requests, k, method, variant, budget):
    """Greedy: equal to decoding without speculation, each request alone. Seeded
    sampling: equal to the same speculative engine serving the request alone.
    ``budget``: a random chunk size (k + 1 + budget tokens per step) for "budget"."""
    if variant == "budget":
        variant = k + 1 + budget
    rng = random.Random(seed)
    arrivals = repetitive_arrivals(rng, num_requests, greedy_only=False)
    engine = engines.get(method, k, variant)
    got = run(engine, arrivals)
    for _, request_id, prompt, params in arrivals:
        if params.greedy:
            alone = run(engines.reference, [(0, request_id, prompt, params)])[request_id]
        else:
            alone = run(engines.get(method, k, "roomy"), [(0, request_id, prompt, params)])[request_id]
        assert signature(got[request_id]) == signature(alone), (request_id, method, k, variant)


@pytest.mark.parametrize("method", ["ngram", "same", "other"])
def test_drafts_are_accepted_and_rejected_with_mixed_counts(engines, method):
    """One crowd per proposer: greedy output equals the reference, some drafts are
    accepted (all of them for the draft that is the target), and some steps batch
    sequences with different numbers of drafts."""
    engine = engines.get(method, 4, "roomy")
    before = engine.stats()
    arrivals = repetitive_arrivals(random.Random(7), 10, greedy_only=True)
    sizes: list = []
    got = run(engine, arrivals, sizes)
    after = engine.stats()
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert proposed > 0
    if method == "same":
        assert accepted == proposed
    else:  # the random draft hardly ever agrees with the target
        assert accepted < proposed
    if method == "ngram":
        assert accepted > 0
    assert any(len(set(s)) > 1 for s in sizes), "no step mixed draft counts"
    for _, request_id, prompt, params in arrivals:
        alone = run(engines.reference, [(0, request_id, prompt, params)])[request_id]
        assert signature(got[request_id]) == signature(alone)


@pytest.mark.parametrize("method", ["ngram", "same"])
def test_cramped_pool_preempts_speculating_sequences_invisibly(engines, method):
    """Long requests in 24 blocks: sequences holding draft slots get preempted and
    recomputed (with prefix-cache hits on their own blocks); greedy equals no
    speculation, seeded equals the roomy speculative engine."""
    engine = engines.get(method, 3, "cramped")
    preemptions = engine.scheduler.total_preemptions
    rng = random.Random(11)
    arrivals = []
    for i in range(8):
        pattern = [rng.randrange(512) for _ in range(5)]
        params = GREEDY[0] if i % 2 else SamplingParams(max_tokens=40, temperature=0.9, seed=i,
                                                        logprobs=1, ignore_eos=True)
        arrivals.append((i // 3, f"c{i}", (pattern * 12)[:60], params))
    got = run(engine, arrivals)
    assert engine.scheduler.total_preemptions > preemptions
    for _, request_id, prompt, params in arrivals:
        alone_engine = engines.reference if params.greedy else engines.get(method, 3, "roomy")
        alone = run(alone_engine, [(0, request_id, prompt, params)])[request_id]
        assert signature(got[request_id]) == signature(alone), request_id


def test_seeded_speculative_sampling_reproducible_and_seed_sensitive(engines):
    engine = engines.get("other", 3, "roomy")
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]

    def tokens(seed):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=seed, ignore_eos=True)
        return run(engine, [(0, "s", prompt, params)])["s"].outputs[0].token_ids
    assert tokens(1) == tokens(1)
    assert tokens(1) != tokens(2)


def test_bad_speculative_configs_are_refused(drafts, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "x": 1})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="JSON"):
        EngineConfig(speculative_config="{not json")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine(EngineConfig(dtype="float32", max_model_len=64, max_num_batched_tokens=3,
                               speculative_config={"method": "ngram", "num_speculative_tokens": 3}))
    small = tmp_path / "small"
    make_checkpoint(small, "mixtral", vocab_size=100, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2)
    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(EngineConfig(dtype="float32", max_model_len=64,
                               speculative_config={"model": str(small), "num_speculative_tokens": 2}))


# -- the sampling distribution ---------------------------------------------------------

VOCAB = 8
DIST_PROMPT = [1, 2, 3, 1, 2]
NUM_SAMPLES = 3000  # seeds 0 .. NUM_SAMPLES - 1


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A target and a draft over 8 tokens (the draft: a 1-layer model)."""
    root = tmp_path_factory.mktemp("tiny_vocab")
    shape = dict(vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                 num_local_experts=4, num_experts_per_tok=2, initializer_range=0.25)
    make_checkpoint(root / "target", "mixtral", seed=0, **shape)
    make_checkpoint(root / "draft", "mixtral", seed=0, num_hidden_layers=1, **shape)
    return root / "target", root / "draft"


def _joint(path, params: SamplingParams) -> np.ndarray:
    """Exact `[V, V]` probabilities of a model's first two tokens after DIST_PROMPT under
    ``params`` (temperature and filters applied to its full logprob rows)."""
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", max_model_len=64))
    greedy = SamplingParams(max_tokens=1, temperature=0, logprobs=VOCAB, ignore_eos=True)

    def distribution(prompt, request_id) -> np.ndarray:
        logprobs = run(engine, [(0, request_id, prompt, greedy)])[request_id].outputs[0].logprobs[0]
        row = torch.tensor([logprobs[t] for t in range(VOCAB)], dtype=torch.float32)
        return sampling_probs(row, params).numpy()
    p1 = distribution(DIST_PROMPT, "a")
    p2 = np.stack([distribution(DIST_PROMPT + [t], f"b{t}") for t in range(VOCAB)])
    return p1[:, None] * p2


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of observed counts to probabilities; cells expecting fewer than 5
    are pooled (the chi-square approximation needs it)."""
    expected = probs.flatten() / probs.sum() * counts.sum()
    observed = counts.flatten()
    big = expected >= 5
    pooled_expected, pooled_observed = expected[~big].sum(), observed[~big].sum()
    expected, observed = expected[big], observed[big]
    if pooled_expected > 0:
        expected = np.append(expected, pooled_expected)
        observed = np.append(observed, pooled_observed)
    elif pooled_observed > 0:
        return 0.0  # outcomes of probability 0 (filtered out) were drawn
    return float(scipy_stats.chisquare(observed, expected).pvalue)


DIST_PARAMS = {
    "plain": dict(temperature=1.0),
    "filtered": dict(temperature=0.7, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("method, sampling", [("draft_model", "plain"), ("ngram", "plain"),
                                              ("draft_model", "filtered")])
def test_speculative_sampling_gives_the_target_distribution(tiny_vocab, method, sampling):
    target, draft = tiny_vocab
    if method == "draft_model":
        spec = {"model": str(draft), "num_speculative_tokens": 2}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", max_model_len=64,
                                    max_num_seqs=256, speculative_config=spec))
    params = dict(max_tokens=2, ignore_eos=True, **DIST_PARAMS[sampling])
    outs = run(engine, [(0, f"s{s}", DIST_PROMPT, SamplingParams(seed=s, **params))
                        for s in range(NUM_SAMPLES)])
    counts = np.zeros((VOCAB, VOCAB))
    for out in outs.values():
        first, second = out.outputs[0].token_ids
        counts[first, second] += 1
    stats = engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    target_params = SamplingParams(**DIST_PARAMS[sampling])
    assert _chi_square_p(counts, _joint(target, target_params)) > SIGNIFICANCE
    # The test has power: the same samples reject the draft's own distribution.
    assert _chi_square_p(counts, _joint(draft, target_params)) < SIGNIFICANCE


# -- the padded forwards that the CUDA graphs capture ---------------------------------


def _padded_engine(drafts, method: str, k: int, max_batch: int) -> LLMEngine:
    """A speculative engine whose verification steps (and, for a draft model, its draft
    forwards) run the padded static-buffer forward that the CUDA graphs capture
    (``MultiTokenGraphs(capture=False)``): on CPU, the exact captured function."""
    from megaserve.engine.spec_graphs import MultiTokenGraphs

    spec = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
            if method == "ngram" else {"model": drafts[method], "num_speculative_tokens": k})
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN,
                                    max_num_seqs=32, speculative_config=spec))
    runner = engine.runner
    runner.verify_graphs = MultiTokenGraphs(
        runner.attention, runner.experts.experts, runner.kv_caches, runner.block_size,
        max_batch, int(runner.attention.cos.shape[0]), query_len=k + 1, capture=False)
    proposer = engine.proposer
    if method != "ngram":
        proposer.graphs = [
            MultiTokenGraphs(proposer.attention, proposer.experts.experts, proposer.kv_caches,
                             proposer.block_size, max_batch, int(proposer.attention.cos.shape[0]),
                             query_len=q, capture=False)
            for q in (1, 2)]
    return engine


@pytest.mark.parametrize("method, k", [("ngram", 4), ("ngram", 1), ("same", 3), ("other", 2)])
def test_padded_verification_forward_is_bitwise_invisible(engines, drafts, method, k):
    """Crowds of greedy and seeded requests with mixed draft counts: verification steps
    of up to 8 sequences padded to k + 1 rows each and to the batch sizes 1, 2, 4, 8
    (and the draft's padded one- and two-token forwards) give greedy outputs equal to
    decoding without speculation and seeded outputs equal to the eager speculative
    engine's."""
    padded = _padded_engine(drafts, method, k, max_batch=8)
    eager = engines.get(method, k, "roomy")
    for seed in range(2):
        arrivals = repetitive_arrivals(random.Random(100 + seed), 9, greedy_only=False)
        got = run(padded, arrivals)
        for _, request_id, prompt, params in arrivals:
            alone_engine = engines.reference if params.greedy else eager
            alone = run(alone_engine, [(0, request_id, prompt, params)])[request_id]
            assert signature(got[request_id]) == signature(alone), (request_id, seed)
    assert padded.runner.verify_graphs.num_steps > 5
    if method != "ngram":
        assert all(g.num_steps > 0 for g in padded.proposer.graphs)
    assert padded.stats().spec_num_accepted_tokens > 0 or method == "other"


def test_ngram_proposal_continues_the_period():
    """A match p tokens back proposes the tokens after it, then repeats with period p."""
    from megaserve.engine.sequence import Sequence
    from megaserve.engine.spec_decode import NgramProposer

    config = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=2)
    proposer = NgramProposer(config, max_model_len=100)
    params = SamplingParams(max_tokens=50, temperature=0)
    seq = Sequence(request_id="p", prompt=None, prompt_token_ids=[9, 1, 2, 3, 1, 2],
                   params=params, seed=0, arrival=0)
    assert proposer.lookup(seq) == (3, 1, 2, 3, 1)  # "1 2" was 3 tokens back
    seq = Sequence(request_id="q", prompt=None, prompt_token_ids=[4, 5, 6, 7, 8, 6, 7],
                   params=params, seed=0, arrival=0)
    assert proposer.lookup(seq) == (8, 6, 7, 8, 6)
    short = SamplingParams(max_tokens=3, temperature=0)
    seq = Sequence(request_id="s", prompt=None, prompt_token_ids=[1, 2, 1, 2], params=short,
                   seed=0, arrival=0)
    assert proposer.lookup(seq) == (1, 2)  # limit: max_tokens - 1

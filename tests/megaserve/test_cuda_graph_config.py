"""Decode CUDA graphs, the parts that run on CPU: the config flag, the captured batch
sizes, and the padded static-buffer decode forward (``DecodeGraphs(capture=False)``, the
exact function a graph captures) against the eager engine, bitwise, in float32."""

from __future__ import annotations

import random

import numpy as np

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size
from megaserve.engine.engine import LLMEngine
from megaserve.engine.scheduler import ScheduledSeq
from megaserve.engine.sequence import Sequence
from megaserve.sampling_params import SamplingParams
from tests.megaserve.test_batch_invariance import _run, crowd_arrivals

MAX_MODEL_LEN = 160


def test_cuda_graphs_flag_is_validated() -> None:
    assert EngineConfig().cuda_graphs is True
    assert EngineConfig(cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(1) == [1]
    large = capture_sizes(1024)  # vLLM's: steps of 16 from 256
    assert len(large) == 83 and large[33:36] == [248, 256, 272] and large[-2:] == [1008, 1024]
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    with pytest.raises(ValueError):
        capture_sizes(0)


def _padded_engine(max_batch: int) -> LLMEngine:
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32))
    runner = engine.runner
    runner.decode_graphs = DecodeGraphs(
        runner.attention, runner.experts.experts, runner.kv_caches, runner.block_size,
        max_batch, MAX_MODEL_LEN, capture=False,
    )
    return engine


@pytest.mark.parametrize("scenario", range(2))
def test_padded_decode_forward_equals_eager(scenario: int) -> None:
    """Random concurrent requests (greedy and seeded; prompts crossing KV blocks): every
    request's tokens and logprobs equal the eager engine's when decode steps of up to 8
    sequences run the padded forward (sizes 1, 2, 4, 8: most batches get padding rows)."""
    eager = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=32))
    padded = _padded_engine(max_batch=8)
    rng = random.Random(77 + scenario)
    target = [rng.randrange(eager.vocab_size) for _ in range(rng.randrange(14, 40))]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, logprobs=2, ignore_eos=True)
    arrivals = crowd_arrivals(rng, eager.vocab_size, target, params, num_others=7)
    want = _run(eager, arrivals)
    got = _run(padded, arrivals)
    assert padded.runner.decode_graphs.num_steps > 5
    assert sorted(got) == sorted(want)
    for request_id in want:
        assert _outputs(got[request_id]) == _outputs(want[request_id]), request_id


def _outputs(out):
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.finish_reason


def _reference_rows(graphs: DecodeGraphs, scheduled, b: int) -> np.ndarray:
    """The static layout (cuda_graphs module NOTE) built from scratch, row by row."""
    bs = graphs.block_size
    rows = np.zeros((b, 4 + graphs.table_width), dtype=np.int32)
    for i, s in enumerate(scheduled):
        seq, pos = s.seq, s.seq.num_computed_tokens
        blocks = seq.block_ids
        rows[i, :4] = [seq.token_ids(pos, pos + 1)[0], pos, blocks[pos // bs] * bs + pos % bs, pos + 1]
        rows[i, 4:4 + len(blocks)] = blocks
    rows[len(scheduled):] = rows[0]
    rows[len(scheduled):, 2] = -1
    return rows


def _check_rows(graphs: DecodeGraphs, scheduled, b: int) -> None:
    """The staging rows equal the layout built from scratch: the input and block-table
    columns, and each sequence's sampling columns (module NOTE)."""
    width = 4 + graphs.table_width
    np.testing.assert_array_equal(graphs._host[:b, :width], _reference_rows(graphs, scheduled, b))
    col = graphs._extra
    for i, s in enumerate(scheduled):
        p = s.seq.params
        assert graphs._host[i, col + 1] == p.top_k
        assert graphs._host[i, col + 2] == (-1 if p.logprobs is None else p.logprobs)
        assert tuple(graphs._host_f32[i, col + 3:col + 6]) == tuple(
            np.float32([p.temperature, p.top_p, p.min_p]))
        assert graphs._host_i64[i, (col + 6) // 2] == s.seq.seed


def test_fill_keeps_block_tables_across_steps_preemption_and_aborts() -> None:
    """The incrementally kept staging rows (block tables, sampling parameters) equal rows
    built from scratch at every decode step, while sequences grow blocks, finish, get
    aborted and get preempted (a KV pool too small for all of them) and rows change hands."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                                    block_size=4, num_kv_blocks=40))
    runner = engine.runner
    graphs = runner.decode_graphs = DecodeGraphs(
        runner.attention, runner.experts.experts, runner.kv_caches, runner.block_size,
        16, MAX_MODEL_LEN, capture=False)
    fill = graphs._fill
    checked = []

    def checked_fill(scheduled, b):
        fill(scheduled, b)
        _check_rows(graphs, scheduled, b)
        checked.append(len(scheduled))

    graphs._fill = checked_fill
    rng = random.Random(3)
    for i in range(24):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randrange(2, 12))]
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=rng.randrange(3, 30), ignore_eos=True, temperature=rng.choice([0.0, 0.7]),
            top_k=rng.randrange(4), top_p=rng.choice([1.0, 0.9]), logprobs=rng.choice([None, 2])))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step % 7 == 0 and engine.scheduler.running:
            engine.abort_request(engine.scheduler.running[0].request_id)
    assert engine.scheduler.total_preemptions > 0
    assert len(checked) > 20 and len(set(checked)) > 3


def test_fill_rewrites_a_row_that_padding_overwrote() -> None:
    """A sequence dropping out of a decode step for a step (its row padded over) and coming
    back to the same row with the same block list gets its whole table written again."""
    engine = _padded_engine(max_batch=8)
    graphs = engine.runner.decode_graphs
    params = SamplingParams(max_tokens=4)
    seqs = []
    for i in range(5):
        seq = Sequence(f"s{i}", None, [1, 2, 3], params, seed=0, arrival=i)
        seq.block_ids = [10 + 3 * i, 11 + 3 * i]
        seq.num_computed_tokens = 2
        seqs.append(seq)
    for batch in (seqs, seqs[:3], seqs[:4], seqs):
        scheduled = [ScheduledSeq(s, 1, True) for s in batch]
        b = padded_size(len(batch), graphs.sizes)
        graphs._fill(scheduled, b)
        _check_rows(graphs, scheduled, b)

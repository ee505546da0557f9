"""Async scheduling (``EngineConfig.async_scheduling``) and output kinds on CPU.

On CPU the "device" is synchronous, but the control flow is the one a GPU step takes:
decode steps run the decode graphs' padded forward uncaptured, a step's tokens are read
one step later, and the next step takes its input tokens from the previous step's sampled
tokens on the device (the source column of megaserve.engine.cuda_graphs). Every test
compares with the synchronous engine: tokens, logprobs, finish reasons and text equal,
and every KV block free at the end.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from megaserve import LLM
from megaserve.engine.config import EngineConfig
from megaserve.engine.cuda_graphs import _SOURCE
from megaserve.engine.engine import LLMEngine
from megaserve.entrypoints.generate_cli import add_runtime_flags, runtime_options
from megaserve.sampling_params import RequestOutputKind, SamplingParams
from tests.megaserve.test_batch_invariance import crowd_arrivals

MAX_MODEL_LEN = 160


def _engine(async_scheduling: bool, **options) -> LLMEngine:
    config = dict(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    return LLMEngine(EngineConfig(**config | options, async_scheduling=async_scheduling))


def _count_device_fed_rows(engine: LLMEngine) -> list[int]:
    """Wrap the decode graphs' _fill: counts, per step, the rows whose input token comes
    from the previous step's sampled tokens on the device."""
    graphs = engine.runner.decode_graphs
    if graphs is None:
        engine.runner._build_decode_graphs()
        graphs = engine.runner.decode_graphs
    fill, counts = graphs._fill, []

    def counted(scheduled, b):
        fill(scheduled, b)
        counts.append(int(np.sum(graphs._host[:len(scheduled), graphs._extra + _SOURCE] >= 0)))

    graphs._fill = counted
    return counts


def _run(engine: LLMEngine, arrivals, aborts: dict[int, str] | None = None) -> dict:
    """Add each request at its step, abort ``aborts[step]`` at its step; run to the end.
    Returns request id → the list of outputs it got (by its output kind)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outputs: dict[str, list] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params = pending.pop(0)
            engine.add_request(request_id, prompt, params)
        if aborts and step in aborts:
            out = engine.abort_request(aborts[step])
            if out is not None:
                outputs.setdefault(out.request_id, []).append(out)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        step += 1
        assert step < 2000
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return outputs


def _final(outputs: dict) -> dict:
    """request id → (tokens, logprobs, finish reason, stop reason, text) of its last output."""
    result = {}
    for request_id, outs in outputs.items():
        c = outs[-1].outputs[0]
        assert outs[-1].finished
        result[request_id] = (c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, c.text)
    return result


@pytest.mark.parametrize("scenario", range(3))
def test_async_equals_sync_on_a_crowd(scenario: int) -> None:
    """Random requests arriving at random steps (greedy and seeded sampling, top-k,
    logprobs, 1-80 prompt tokens: prefill, mixed and decode steps), the cramped variant
    with chunked prefill and preemption: bitwise equal outputs, and the async engine
    really fed tokens from the device."""
    cramped = scenario == 2
    options = dict(max_num_batched_tokens=40, num_kv_blocks=14) if cramped else {}
    sync, overlapped = _engine(False, **options), _engine(True, **options)
    fed = _count_device_fed_rows(overlapped)
    rng = random.Random(900 + scenario)
    target = [rng.randrange(sync.vocab_size) for _ in range(rng.randrange(10, 60))]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    num_others = 14 if cramped else rng.randrange(5, 14)
    arrivals = crowd_arrivals(rng, sync.vocab_size, target, params, num_others=num_others)
    want = _final(_run(sync, arrivals))
    got = _final(_run(overlapped, arrivals))
    assert got == want
    assert sum(fed) > 20, fed
    if cramped:  # recomputed prompts count again: the totals depend on the preemptions
        assert overlapped.scheduler.total_preemptions > 0
    else:
        assert overlapped.stats().prompt_tokens_total == sync.stats().prompt_tokens_total
    assert overlapped.stats().generation_tokens_total == sync.stats().generation_tokens_total


def _stop_arrivals(engine: LLMEngine, reference: list[int], text: str):
    """Requests of one prompt stopping on EOS, a stop token, a stop string, max_tokens."""
    prompt = [5, 17, 99, 3, 250, 41, 8]
    greedy = dict(temperature=0.0)
    return [
        (0, "eos", prompt, SamplingParams(max_tokens=30, **greedy)),
        (0, "stop-token", prompt, SamplingParams(max_tokens=30, stop_token_ids=[reference[9]],
                                                 ignore_eos=True, **greedy)),
        (0, "stop-string", prompt, SamplingParams(max_tokens=30, stop=[text[8:11]],
                                                  ignore_eos=True, **greedy)),
        (1, "stop-string-kept", prompt, SamplingParams(
            max_tokens=30, stop=[text[8:11]], include_stop_str_in_output=True, ignore_eos=True,
            **greedy)),
        (0, "length", prompt, SamplingParams(max_tokens=13, ignore_eos=True, **greedy)),
        (2, "seeded", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=9, logprobs=3,
                                             ignore_eos=True)),
        (0, "long", [7] * 30, SamplingParams(max_tokens=40, ignore_eos=True, **greedy)),
    ]


def test_async_stops_on_eos_stop_strings_and_max_tokens() -> None:
    """Each stop condition ends a request at the same token with and without async
    scheduling (a token-triggered stop is found a step late, its extra token dropped);
    the other requests in the batch are unaffected and every block is freed."""
    sync, overlapped = _engine(False), _engine(True)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    sync.add_request("ref", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    ref = _run(sync, [])["ref"][-1].outputs[0]
    reference, text = ref.token_ids, ref.text
    assert len(text) > 12 and text[8:11].strip(), "reference text too short for the test"
    eos = reference[6]
    assert eos not in reference[:6]
    for engine in (sync, overlapped):
        engine.outputs.eos_token_ids = frozenset({eos})
    arrivals = _stop_arrivals(sync, reference, text)
    read, dropped = overlapped._read, []

    def counted(step):  # tokens of requests that stopped after their step was launched
        if step is not None:
            dropped.append(sum(item.seq.is_finished for item in step.scheduled))
        return read(step)

    overlapped._read = counted
    want = _final(_run(sync, arrivals))
    got = _final(_run(overlapped, arrivals))
    assert got == want
    assert sum(dropped) >= 3, dropped  # eos, stop token, stop strings: found a step late
    assert want["eos"][0] == reference[:7] and want["eos"][2] == "stop"
    assert want["stop-token"][3] == reference[9]
    assert want["stop-string"][2] == "stop" and len(want["stop-string"][0]) < 30
    assert len(want["length"][0]) == 13 and want["length"][2] == "length"


def test_async_abort_mid_decode_frees_blocks() -> None:
    """Requests aborted while a decode step of theirs is in flight end as "abort" with a
    prefix of their tokens; the others are unaffected; every block is freed."""
    sync, overlapped = _engine(False), _engine(True)
    rng = random.Random(4)
    arrivals = [(0, f"r{i}", [rng.randrange(sync.vocab_size) for _ in range(rng.randrange(3, 20))],
                 SamplingParams(max_tokens=25, temperature=0.7 * (i % 2), seed=i, ignore_eos=True))
                for i in range(6)]
    full = _final(_run(sync, arrivals))
    aborts = {6: "r1", 9: "r4", 12: "r0"}
    want = _run(_engine(False), arrivals, aborts)
    got = _run(overlapped, arrivals, aborts)
    for request_id in ("r0", "r1", "r4"):
        last = got[request_id][-1].outputs[0]
        assert last.finish_reason == "abort"
        assert last.token_ids == full[request_id][0][:len(last.token_ids)]
        assert 0 < len(last.token_ids) < 25
    kept = {r: v for r, v in _final(got).items() if r not in ("r0", "r1", "r4")}
    assert kept == {r: v for r, v in _final(want).items() if r in kept}


def test_async_at_max_model_len() -> None:
    """Requests running into max_model_len stop at it (the scheduler does not schedule a
    sequence whose pending token ends it) with and without async scheduling."""
    options = dict(max_model_len=40)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    arrivals = [(0, f"r{i}", list(range(1, 20 + 5 * i)), params) for i in range(3)]
    want = _final(_run(_engine(False, **options), arrivals))
    got = _final(_run(_engine(True, **options), arrivals))
    assert got == want
    assert all(len(v[0]) + 19 + 5 * i == 40 for i, v in enumerate(want.values()))


def test_output_kinds_delta_and_final_only() -> None:
    """DELTA outputs concatenate to the CUMULATIVE output (text, tokens, logprobs), with
    the prompt logprobs in the first one only; FINAL_ONLY gives one output per request,
    equal to the last CUMULATIVE one; with and without async scheduling."""
    base = dict(max_tokens=18, temperature=0.9, seed=2, logprobs=1, prompt_logprobs=1,
                stop=["zz"], ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    results = {}
    for overlap in (False, True):
        engine = _engine(overlap)
        arrivals = [(0, kind.name, prompt, SamplingParams(**base, output_kind=kind))
                    for kind in RequestOutputKind]
        results[overlap] = _run(engine, arrivals)
    for outputs in results.values():
        cumulative, delta, final = (outputs[k.name] for k in RequestOutputKind)
        assert len(final) == 1 and final[0].finished
        assert len(delta) == len(cumulative) > 1
        whole = cumulative[-1].outputs[0]
        assert "".join(o.outputs[0].text for o in delta) == whole.text
        assert sum((o.outputs[0].token_ids for o in delta), []) == whole.token_ids
        assert sum((o.outputs[0].logprobs for o in delta), []) == whole.logprobs
        assert delta[0].prompt_logprobs == cumulative[-1].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in delta[1:])
        f = final[0].outputs[0]
        assert (f.token_ids, f.text, f.logprobs) == (whole.token_ids, whole.text, whole.logprobs)
    assert _final(results[True]) == _final(results[False])


def test_llm_generate_with_async_scheduling() -> None:
    """The public API: LLM(async_scheduling=True).generate equals the synchronous LLM."""
    prompts = ["The quick brown fox", "Hello", "a b c d e f"]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=1, logprobs=2),
              SamplingParams(max_tokens=16, stop=["e"])]
    outs = {}
    for overlap in (False, True):
        with LLM(dtype="float32", device="cpu", max_model_len=128, async_scheduling=overlap) as llm:
            assert llm.engine.async_scheduling is overlap
            outs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].text,
                              o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
            assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
    assert outs[True] == outs[False]


def test_async_does_not_apply_to_speculative_decoding() -> None:
    """With speculative decoding the engine runs synchronously (and says so)."""
    engine = _engine(True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert engine.async_scheduling is False
    assert engine.runner.decode_graphs is None


def test_async_scheduling_flag() -> None:
    import argparse

    # Default: on for CUDA, off on CPU (nothing to overlap there).
    assert EngineConfig(device="cpu").async_scheduling is False
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    parser = argparse.ArgumentParser()
    add_runtime_flags(parser)
    assert runtime_options(parser.parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert runtime_options(parser.parse_args(["--no-async-scheduling"]))["async_scheduling"] \
        is False
    assert runtime_options(parser.parse_args([]))["async_scheduling"] is None

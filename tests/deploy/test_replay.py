"""InFlightTable: a request re-run from prompt + delivered tokens, cut at every point, streams
exactly what an undisturbed run streams (text, ids, logprobs, stop strings, finish reasons)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.engine.engine import LLMEngine
from megaserve.engine.output_processor import OutputProcessor
from megaserve.runtime.recovery import InFlightTable, worker_params
from megaserve.sampling_params import RequestOutputKind, SamplingParams

CASES = [
    ("Once upon a time", SamplingParams(max_tokens=24, temperature=0.9, seed=3, logprobs=2,
                                        ignore_eos=True)),
    ("The quick brown fox", SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                           prompt_logprobs=1)),
    # Stop strings: the text is held back while a stop string may start, and the stop can
    # straddle the cut; found by scanning the undisturbed run (see the fixture).
    ("Serving MoE models", SamplingParams(max_tokens=40, temperature=1.0, seed=11,
                                          ignore_eos=True)),
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(dtype="float32", max_model_len=256, seed=0, device="cpu"))


def _run(engine, request_id, ids, params, seed):
    engine.add_request(request_id, ids, params, seed=seed)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def _with_stop(engine, prompt, params):
    """Params whose stop string ends the undisturbed run after several tokens of text."""
    ids = engine.validate(prompt, params)
    text = _run(engine, "probe", ids, params, params.seed)[-1].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    return replace(params, stop=(stop,))


def _signature(out):
    c = out.outputs[0]
    return c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason, out.prompt_logprobs


@pytest.mark.parametrize("case", range(len(CASES)))
def test_rerun_from_every_cut_streams_like_an_undisturbed_run(engine, case):
    prompt, params = CASES[case]
    if case == 2:
        params = _with_stop(engine, prompt, params)
    ids = engine.validate(prompt, params)
    full = _run(engine, f"full{case}", ids, params, params.seed)
    assert len(full) > 3
    if case == 2:
        assert full[-1].outputs[0].stop_reason == params.stop[0]
    aborts = 0
    eos = tuple(engine.tokenizer.eos_token_ids)
    for cut in range(1, len(full)):
        table = InFlightTable(OutputProcessor(engine.tokenizer, eos, engine.max_model_len))
        table.added("r", None, ids, params, params.seed)
        seen = [table.translate(replace(o, request_id="r"))[0] for o in full[:cut]]
        reruns, ended = table.resume()
        assert not ended
        ((_, rerun_ids, rerun_params, seed),) = reruns
        delivered = seen[-1].outputs[0].token_ids
        assert rerun_ids == ids + delivered and seed == params.seed
        assert rerun_params.max_tokens == params.max_tokens - len(delivered)
        for out in _run(engine, f"rerun{case}-{cut}", rerun_ids, rerun_params, seed):
            mapped, must_abort = table.translate(replace(out, request_id="r"))
            seen.append(mapped)
            aborts += must_abort
            if mapped.finished:
                break
        assert _signature(seen[-1]) == _signature(full[-1]), cut
        for before, after in zip(seen, seen[1:]):  # a stream never takes anything back
            assert after.outputs[0].text.startswith(before.outputs[0].text)
            assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == \
                before.outputs[0].token_ids
    if case == 2:  # a stop string straddling a cut: only the front-end's replay sees it
        assert aborts >= 1


def _joined(outs):
    """A DELTA stream's outputs joined: what its caller has in the end."""
    comps = [o.outputs[0] for o in outs]
    logprobs = [p for c in comps for p in (c.logprobs or [])]
    prompt_logprobs = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    return ("".join(c.text for c in comps), [t for c in comps for t in c.token_ids], logprobs,
            comps[-1].finish_reason, comps[-1].stop_reason, prompt_logprobs)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_delta_rerun_from_every_cut_streams_the_same_deltas(engine, case):
    """A DELTA caller (the server's kind): its workers run the request cumulative
    (worker_params), the table cuts the deltas, and across a re-run from any cut the
    caller's deltas join to what an undisturbed DELTA run streams (prompt logprobs once)."""
    prompt, params = CASES[case]
    params = replace(params, output_kind=RequestOutputKind.DELTA)
    if case == 2:
        params = _with_stop(engine, prompt, params)
    ids = engine.validate(prompt, params)
    expected = _joined(_run(engine, f"dfull{case}", ids, params, params.seed))
    worker = worker_params(params)
    assert worker.output_kind is RequestOutputKind.CUMULATIVE
    full = _run(engine, f"dworker{case}", ids, worker, params.seed)
    eos = tuple(engine.tokenizer.eos_token_ids)
    for cut in range(1, len(full)):
        table = InFlightTable(OutputProcessor(engine.tokenizer, eos, engine.max_model_len))
        table.added("r", None, ids, params, params.seed)
        seen = [table.translate(replace(o, request_id="r"))[0] for o in full[:cut]]
        ((_, rerun_ids, rerun_params, seed),), _ = table.resume()
        for out in _run(engine, f"drerun{case}-{cut}", rerun_ids, worker_params(rerun_params),
                        seed):
            mapped = table.translate(replace(out, request_id="r"))[0]
            seen.append(mapped)
            if mapped.finished:
                break
        assert _joined(seen) == expected, cut


def test_aborted_request_ends_without_a_rerun(engine):
    prompt, params = CASES[0]
    ids = engine.validate(prompt, params)
    full = _run(engine, "ab", ids, params, params.seed)
    table = InFlightTable(OutputProcessor(engine.tokenizer, tuple(engine.tokenizer.eos_token_ids),
                                          engine.max_model_len))
    table.added("r", None, ids, params, params.seed)
    table.translate(replace(full[2], request_id="r"))
    table.aborting("r")
    reruns, ended = table.resume()
    assert reruns == []
    ((out,),) = [ended]
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == full[2].outputs[0].token_ids

"""Stop conditions, sampling options, streaming and the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from megaserve import LLM, SamplingParams
from megaserve.runtime.async_engine import AsyncLLMEngine

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def llm():
    with LLM(dtype="float32", max_model_len=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm):
    """24 greedy tokens of PROMPT, ignoring EOS."""
    return llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]


def test_max_tokens_gives_length(reference):
    assert len(reference.outputs[0].token_ids) == 24
    assert reference.outputs[0].finish_reason == "length"


def test_stop_token_id(llm, reference):
    target = reference.outputs[0].token_ids[5]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                              stop_token_ids=[target]))[0].outputs[0]
    first = reference.outputs[0].token_ids.index(target)
    assert out.token_ids == reference.outputs[0].token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored(llm, reference):
    eos = reference.outputs[0].token_ids[3]
    llm.engine.outputs.eos_token_ids = frozenset({eos})
    try:
        out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
        ignored = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    finally:
        llm.engine.outputs.eos_token_ids = frozenset(llm.engine.tokenizer.eos_token_ids)
    first = reference.outputs[0].token_ids.index(eos)
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == first + 1
    assert len(ignored.outputs[0].token_ids) == 24


def test_stop_string_cuts_text(llm, reference):
    text = reference.outputs[0].text
    stop = text[6:9]
    assert stop.strip(), "reference text too short for the test"
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                              stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    kept = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_max_model_len_ends_generation(llm):
    out = llm.generate({"prompt_token_ids": [3] * 120},
                       SamplingParams(max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_seeded_sampling_is_reproducible_and_seed_sensitive(llm):
    def run(seed):
        return llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=seed,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_one_is_greedy(llm, reference):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=1.5, top_k=1, seed=3,
                                              ignore_eos=True))[0].outputs[0]
    assert out.token_ids == reference.outputs[0].token_ids


def test_logprobs_contain_sampled_token_and_top_n(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=3,
                                              ignore_eos=True))[0].outputs[0]
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())


def test_async_engine_streams_and_aborts_on_cancel():
    async def main():
        engine = AsyncLLMEngine(dtype="float32", max_model_len=128)
        try:
            seen = []
            async for out in engine.generate("a", PROMPT, SamplingParams(max_tokens=6, temperature=0)):
                seen.append(list(out.outputs[0].token_ids))
            assert [len(s) for s in seen] == list(range(1, 7)) and out.finished

            first = asyncio.Event()

            async def consume():
                async for _ in engine.generate("b", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True)):
                    first.set()
            task = asyncio.create_task(consume())
            # Cancel mid-stream: after the first token (a fixed sleep raced the whole
            # request once the CPU kernels got fast enough to finish it within the sleep).
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                stats = engine.stats()
                if stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks:
                    break
                await asyncio.sleep(0.05)
            assert stats.num_running == 0 and stats.num_free_kv_blocks == stats.num_kv_blocks
            with pytest.raises(ValueError, match="max_tokens|prompt"):
                async for _ in engine.generate("c", "", SamplingParams()):
                    pass
        finally:
            await engine.shutdown()
    asyncio.run(main())


def test_cli_generate_and_errors():
    ok = subprocess.run([sys.executable, "-m", "megaserve.cli", "generate", "Hello", "--max-tokens", "4"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "4 tokens" in ok.stderr
    bad = subprocess.run([sys.executable, "-m", "megaserve.cli", "generate", "Hi", "--temperature", "-1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr
    version = subprocess.run([sys.executable, "-m", "megaserve.cli", "--version"],
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("megaserve ")

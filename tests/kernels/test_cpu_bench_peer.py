"""``megaserve bench cpu --peer``: the peer's worker runs under the interpreter it is given,
and a peer that cannot start is a clear error (exit code 2, the worker's own message), not
a hang or a traceback."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from megaserve.bench import cpu as bench_cpu

TINY = ["--num-prompts", "2", "--input-len", "4", "--output-len", "3", "--max-num-seqs", "2"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="this interpreter has vllm: the peer would start")
def test_a_peer_interpreter_without_vllm_is_a_clear_error(capsys):
    rc = bench_cpu.main(["--peer", "vllm", "--peer-python", sys.executable, *TINY])
    err = capsys.readouterr().err
    assert rc == 2
    assert "peer worker exited" in err and "No module named 'vllm'" in err


def test_peer_flags_are_checked():
    assert bench_cpu._peer_env(["A=1", "VLLM_CPU_KVCACHE_SPACE=2"]) == {
        "VLLM_CPU_KVCACHE_SPACE": "2", "A": "1"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench_cpu._peer_env(["novalue"])
    assert bench_cpu.main(["--peer", "vllm", "--baseline-tree", "/nonexistent", *TINY]) == 2
    assert bench_cpu.main(["--peer", "vllm", "--model", "builtin:tiny-moe", *TINY]) == 2


def test_every_engine_gets_the_same_prompts():
    a = bench_cpu.make_prompts(512, 3, 5, seed=7)
    assert a == bench_cpu.make_prompts(512, 3, 5, seed=7)
    assert len(a) == 3 and all(len(p["prompt_token_ids"]) == 5 for p in a)
    assert all(0 <= t < 512 for p in a for t in p["prompt_token_ids"])
    assert a != bench_cpu.make_prompts(512, 3, 5, seed=8)

"""``megaserve bench host`` on CPU: every phase is measured and the spans add up."""

from __future__ import annotations

import pytest

from megaserve.bench import host


@pytest.mark.parametrize("extra", [[], ["--output-kind", "final_only", "--async-scheduling"]])
def test_host_bench_reports_every_phase_per_sequence(extra: list[str]) -> None:
    args = host._parser().parse_args(["--batches", "4,8", "--steps", "3", "--warmup-steps", "1",
                                      *extra])
    results = host._measure(args)
    assert sorted(results) == [4, 8]
    for r in results.values():
        for phase in ("schedule", "fill", "device", "outputs", "host", "step"):
            assert r[phase] > 0, phase
        assert r["host"] < r["step"]
        assert r["schedule"] + r["fill"] + r["outputs"] < r["host"]

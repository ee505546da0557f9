"""``megaserve bench comm`` runs on CPU (tcp and nccl-on-gloo vs raw gloo) and rejects bad input
with exit code 2."""

from __future__ import annotations

import pytest

from megaserve.comm.bench import default_patterns, main, parse_pattern, parse_size


def test_parsers():
    assert parse_size("2K") == 2048 and parse_size("8MiB") == 8 << 20 and parse_size("100") == 100
    assert parse_pattern("2x3") == (2, 3)
    for bad in ("0", "2Q", "x"):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ValueError):
        parse_pattern("2by3")
    assert default_patterns(4) == [(1, 1), (1, 3), (2, 2), (3, 1)]
    assert default_patterns(2) == [(1, 1)]


@pytest.mark.parametrize("argv", [["--sizes", "2Q"], ["--patterns", "1y1"], ["--iters", "0"],
                                  ["--transport", "ucx"], ["--transports", "tcp,ucx"],
                                  ["--transports", "cuda_ipc,tcp"]])
def test_bad_input_exits_2(argv, capsys):
    assert main(argv) == 2
    assert "megaserve bench comm" in capsys.readouterr().err


@pytest.mark.timeout(300)  # spawns baseline processes: minutes on a loaded box
def test_cpu_run_prints_ours_and_baseline(capsys):
    assert main(["--patterns", "1x1", "--sizes", "2K,64K", "--iters", "2", "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "device: CPU" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("1x1")]
    assert [(r[1] + r[2], r[3]) for r in rows] == [
        ("2KiB", "tcp"), ("2KiB", "nccl"), ("2KiB", "raw-gloo"),
        ("64KiB", "tcp"), ("64KiB", "nccl"), ("64KiB", "raw-gloo")]
    assert all(0 < float(r[4]) <= float(r[5]) and float(r[6]) > 0 for r in rows)  # p50 <= p99

"""GPU probe of comm.stream_flags: handoff between streams, inside CUDA graphs, host release.

python scripts/stream_flags_probe.py   (prints one line per check and a ping-pong latency)
"""

from __future__ import annotations

import time

import torch

from megaserve.comm import stream_flags as sf


def main() -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(60, exit=True, file=sys.stderr)
    dev = torch.device("cuda")
    flags = torch.zeros(8, dtype=torch.int32, device=dev)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1024, device=dev)
    # 1. handoff: b waits for a's flag, then adds; a sleeps first so b must really wait.
    with torch.cuda.stream(b):
        sf.wait_and_clear(flags[0:1])
        x.add_(1)
    with torch.cuda.stream(a):
        torch.cuda._sleep(50_000_000)
        x.fill_(41)
        sf.write(flags[0:1], sf.SET)
    torch.cuda.synchronize()
    print("handoff", float(x[0]), int(flags[0]))
    # 2. the same inside two CUDA graphs, replayed several times (toggle protocol).
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    y = torch.zeros(1024, device=dev)
    with torch.cuda.graph(ga, stream=a):
        y.add_(1)
        sf.write(flags[1:2], sf.SET)
        sf.wait_and_clear(flags[2:3])
    with torch.cuda.graph(gb, stream=b):
        sf.wait_and_clear(flags[1:2])
        y.mul_(2)
        sf.write(flags[2:3], sf.SET)
    torch.cuda.synchronize()
    y.zero_()
    for _ in range(5):  # a graph replays on the current stream: each on its own
        with torch.cuda.stream(b):
            gb.replay()
        with torch.cuda.stream(a):
            ga.replay()
    torch.cuda.synchronize()
    print("graphs", float(y[0]), "expected", float(((((0 + 1) * 2 + 1) * 2 + 1) * 2 + 1) * 2 + 1) * 2)
    # 3. ping-pong latency: graphs of 1000 round trips.
    n = 100  # graphs of thousands of stream memory operations stalled their launch (H100)
    pa, pb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(pa, stream=a):
        for _ in range(n):
            sf.write(flags[3:4], sf.SET)
            sf.wait_and_clear(flags[4:5])
    with torch.cuda.graph(pb, stream=b):
        for _ in range(n):
            sf.wait_and_clear(flags[3:4])
            sf.write(flags[4:5], sf.SET)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        with torch.cuda.stream(b):
            pb.replay()
        with torch.cuda.stream(a):
            pa.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / n * 1e6)
    print("round trip us (graph, in-process)", sorted(times))
    # 4. host release of a stream whose producer never writes.
    with torch.cuda.stream(b):
        sf.wait(flags[5:6], sf.SET)
        x.fill_(7)
    done = torch.cuda.Event()
    done.record(b)
    time.sleep(0.2)
    print("blocked", not done.query())
    sf.Releaser(dev).release([flags[5:6]])
    done.synchronize()
    print("released", float(x[0]))


if __name__ == "__main__":
    main()

"""The bf16 matmul rate held for seconds, not the best of a short burst, on a CUDA device.

``megaserve bench decode`` divides prefill FLOP/s by the best of ten 8192^3 products (about
14 ms of work) and by the rate held over ``--matmul-seconds`` (one timing of the whole run);
a 4k-token prefill window keeps the tensor cores busy for about a second. This runs
``torch.matmul`` of ``n x n x n`` bf16 back to back for ``--seconds`` and prints the rate
of each ``--window-ms`` slice (CUDA events), so a clock that falls under sustained load
(power or thermal limits) shows as a falling rate within the run. Run it beside
``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active
--format=csv -lms 20`` to see the clocks too.

    source scripts/device_setup.sh
    python scripts/sustained_matmul.py --seconds 3
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--window-ms", type=float, default=100.0)
    args = parser.parse_args()
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    flop = 2 * args.n**3
    for _ in range(3):
        torch.matmul(a, b, out=c)
    probe_start, probe_end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    probe_start.record()
    torch.matmul(a, b, out=c)
    probe_end.record()
    torch.cuda.synchronize()
    per_window = max(1, round(args.window_ms / probe_start.elapsed_time(probe_end)))
    windows = max(1, round(args.seconds * 1e3 / args.window_ms))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(windows + 1)]
    events[0].record()
    for w in range(windows):
        for _ in range(per_window):
            torch.matmul(a, b, out=c)
        events[w + 1].record()
    torch.cuda.synchronize()
    rates = [per_window * flop / (events[w].elapsed_time(events[w + 1]) * 1e-3) / 1e12
             for w in range(windows)]
    print(f"device: {torch.cuda.get_device_name()}  {args.n}^3 bf16, {per_window} products a "
          f"window, {windows} windows")
    print("TFLOP/s per window: " + " ".join(f"{r:.0f}" for r in rates))
    print(f"first {rates[0]:.0f}, best {max(rates):.0f}, median {statistics.median(rates):.0f}, "
          f"last {rates[-1]:.0f}, whole run "
          f"{windows * per_window * flop / (events[0].elapsed_time(events[-1]) * 1e-3) / 1e12:.0f}")


if __name__ == "__main__":
    main()

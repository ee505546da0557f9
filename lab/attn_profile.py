"""Per-kernel device times of one paged-attention call (long-context decode).

Run on one GPU: ``PYTHONPATH=. python3 lab/attn_profile.py [--seqs 8 --ctx 8192]``.
Replays a CUDA graph of the default launch (as a decode step does) under the torch
profiler and prints each kernel's mean device time, the sum, and the wall time per
replay: the gap between the sum and the wall time is launch and drain cost, the rest
splits the call between its kernels (for the split mode: parts, then fold). SDPA flash on
the same data is profiled the same way for comparison.
"""

from __future__ import annotations

import argparse
import collections
import time


def _profile(fn, replays: int) -> tuple[dict[str, float], float]:
    """({kernel name: mean us per replay}, wall us per replay) of a graph of ``fn``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t0) * 1e6 / replays
    per_kernel: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type.name == "CUDA":
            per_kernel[event.name[:70]] += event.device_time / replays
    return dict(per_kernel), wall_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megaserve.kernels.testing import paged_inputs
    from megaserve.kernels.triton_impl.attention import paged_attention

    hq, hkv, dh = 32, 8, 128
    q, kc, vc, table, lens, qsl, kd, vd = paged_inputs(args.seqs, args.ctx, 1, hq, hkv, dh,
                                                        torch.bfloat16)
    scale = dh**-0.5
    qd = q.view(args.seqs, 1, hq, dh).transpose(1, 2)

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)

    print(f"device: {torch.cuda.get_device_name()}; decode S={args.seqs} ctx={args.ctx}")
    for name, fn in (("ours (default launch)",
                      lambda: paged_attention(q, kc, vc, table, lens, qsl, scale)),
                     ("SDPA flash", flash)):
        kernels, wall = _profile(fn, args.replays)
        print(f"{name}: wall {wall:.1f} us per replay, kernels {sum(kernels.values()):.1f} us")
        for kname, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"    {us:8.1f} us  {kname}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

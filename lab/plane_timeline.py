"""Where one MoE-layer tick's time goes on the device data plane, from the two roles'
chrome traces (``megaserve bench device-plane --trace-dir DIR`` with
``MEGASERVE_EXPERT_TRACE=DIR``: the attention process's ``<layout>.json`` and the expert
process's ``<layout>_expert*.json``).

    python lab/plane_timeline.py ATTENTION.json EXPERT.json

Ticks are found by their kernels: the attention side's pack (``_pack_kernel``), the expert
side's ids kernel (``_local_ids_kernel``, the tick's first) and its combine
(``_combine_kernel``, the last). Both traces carry host-clock timestamps (the profiler
maps GPU time onto the host's clock in each process), so the hops across GPUs are
differences between the two files, good to a few microseconds. Prints the median of each
part over the ticks found in both.
"""

from __future__ import annotations

import bisect
import json
import statistics
import sys

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_records(path: str) -> list[dict]:
    """Every GPU event (kernel, copy, memset) of a chrome trace, as the trace has it."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]


def gpu_events(path: str) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU event in a chrome trace, by start."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in gpu_records(path))


def parts(attention: list, expert: list) -> dict[str, list[float]]:
    """Each tick's parts (us), keyed by name (module docstring)."""
    packs = [e for e in attention if "_pack_kernel" in e[2]]
    ids = [e for e in expert if "_local_ids_kernel" in e[2]]
    combines = [e for e in expert if "_combine_kernel" in e[2]]
    att_starts = [e[0] for e in attention]
    pack_ends = [e[1] for e in packs]
    out: dict[str, list[float]] = {k: [] for k in (
        "attention: combine arrival -> pack end", "attention: pack kernel",
        "dispatch hop: pack end -> ids kernel end", "expert: ids kernel",
        "expert: ids end -> combine start (grouped GEMM)", "expert: combine kernel",
        "combine hop: combine end -> next attention kernel", "tick: pack end -> next pack end")}
    for start, end, _ in ids:
        j = bisect.bisect_right(pack_ends, end) - 1  # the dispatch this tick serves
        c = next((e for e in combines if e[0] >= end), None)
        if j < 0 or c is None or j + 1 >= len(packs):
            continue
        n = bisect.bisect_right(att_starts, c[1])  # first attention kernel after the combine
        if n >= len(attention) or attention[n][0] > packs[j + 1][1]:
            continue
        out["attention: pack kernel"].append(packs[j][1] - packs[j][0])
        out["dispatch hop: pack end -> ids kernel end"].append(end - packs[j][1])
        out["expert: ids kernel"].append(end - start)
        out["expert: ids end -> combine start (grouped GEMM)"].append(c[0] - end)
        out["expert: combine kernel"].append(c[1] - c[0])
        out["combine hop: combine end -> next attention kernel"].append(attention[n][0] - c[1])
        out["attention: combine arrival -> pack end"].append(packs[j + 1][1] - attention[n][0])
        out["tick: pack end -> next pack end"].append(packs[j + 1][1] - packs[j][1])
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    result = parts(gpu_events(argv[0]), gpu_events(argv[1]))
    ticks = len(result["tick: pack end -> next pack end"])
    print(f"{ticks} ticks matched; medians (us)")
    for name, values in result.items():
        if values:
            print(f"  {name:<52} {statistics.median(values):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Where a traced window's GPU time goes, per process and stream, from the chrome traces
of ``megaserve bench device-layouts`` with ``$MEGASERVE_EXPERT_TRACE=DIR``
(megaserve/runtime/step_trace.py: one file per process and window).

    python lab/stream_busy.py DIR/*.json

Per file: the window's span (first GPU event's start to the last one's end), the time at
least one stream of the process ran a kernel or copy (busy), each stream's busy time and
event count, and the kernels that took the most time in all. A co-located EP process shows
its replica's stream and its expert role's stream; idle = span - busy is the time its GPU
did nothing for this process.
"""

from __future__ import annotations

import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plane_timeline import gpu_records  # noqa: E402  (lab/plane_timeline.py)


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarise(path: str, top: int = 12) -> str:
    events = gpu_records(path)
    if not events:
        return f"{path}: no GPU events"
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events]
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    lines = [f"{path}: span {span / 1e3:.2f} ms, busy {union_us(spans) / 1e3:.2f} ms, "
             f"{len(events)} GPU events"]
    by_stream = collections.defaultdict(list)
    for e in events:
        by_stream[e.get("tid")].append(e)
    for tid, es in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        busy = union_us([(e["ts"], e["ts"] + e.get("dur", 0)) for e in es])
        lines.append(f"  stream {tid}: busy {busy / 1e3:.2f} ms, {len(es)} events")
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        by_name[(e.get("tid"), e["name"][:90])][0] += e.get("dur", 0)
        by_name[(e.get("tid"), e["name"][:90])][1] += 1
    for (tid, name), (us, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {us / 1e3:8.2f} ms {n:6d}x  [{tid}] {name}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        print(summarise(path))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""``megaserve bench comm``: M→N exchange latency and throughput, our transports vs raw NCCL.

One *step* is what a dispatch is: each of M senders writes one message of S bytes to each
of N receivers; each receiver counts its M messages, releases them and answers every sender
with a 0-byte ack; the step ends when a sender has all N acks. Reported: p50 / p99 step
time over the senders' steps and throughput = M·N·S / p50.

Measured in the same processes, one after the other: each of our transports (default on
GPUs: ``cuda_ipc`` and ``nccl``, the protocol over per-direction NCCL groups; on CPU:
``tcp`` and ``nccl`` on gloo), then the two-sided baseline ``raw-nccl`` (``raw-gloo`` on
CPU): plain ``torch.distributed`` isend/irecv batches, no slots, no credits.

Every rank is its own process (spawn); on GPUs rank r uses ``cuda:(r % num_gpus)``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

EXIT_USAGE = 2
OUR_TRANSPORTS = ("tcp", "cuda_ipc", "nccl", "rdma")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"2K"`` → 2048, ``"8M"`` → 8 MiB, ``"100"`` → 100; ValueError otherwise."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in _UNITS else text
    if not number.isdigit() or int(number) * mult < 1:
        raise ValueError(f"size {text!r} is not like 2K, 64K, 8M or a byte count")
    return int(number) * mult


def parse_pattern(text: str) -> tuple[int, int]:
    """``"2x3"`` → (2 senders, 3 receivers)."""
    m, sep, n = text.lower().partition("x")
    if not sep or not m.isdigit() or not n.isdigit() or int(m) < 1 or int(n) < 1:
        raise ValueError(f"pattern {text!r} is not MxN (e.g. 1x2)")
    return int(m), int(n)


def _fmt_size(n: int) -> str:
    for unit, mult in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


# -- worker process --------------------------------------------------------------------
def _steps_ours(ep: Any, spec: dict, senders: list[int], receivers: list[int], make: Any) -> dict:
    times: dict[int, list[float]] = {}
    for size in spec["sizes"]:
        payload = make(size)
        ack = make(0)
        samples = []
        for it in range(spec["warmup"] + spec["iters"]):
            if ep.rank in senders:
                t0 = time.perf_counter()
                for dst in receivers:
                    ep.send(dst, payload, layer=it % 4096, microbatch=0)
                for c in ep.poll_many(len(receivers)):
                    ep.release(c)
                if it >= spec["warmup"]:
                    samples.append(time.perf_counter() - t0)
            else:
                for c in ep.poll_many(len(senders)):
                    ep.release(c)
                for src in senders:
                    ep.send(src, ack, layer=it % 4096, microbatch=0)
        times[size] = samples
    return times


def _p2p(dist: Any, ops: list[tuple[Any, Any, int]]) -> None:
    """Run isend/irecv ops to completion: one op plainly, several as one NCCL group."""
    if len(ops) == 1:
        fn, tensor, peer = ops[0]
        fn(tensor, peer).wait()
        return
    for req in dist.batch_isend_irecv([dist.P2POp(fn, tensor, peer) for fn, tensor, peer in ops]):
        req.wait()


def _steps_baseline(dist: Any, torch: Any, spec: dict, rank: int, senders: list[int],
                    receivers: list[int], device: Any) -> dict:
    times: dict[int, list[float]] = {}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for size in spec["sizes"]:
        buf = torch.ones(size, dtype=torch.uint8, device=device)
        inbox = [torch.empty(size, dtype=torch.uint8, device=device) for _ in senders]
        acks = [torch.zeros(1, dtype=torch.uint8, device=device) for _ in range(max(len(senders), len(receivers)))]
        samples = []
        for it in range(spec["warmup"] + spec["iters"]):
            if rank in senders:
                t0 = time.perf_counter()
                # same grouping on both sides: payload batch, then ack batch
                _p2p(dist, [(dist.isend, buf, r) for r in receivers])
                _p2p(dist, [(dist.irecv, acks[i], r) for i, r in enumerate(receivers)])
                sync()
                if it >= spec["warmup"]:
                    samples.append(time.perf_counter() - t0)
            else:
                _p2p(dist, [(dist.irecv, inbox[i], s) for i, s in enumerate(senders)])
                _p2p(dist, [(dist.isend, acks[i], s) for i, s in enumerate(senders)])
                sync()
        times[size] = samples
    return times


def _endpoint_options(transport: str, gpu: bool, device: Any) -> dict[str, Any]:
    if transport == "cuda_ipc":
        return {"device": device}
    if transport == "nccl":
        return {"device": device, "backend": "nccl" if gpu else "gloo"}
    return {}


def _worker(rank: int, spec: dict, rdv_addresses: list[str], dist_address: str, results: Any) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from . import ChannelConfig, create_endpoint, exchange

        m, n = spec["m"], spec["n"]
        world = m + n
        senders, receivers = list(range(m)), list(range(m, world))
        if spec["gpu"]:
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)

            def make(size: int) -> Any:
                return torch.ones(size, dtype=torch.uint8, device=device)
        else:
            device = torch.device("cpu")

            def make(size: int) -> Any:
                return bytes(size)

        cfg = ChannelConfig(slot_bytes=max(spec["sizes"]), slots_per_peer=2, timeout_s=120)
        ours = {}
        for transport, rdv_address in zip(spec["transports"], rdv_addresses):
            ep = create_endpoint(transport, rank, world, cfg, **_endpoint_options(transport, spec["gpu"], device))
            ep.connect(exchange(rdv_address, rank, world, ep.address, timeout_s=120),
                       send_to=receivers if rank in senders else senders)
            ours[transport] = _steps_ours(ep, spec, senders, receivers, make)
            ep.close()
        dist.init_process_group(spec["baseline_backend"], init_method=f"tcp://{dist_address}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120),
                                device_id=device if spec["gpu"] else None)
        dist.barrier()  # every rank joins the communicator before the first P2P batch
        base = _steps_baseline(dist, torch, spec, rank, senders, receivers, device)
        dist.destroy_process_group()
        results.put({"rank": rank, "ok": True, "ours": ours, "base": base})
    except Exception:  # noqa: BLE001 - reported by the parent
        results.put({"rank": rank, "ok": False, "error": traceback.format_exc()})


# -- driver ----------------------------------------------------------------------------
def _free_address() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_pattern(spec: dict, timeout_s: float = 280.0) -> dict[str, dict[int, list[float]]]:
    """Run one MxN pattern in M+N spawned processes.

    Returns {name: {size: senders' step seconds}}, one name per transport of
    ``spec["transports"]`` plus ``"base"`` (the raw torch.distributed baseline).
    """
    from .rendezvous import RendezvousServer

    world = spec["m"] + spec["n"]
    ctx = mp.get_context("spawn")
    rdvs = [RendezvousServer(world, timeout_s=timeout_s) for _ in spec["transports"]]
    results = ctx.Queue()
    dist_address = _free_address()  # rank 0's torch.distributed store
    procs = [ctx.Process(target=_worker, args=(r, spec, [x.address for x in rdvs], dist_address, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[str, dict[int, list[float]]] = {name: {} for name in [*spec["transports"], "base"]}
    try:
        for _ in range(world):
            r = results.get(timeout=timeout_s)
            if not r["ok"]:
                raise RuntimeError(f"rank {r['rank']} failed:\n{r['error']}")
            if r["rank"] < spec["m"]:
                for name, times in [*r["ours"].items(), ("base", r["base"])]:
                    for size, samples in times.items():
                        out[name].setdefault(size, []).extend(samples)
    finally:
        reap(procs)
        for rdv in rdvs:
            rdv.close()
    return out


def reap(procs: list, timeout_s: float = 10.0) -> None:
    """Join each process, killing (and then joining) one still alive after ``timeout_s``."""
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def default_patterns(gpus: int) -> list[tuple[int, int]]:
    """1→1, 1→(g-1), 2→(g-2) and (g-1)→1 on g GPUs (one process per GPU); a CPU set otherwise."""
    if gpus < 2:
        return [(1, 1), (1, 2), (2, 2)]
    patterns = [(1, 1), (1, gpus - 1)]
    if gpus >= 4:
        patterns.append((2, gpus - 2))
    if gpus >= 3:
        patterns.append((gpus - 1, 1))
    return list(dict.fromkeys(patterns))


def device_name(gpu: bool) -> str:
    if gpu:
        import torch

        count = torch.cuda.device_count()
        return f"{torch.cuda.get_device_name(0)} x{count}"
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _row(pattern: str, size: int, name: str, m: int, n: int, samples: list[float]) -> str:
    p50 = statistics.median(samples)
    p99 = sorted(samples)[min(len(samples) - 1, int(round(0.99 * (len(samples) - 1))))]
    gbps = m * n * size / p50 / 1e9
    return f"{pattern:<8}{_fmt_size(size):>9}  {name:<10}{p50 * 1e6:>11.1f}{p99 * 1e6:>11.1f}{gbps:>10.4g}"


def _parse_transports(args: argparse.Namespace, gpus: int) -> tuple[list[str], bool]:
    """(our transports, GPU mode); ValueError for an unknown or unplaceable choice."""
    text = args.transport or args.transports
    if text is None:
        transports = ["cuda_ipc", "nccl"] if gpus >= 2 else ["tcp", "nccl"]
    else:
        transports = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in transports if t not in OUR_TRANSPORTS]
    if unknown or not transports:
        raise ValueError(f"unknown transport(s) {unknown or text!r}; choose from {list(OUR_TRANSPORTS)}")
    # GPU mode when every transport moves GPU memory and 2+ GPUs exist; nccl then uses
    # NCCL, else gloo (host memory), like the raw baseline.
    gpu = gpus >= 2 and all(t in ("cuda_ipc", "nccl") for t in transports)
    if "cuda_ipc" in transports and not gpu:
        raise ValueError("cuda_ipc needs 2+ GPUs and no host transport in the same run; "
                         "use --transports tcp,nccl on CPU")
    return transports, gpu


def main(argv: list[str]) -> int:
    """Entry point of ``megaserve bench comm``; returns an exit code."""
    parser = argparse.ArgumentParser(prog="megaserve bench comm", description=__doc__.split("\n")[0])
    parser.add_argument("--transports", default=None,
                        help="comma list of ours from tcp,cuda_ipc,nccl,rdma "
                             "(default: cuda_ipc,nccl with 2+ GPUs, else tcp,nccl)")
    parser.add_argument("--transport", default=None, help="a single transport (same as --transports X)")
    parser.add_argument("--patterns", default=None, help="comma list of MxN (default: fit the devices)")
    parser.add_argument("--sizes", default="2K,64K,1M,8M", help="message sizes, e.g. 2K,64K,1M,8M")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per size")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else EXIT_USAGE
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        transports, gpu = _parse_transports(args, gpus)
        sizes = sorted({parse_size(s) for s in args.sizes.split(",")})
        if args.patterns:
            patterns = [parse_pattern(p) for p in args.patterns.split(",")]
        else:
            patterns = default_patterns(gpus if gpu else 0)
        if gpu and any(m + n > gpus for m, n in patterns):
            raise ValueError(f"one process per GPU: M+N must be <= {gpus}")
        if args.iters < 1 or args.warmup < 0:
            raise ValueError("--iters must be >= 1 and --warmup >= 0")
    except ValueError as e:
        print(f"megaserve bench comm: {e}", file=sys.stderr)
        return EXIT_USAGE
    baseline = "nccl" if gpu else "gloo"
    print(f"comm benchmark — device: {device_name(gpu)}; ours: {', '.join(transports)}; baseline: "
          f"raw-{baseline} (torch.distributed isend/irecv); {args.iters} steps/size after "
          f"{args.warmup} warm-up")
    print(f"{'pattern':<8}{'size':>9}  {'transport':<10}{'p50 us':>11}{'p99 us':>11}{'GB/s':>10}")
    for m, n in patterns:
        spec = {"m": m, "n": n, "sizes": sizes, "iters": args.iters, "warmup": args.warmup,
                "transports": transports, "baseline_backend": baseline, "gpu": gpu}
        try:
            out = run_pattern(spec)
        except (RuntimeError, OSError) as e:
            print(f"megaserve bench comm: pattern {m}x{n} failed: {e}", file=sys.stderr)
            return 1
        for size in sizes:
            for key in [*transports, "base"]:
                name = f"raw-{baseline}" if key == "base" else key
                print(_row(f"{m}x{n}", size, name, m, n, out[key][size]), flush=True)
    return 0

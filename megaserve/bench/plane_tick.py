"""``megaserve bench plane-tick``: one tick's dispatch + combine on the device data plane,
against NCCL send/recv of the same bytes between the same two processes.

The replica's side runs as the data plane runs it inside a decode graph (pack into each
expert worker's inbox, dispatch flags, wait for the combine flags, gather); each expert
worker echoes instead of computing: it waits for the dispatch, writes the combine's bytes
back into the replica's inbox (k rows per token in the model's dtype, or one float32 row
per token where one worker pre-reduces: ``--reduce``) and raises the combine flag. Ticks
run :data:`TICKS` to a CUDA graph; each is timed by CUDA events around it, p50/p99 (the
first tick of each graph is left out: it also waits for the peer's graph to start).

With ``--nccl`` (one worker, processes), the same two processes then exchange the same
bytes with ``torch.distributed`` NCCL send/recv (the replica sends the packed rows, ids and
weights and receives the combine's bytes; eager, events around each exchange) — the
baseline a host-driven exchange would have. With two GPUs the worker runs on the second::

    megaserve bench plane-tick --tokens 1024 --reduce --nccl
"""

from __future__ import annotations

import argparse
import statistics

TICKS = 50  # dispatch+combine round trips per captured graph


def _tick_shape(workers: int, tokens: int, hidden: int, top_k: int, experts: int,
                reduce: bool):
    import torch

    from megaserve.runtime.device_plane import PlaneShape

    return PlaneShape(num_workers=workers, microbatches=1, capacity=tokens, hidden=hidden,
                      top_k=top_k, num_experts=experts, dtype=torch.bfloat16,
                      reduce_on_workers=reduce)


def _echo_graph(shape, index: int, inbox, replica, stream):
    """The expert side of :data:`TICKS` ticks without the GEMM: wait for the dispatch,
    write the combine's bytes (each packed row k times, or once as float32 when
    pre-reduced) into the replica's inbox, raise the combine flag."""
    import torch

    from megaserve.comm import stream_flags as sf

    c, k, d = shape.capacity, shape.combine_rows, shape.hidden
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(TICKS):
            sf.wait_and_clear(inbox.flags[0, 0:1])
            replica.out[0, index, :c].copy_(inbox.rows[0, 0, :c, None, :].expand(c, k, d))
            sf.write(replica.flags[0, index: index + 1], sf.SET)
        graph.capture_end()
    return graph


def _exchange_bytes(shape) -> tuple[int, int]:
    """(dispatch, combine) bytes of one tick with one worker: rows + int32 ids + float32
    weights out, k' rows of the combine's dtype back."""
    c, d, k = shape.capacity, shape.hidden, shape.top_k
    dispatch = c * (d * shape.dtype.itemsize + k * 4 + k * 4)
    combine = c * shape.combine_rows * d * shape.combine_dtype.itemsize
    return dispatch, combine


def _nccl_loop(rank: int, port: int, shape, repeats: int) -> list[float]:
    """NCCL send/recv of one tick's bytes between ranks 0 (replica) and 1 (worker):
    rank 0 sends the dispatch's bytes and receives the combine's; returns rank 0's times
    (us, CUDA events around each exchange), nothing on rank 1."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, device_id=device)
    try:
        out_bytes, back_bytes = _exchange_bytes(shape)
        send = torch.ones(out_bytes if rank == 0 else back_bytes, dtype=torch.uint8,
                          device=device)
        recv = torch.empty(back_bytes if rank == 0 else out_bytes, dtype=torch.uint8,
                           device=device)
        events = []
        for _ in range(repeats + 5):  # 5 warm-up exchanges
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            pair[0].record()
            if rank == 0:
                dist.send(send, 1)
                dist.recv(recv, 1)
            else:
                dist.recv(recv, 0)
                dist.send(send, 0)
            pair[1].record()
            events.append(pair)
        torch.cuda.synchronize()
        return [a.elapsed_time(b) * 1e3 for a, b in events[5:]]
    finally:
        dist.destroy_process_group()


def _echo_process(spec: tuple, index: int, device: int, replica_handle: bytes, replies, go,
                  nccl: tuple | None) -> None:
    """An expert worker process that echoes ticks (cuda_ipc), then (``nccl``: (port,
    repeats)) takes part in the NCCL exchanges."""
    import torch

    from megaserve.comm.cuda_ipc import open_tensor, share_tensor
    from megaserve.runtime.device_plane import ExpertInbox, ReplicaInbox

    torch.cuda.set_device(device)
    shape = _tick_shape(*spec)
    inbox = ExpertInbox(shape, f"cuda:{device}")
    replica = ReplicaInbox(shape, storage=open_tensor(replica_handle, user=f"cuda:{device}"))
    stream = torch.cuda.Stream()
    graph = _echo_graph(shape, index, inbox, replica, stream)
    torch.cuda.synchronize()
    replies.put((index, share_tensor(inbox.storage)))
    while go.get() == "go":
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()
        replies.put((index, None))
    if nccl is not None:
        _nccl_loop(1, nccl[0], shape, nccl[1])


def bounded_sync(stream, flags: list, peer_alive, timeout_s: float = 60.0) -> None:
    """Wait for ``stream``; if a peer dies or ``timeout_s`` passes, raise ``flags`` (what
    the stream waits on) to ABORT until it drains, then raise RuntimeError."""
    import time

    from megaserve.comm import stream_flags as sf

    deadline = time.monotonic() + timeout_s
    while not stream.query():
        if time.monotonic() > deadline or not peer_alive():
            releaser = sf.Releaser(flags[0].device)
            while not stream.query():
                releaser.release(flags)
                time.sleep(0.001)
            raise RuntimeError("a peer process stopped answering")
        time.sleep(0.0005)


def tick_latency(workers: int, processes: bool, tokens: int = 256, hidden: int = 2048,
                 top_k: int = 8, experts: int = 128, repeats: int = 10, reduce: bool = False,
                 nccl_port: int | None = None) -> dict[str, list[float]]:
    """Dispatch+combine times (us) of one tick, the replica's side as the data plane runs
    it in a graph (module docstring); ``workers`` echoing expert workers: streams of this
    process, or processes over CUDA IPC (``processes``; on GPU 1, 2, ... where there are
    that many). ``reduce``: one worker pre-reduces (one float32 row per token back).
    ``nccl_port`` (one worker, processes): also NCCL send/recv of the same bytes between
    the same two processes. Returns times by name ("plane", "nccl")."""
    import multiprocessing

    import torch

    from megaserve.comm import stream_flags as sf
    from megaserve.comm.cuda_ipc import open_tensor, share_tensor
    from megaserve.runtime.device_plane import (ExpertInbox, ReplicaInbox, gather, pack,
                                                timing_event)

    spec = (workers, tokens, hidden, top_k, experts, reduce)
    shape = _tick_shape(*spec)
    nccl = (nccl_port, repeats * TICKS) if nccl_port is not None else None
    if nccl is not None and (workers != 1 or not processes):
        raise ValueError("the NCCL baseline runs between one replica and one worker process")
    replica = ReplicaInbox(shape, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
    topk_ids = torch.rand(tokens, experts, generator=g, device="cuda").argsort(1)[:, :top_k]
    topk_w = torch.rand(tokens, top_k, generator=g, device="cuda") if reduce else None
    owner = torch.arange(experts, device="cuda") % workers
    torch.cuda.synchronize()
    echo_streams, echo_graphs, peers, go = [], [], [], None
    if processes:
        ctx = multiprocessing.get_context("spawn")
        replies, go = ctx.Queue(), [ctx.Queue() for _ in range(workers)]
        handle = share_tensor(replica.storage)
        gpus = torch.cuda.device_count()
        for e in range(workers):
            device = (1 + e) % gpus if gpus > 1 else 0
            peers.append(ctx.Process(target=_echo_process, daemon=True,
                                     args=(spec, e, device, handle, replies, go[e], nccl)))
            peers[-1].start()
        handles = dict(replies.get(timeout=120) for _ in range(workers))
        inboxes = [ExpertInbox(shape, storage=open_tensor(handles[e], user="cuda:0"))
                   for e in range(workers)]
    else:
        inboxes = [ExpertInbox(shape, "cuda") for _ in range(workers)]
        for e in range(workers):
            echo_streams.append(torch.cuda.Stream())
            echo_graphs.append(_echo_graph(shape, e, inboxes[e], replica, echo_streams[e]))
    stream, events = torch.cuda.Stream(), []
    owners = owner[topk_ids] if workers > 1 else None
    for e, inbox in enumerate(inboxes):  # kernels compiled and loaded before the capture
        pack(inbox.slot(0), 0, x, topk_ids, owners, e, workers == 1, topk_w, owner)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(TICKS):
            pair = (timing_event(), timing_event())
            pair[0].record()
            owners = owner[topk_ids] if workers > 1 else None
            positions = []
            for e, inbox in enumerate(inboxes):
                pos = pack(inbox.slot(0), 0, x, topk_ids, owners, e, workers == 1, topk_w, owner)
                if pos is not None:
                    positions.append(pos)
                sf.write(inbox.flags[0, 0:1], sf.SET)
            for e in range(workers):
                sf.wait_and_clear(replica.flags[0, e: e + 1])
            gather(replica, 0, owners, torch.stack(positions) if positions else None, tokens)
            pair[1].record()
            events.append(pair)
        graph.capture_end()
    times: dict[str, list[float]] = {"plane": []}
    try:
        for _ in range(repeats):
            for e in range(workers):
                if processes:
                    go[e].put("go")
                else:
                    with torch.cuda.stream(echo_streams[e]):
                        echo_graphs[e].replay()
            with torch.cuda.stream(stream):
                graph.replay()
            if processes:
                bounded_sync(stream, [replica.flags[0, e: e + 1] for e in range(workers)],
                              lambda: all(peer.is_alive() for peer in peers))
                for _ in range(workers):
                    replies.get(timeout=60)
            torch.cuda.synchronize()
            # the first tick of each graph also waits for the peer's graph to start
            times["plane"] += [a.elapsed_time(b) * 1e3 for a, b in events[1:]]
        for e in range(len(peers)):
            go[e].put("stop")
        if nccl is not None:
            times["nccl"] = _nccl_loop(0, nccl_port, shape, nccl[1])
    finally:
        for e, peer in enumerate(peers):
            go[e].put("stop")
            peer.join(30)
            if peer.is_alive():
                peer.kill()
    return times


def quantiles(times: list[float]) -> tuple[float, float]:
    """(p50, p99) of ``times``."""
    q = statistics.quantiles(times, n=100)
    return q[49], q[98]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megaserve bench plane-tick", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--reduce", action="store_true",
                        help="one worker returns one float32 row per token (pre-reduced)")
    parser.add_argument("--in-process", action="store_true",
                        help="echoing workers on streams of this process (one GPU)")
    parser.add_argument("--nccl", action="store_true",
                        help="also NCCL send/recv of the same bytes, same two processes")
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--repeats", type=int, default=10, help=f"graphs of {TICKS} ticks")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("megaserve bench plane-tick: needs a CUDA GPU")
        return 2
    times = tick_latency(args.workers, not args.in_process, args.tokens, args.hidden,
                         args.top_k, repeats=args.repeats, reduce=args.reduce,
                         nccl_port=args.port if args.nccl else None)
    shape = _tick_shape(args.workers, args.tokens, args.hidden, args.top_k, 128, args.reduce)
    out_b, back_b = _exchange_bytes(shape)
    gpus = torch.cuda.device_count()
    where = ("in-process" if args.in_process else
             f"2 processes, {'GPU 0 -> GPU 1' if gpus > 1 else 'one GPU'}")
    print(f"device: {torch.cuda.get_device_name()} x {gpus}  tick: {args.tokens} tokens x "
          f"{args.hidden} x top-{args.top_k} bf16, {args.workers} worker(s), {where}, "
          f"{'pre-reduced' if args.reduce else f'{args.top_k} rows'} combine "
          f"(per worker: {out_b / 2**20:.2f} MiB out, {back_b / 2**20:.2f} MiB back)")
    base = quantiles(times["nccl"])[0] if "nccl" in times else None
    for name, t in times.items():
        p50, p99 = quantiles(t)
        vs = f"  ({p50 / base:.2f}x NCCL's p50)" if base else ""
        label = "device plane (graph)" if name == "plane" else "NCCL send/recv (eager)"
        print(f"{label:<24} p50 {p50:8.1f} us  p99 {p99:8.1f} us  ({len(t)} ticks){vs}")
    return 0

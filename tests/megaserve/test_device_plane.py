"""The device data plane's arithmetic on the CPU (megaserve.runtime.device_plane): packing
rows per expert worker, the expert tick with rows beyond the count masked, and the
combine's gather give bitwise what in-process experts give, for one replica and for
several sharing a grouped tick; the replicas' step barrier; buffers, capture sizes and the
engine choice. The CUDA side (flags, graphs, processes) is in test_device_plane_gpu.py."""

from __future__ import annotations

import queue

import pytest
import torch

from megaserve.engine.config import EngineConfig
from megaserve.engine.cuda_graphs import capture_sizes
from megaserve.models.expert_part import ExpertPart
from megaserve.models.forward import LocalExperts
from megaserve.comm import create_endpoint
from megaserve.comm.relay import Mailboxes, Relay, Route
from megaserve.runtime.device_plane import (DeviceExperts, ExpertInbox, ExpertLink, ExpertServer,
                                            GraphStep, PlaneShape, RelaySlots, ReplicaInbox,
                                            StepBarrier, Tick, gather, pack)
from megaserve.runtime.factory import device_plane_reason, uses_device_plane

E, D, INTER, K = 8, 32, 16, 2


def _parts(seed: int):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(E, 2 * INTER, D, generator=g) / D ** 0.5
    w_down = torch.randn(E, D, INTER, generator=g) / INTER ** 0.5
    full = ExpertPart(list(range(E)), E, {3: w_gate_up}, {3: w_down})
    return full, w_gate_up, w_down


@pytest.mark.parametrize("placement", [[list(range(8))], [[0, 1, 2, 3], [4, 5, 6, 7]],
                                       [[0, 5], [1, 2, 3], [4, 6, 7]]])
def test_pack_tick_gather_is_bitwise_local_experts(placement) -> None:
    full, w_gate_up, w_down = _parts(0)
    workers = len(placement)
    shape = PlaneShape(num_workers=workers, microbatches=2, capacity=16, hidden=D, top_k=K,
                       num_experts=E, dtype=torch.float32)
    replica = ReplicaInbox(shape, "cpu")
    replica.out.fill_(float("nan"))  # unwritten rows must never be read
    servers = []
    for index, ids in enumerate(placement):
        inbox = ExpertInbox(shape, "cpu")
        inbox.rows.fill_(float("nan"))  # stale rows beyond the count must never be computed
        inbox.ids.fill_(ids[0])
        part = ExpertPart(ids, E, {3: w_gate_up[ids]}, {3: w_down[ids]})
        servers.append(ExpertServer(part, index, shape, inbox, [replica], [3], "cpu"))
    owner = torch.empty(E, dtype=torch.int64)
    for index, ids in enumerate(placement):
        owner[ids] = index
    g = torch.Generator().manual_seed(1)
    for num_tokens in (1, 5, 11, 16):
        x = torch.randn(num_tokens, D, generator=g)
        topk_ids = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :K]  # distinct
        owners = owner[topk_ids]
        positions = [pack(s.inbox.slot(0), 1, x, topk_ids, owners, s.index, workers == 1)
                     for s in servers]
        for server in servers:
            server._tick(3, 1, shape.capacity, use_flags=False)  # the whole slot: counts mask
        got = gather(replica, 1, owners, None if workers == 1 else torch.stack(positions))
        want = LocalExperts(full).dispatch(3, 1, x, topk_ids)
        assert torch.equal(got, want), f"{workers} workers, {num_tokens} tokens"


def test_a_pre_reduced_combine_is_bitwise_the_attention_sides() -> None:
    """One expert worker with reduce_on_workers returns one float32 row per token (the
    routing-weighted sum of its k outputs in rank order); added with unit weight on the
    attention side it gives bitwise what the k rows give there (kernels.combine and
    combine_residual, with and without the next layer's norm), at every token count."""
    from megaserve import kernels

    full, w_gate_up, w_down = _parts(6)
    shape = PlaneShape(num_workers=1, microbatches=2, capacity=16, hidden=D, top_k=K,
                       num_experts=E, dtype=torch.bfloat16, reduce_on_workers=True)
    replica = ReplicaInbox(shape, "cpu")
    assert replica.out.shape == (2, 1, 16, 1, D) and replica.out.dtype == torch.float32
    replica.out.fill_(float("nan"))
    inbox = ExpertInbox(shape, "cpu")
    inbox.rows.fill_(float("nan"))
    part = ExpertPart(list(range(E)), E, {3: w_gate_up.bfloat16()}, {3: w_down.bfloat16()})
    server = ExpertServer(part, 0, shape, inbox, [replica], [3], "cpu")
    local = LocalExperts(ExpertPart(list(range(E)), E, {3: w_gate_up.bfloat16()},
                                    {3: w_down.bfloat16()}))
    norm = torch.rand(D) + 0.5
    g = torch.Generator().manual_seed(7)
    for num_tokens in (1, 5, 16):
        x = torch.randn(num_tokens, D, generator=g).bfloat16()
        h = torch.randn(num_tokens, D, generator=g).bfloat16()
        topk_ids = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :K]
        weights = torch.rand(num_tokens, K, generator=g).softmax(dim=1)
        owners = torch.zeros_like(topk_ids)
        assert pack(inbox.slot(0), 1, x, topk_ids, owners, 0, True, weights) is None
        server._tick(3, 1, shape.capacity, use_flags=False)
        got = gather(replica, 1, owners, None)  # [T, 1, D] float32
        unit = torch.ones(num_tokens, 1)
        want = local.dispatch(3, 1, x, topk_ids)  # [T, k, D]
        assert got.shape == (num_tokens, 1, D) and got.dtype == torch.float32
        assert torch.equal(kernels.combine(got, unit), kernels.combine(want, weights))
        assert torch.equal(kernels.combine_residual(got, unit, h),
                           kernels.combine_residual(want, weights, h))
        for a, b in zip(kernels.combine_residual(got, unit, h, norm, 1e-6),
                        kernels.combine_residual(want, weights, h, norm, 1e-6)):
            assert torch.equal(a, b), num_tokens


def test_replicas_share_one_grouped_tick_bitwise() -> None:
    """Two replicas' rows of one tick go through one grouped GEMM on each expert worker
    (different token counts, a replica that sits the step out); every replica gets exactly
    what its own LocalExperts give, and the idle replica's outputs are never written."""
    full, w_gate_up, w_down = _parts(2)
    placement = [[0, 5, 6], [1, 2, 3, 4, 7]]
    shape = PlaneShape(num_workers=2, microbatches=2, capacity=16, hidden=D, top_k=K,
                       num_experts=E, dtype=torch.float32, num_replicas=3)
    replicas = [ReplicaInbox(shape, "cpu") for _ in range(3)]
    for replica in replicas:
        replica.out.fill_(float("nan"))
    owner = torch.empty(E, dtype=torch.int64)
    servers = []
    for index, ids in enumerate(placement):
        owner[ids] = index
        inbox = ExpertInbox(shape, "cpu")
        inbox.rows.fill_(float("nan"))
        part = ExpertPart(ids, E, {3: w_gate_up[ids]}, {3: w_down[ids]})
        servers.append(ExpertServer(part, index, shape, inbox, replicas, [3], "cpu"))
    g = torch.Generator().manual_seed(3)
    want, packed = {}, {}
    for r, num_tokens in ((0, 13), (2, 4)):  # replica 1 takes no part
        x = torch.randn(num_tokens, D, generator=g)
        topk_ids = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :K]
        owners = owner[topk_ids]
        positions = [pack(s.inbox.slot(r), 0, x, topk_ids, owners, s.index, False)
                     for s in servers]
        packed[r] = (owners, torch.stack(positions))
        want[r] = LocalExperts(full).dispatch(3, 0, x, topk_ids)
    for server in servers:
        server._tick(3, 0, shape.capacity, use_flags=False, replicas=(0, 2))
    for r, (owners, positions) in packed.items():
        assert torch.equal(gather(replicas[r], 0, owners, positions), want[r]), r
    assert replicas[1].out.isnan().all()


def test_buffers_are_aligned_disjoint_views_of_one_allocation() -> None:
    shape = PlaneShape(num_workers=3, microbatches=2, capacity=10, hidden=24, top_k=4,
                       num_experts=16, dtype=torch.bfloat16, num_replicas=2)
    inbox = ExpertInbox(shape, "cpu")
    assert inbox.rows.shape == (2, 2, 11, 24) and inbox.ids.shape == (2, 2, 11, 4)
    assert inbox.counts.shape == (2, 2) and inbox.flags.shape == (2, 2)
    slot = inbox.slot(1)
    assert slot.rows.data_ptr() == inbox.rows[1].data_ptr() and slot.flags.shape == (2,)
    views = [inbox.rows, inbox.ids, inbox.weights, inbox.counts, inbox.flags]
    base = inbox.storage.data_ptr()
    spans = sorted((v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size())
                   for v in views)
    assert all(start % 256 == 0 for start, _ in spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= inbox.storage.numel()
    # A peer maps the same bytes: the same views over the shared storage.
    peer = ExpertInbox(shape, storage=inbox.storage)
    inbox.flags[1, 0] = 7
    assert int(peer.flags[1, 0]) == 7
    replica = ReplicaInbox(shape, "cpu")
    assert replica.out.shape == (2, 3, 10, 4, 24) and replica.flags.shape == (2, 3)


def test_plane_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="capacity"):
        PlaneShape(num_workers=1, microbatches=1, capacity=0, hidden=8, top_k=2,
                   num_experts=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="one expert worker"):  # order of the fp32 sums
        PlaneShape(num_workers=2, microbatches=1, capacity=4, hidden=8, top_k=2,
                   num_experts=4, dtype=torch.float32, reduce_on_workers=True)


def test_captured_sizes_split_evenly_into_microbatches() -> None:
    for m in (1, 2, 4):
        sizes = capture_sizes(256, m)
        assert sizes[-1] == 256 and all(s % m == 0 for s in sizes)
        assert sizes == sorted(set(sizes))
    assert capture_sizes(7, 4) == [4, 8]


def test_which_layouts_run_on_the_device_plane() -> None:
    cuda = dict(device="cuda", model="builtin:tiny-moe")
    assert device_plane_reason(EngineConfig(**cuda, disaggregate=True)) is None
    assert device_plane_reason(EngineConfig(**cuda, transport="cuda_ipc", expert_workers=2)) is None
    assert "CUDA" in device_plane_reason(EngineConfig(device="cpu", disaggregate=True))
    assert device_plane_reason(EngineConfig(**cuda, attention_replicas=2,
                                            transport="cuda_ipc")) is None
    assert "processes" in device_plane_reason(
        EngineConfig(**cuda, attention_replicas=2, disaggregate=True))
    assert device_plane_reason(EngineConfig(**cuda, transport="tcp", expert_workers=2)) is None
    # NCCL connects no two processes on one GPU: only with the experts on other GPUs.
    nccl = device_plane_reason(EngineConfig(**cuda, transport="nccl", expert_workers=2))
    assert (nccl is None) == (torch.cuda.device_count() > 1)
    assert not uses_device_plane(EngineConfig(**cuda))  # co-located stays co-located
    assert uses_device_plane(EngineConfig(**cuda, disaggregate=True))
    assert not uses_device_plane(EngineConfig(**cuda, disaggregate=True, data_plane="host"))
    assert not uses_device_plane(EngineConfig(device="cpu", disaggregate=True))
    with pytest.raises(ValueError, match="data_plane='device'"):
        uses_device_plane(EngineConfig(device="cpu", disaggregate=True, data_plane="device"))
    with pytest.raises(ValueError, match="data_plane"):
        EngineConfig(data_plane="gpu")


def test_step_barrier_starts_the_expert_step_once_every_participant_has_reported() -> None:
    """Lockstep of replicas: the graph step goes out once per global step, after the last
    participant, over the graph participants' largest row count; eager-only and idle
    replicas hold nobody up and are not part of it."""
    links = [ExpertLink(inbox=None, messages=queue.Queue()) for _ in range(2)]
    barrier = StepBarrier(links)

    def sent():
        return [[link.messages.get_nowait() for _ in range(link.messages.qsize())]
                for link in links]

    barrier.begin([0, 2, 3])
    barrier.report(0, 8)
    barrier.report(1, 64)  # not a participant of this step: ignored
    barrier.report(3, None)  # eager
    assert sent() == [[], []]
    barrier.report(2, 16)
    assert sent() == [[GraphStep(16, (0, 2))]] * 2
    barrier.report(2, 16)  # the front-end's end-of-step report after the graph's: no-op
    assert sent() == [[], []] and barrier.graph_steps == 1 and barrier.host_messages == 2
    barrier.begin([1])
    barrier.report(1, None)  # an eager step: its ticks are messages of their own
    assert sent() == [[], []] and barrier.graph_steps == 1


@pytest.mark.parametrize("placement", [[[0, 5, 6], [1, 2, 3, 4, 7]], [list(range(E))]])
def test_relayed_links_carry_dispatch_and_combine_bitwise(placement) -> None:
    """The data plane over host-proxied links (tcp between hosts; here two tcp endpoints of
    this process): the replica's DeviceExperts packs into local copies of the workers'
    slots and puts them in mailboxes; each expert worker's ExpertServer takes them on its
    Tick, computes and puts the combine back; combine takes it. Bitwise LocalExperts, with
    two micro-batches in flight; one worker pre-reduces (its combined rows, added with
    unit weight, are bitwise the attention side's combine of the k rows)."""
    import threading

    from megaserve import kernels

    full, w_gate_up, w_down = _parts(4)
    workers, m = len(placement), 2
    reduce = workers == 1
    shape = PlaneShape(num_workers=workers, microbatches=m, capacity=16, hidden=D, top_k=K,
                       num_experts=E, dtype=torch.float32, reduce_on_workers=reduce)
    dispatch, combine = RelaySlots.layouts(shape)
    endpoints = [create_endpoint("tcp", rank, 1 + workers) for rank in range(1 + workers)]
    addresses = [ep.address for ep in endpoints]
    connect = [threading.Thread(target=ep.connect,
                                args=(addresses, [0] if r else list(range(1, 1 + workers))))
               for r, ep in enumerate(endpoints)]
    for t in connect:
        t.start()
    for t in connect:
        t.join(30)
    front = RelaySlots(Mailboxes(dispatch, workers * m), Mailboxes(combine, workers * m), m)
    relays = [Relay(endpoints[0], front.outgoing,
                    [Route(local=e * m + i, dst=1 + e, remote=i)
                     for e in range(workers) for i in range(m)], front.incoming)]
    owner = torch.empty(E, dtype=torch.int64)
    links, threads = [], []
    for e, ids in enumerate(placement):
        owner[ids] = e
        slots = RelaySlots(Mailboxes(combine, m), Mailboxes(dispatch, m), m)
        relays.append(Relay(endpoints[1 + e], slots.outgoing,
                            [Route(local=i, dst=0, remote=e * m + i) for i in range(m)],
                            slots.incoming))
        part = ExpertPart(ids, E, {3: w_gate_up[ids]}, {3: w_down[ids]})
        server = ExpertServer(part, e, shape, ExpertInbox(shape, "cpu"),
                              [ReplicaInbox(shape, "cpu")], [3], "cpu", relay=slots)
        messages: queue.Queue = queue.Queue()

        def serve(server=server, messages=messages):
            while (tick := messages.get()) is not None:
                assert isinstance(tick, Tick) and tick.event is None
                server._tick(tick.layer, tick.microbatch, tick.rows, use_flags=True,
                             replicas=(tick.replica,))

        threads.append(threading.Thread(target=serve, daemon=True))
        threads[-1].start()
        links.append(ExpertLink(ExpertInbox(shape, "cpu"), messages))
    replica = ReplicaInbox(shape, "cpu")
    replica.out.fill_(float("nan"))
    client = DeviceExperts(shape, links, replica, owner, relay=front)
    local = LocalExperts(full)
    g = torch.Generator().manual_seed(5)
    try:
        for step, num_tokens in enumerate((3, 16, 9, 1)):
            batches = []
            for i in range(m):  # both micro-batches dispatched before either is combined
                x = torch.randn(num_tokens, D, generator=g)
                topk_ids = torch.rand(num_tokens, E, generator=g).argsort(dim=1)[:, :K]
                weights = torch.rand(num_tokens, K, generator=g).softmax(dim=1)
                batches.append((x, topk_ids, weights,
                                client.dispatch(3, i, x, topk_ids, weights)))
            for i, (x, topk_ids, weights, handle) in enumerate(batches):
                got, want = client.combine(handle), local.dispatch(3, i, x, topk_ids)
                if reduce:
                    got = kernels.combine(got, torch.ones(num_tokens, 1))
                    want = kernels.combine(want, weights)
                assert torch.equal(got, want), (step, i)
        assert client.stats.eager_ticks == 4 * m * workers
        assert relays[0].frames_sent == relays[0].frames_received == 4 * m * workers
        assert all(r.error is None for r in relays)
    finally:
        for link in links:
            link.messages.put(None)
        for relay in relays:
            relay.close()
        for ep in endpoints:
            ep.close()


def test_bench_layout_specs_carry_async_and_environment() -> None:
    """bench device-plane's A/B rows: a layout spec sets its own async scheduling and
    environment (what its expert processes start with); malformed specs are refused."""
    from megaserve.bench.device_plane import _parse_layout

    plain = _parse_layout("cuda_ipc:1", False)
    assert (plain.transport, plain.m, plain.replicas, plain.async_scheduling, plain.env) == (
        "cuda_ipc", 1, 1, False, {})
    ab = _parse_layout("cuda_ipc:2:3+async@MEGASERVE_PLANE_KERNEL_WAIT=0", False)
    assert (ab.m, ab.replicas, ab.async_scheduling) == (2, 3, True)
    assert ab.env == {"MEGASERVE_PLANE_KERNEL_WAIT": "0"}
    assert "R=3" in ab.name and "async" in ab.name and "PLANE_KERNEL_WAIT=0" in ab.name
    colocated = _parse_layout("colocated:1", True)
    assert colocated.transport is None and colocated.async_scheduling
    for bad in ("cuda_ipc", "cuda_ipc:x", "cuda_ipc:1@NOVALUE", "cuda_ipc:1:2:3"):
        with pytest.raises(ValueError):
            _parse_layout(bad, False)

"""The device data plane's exchange kernels (kernels/triton_impl/plane_pack.py) under the
Triton interpreter (CPU, CI): pack_rows, route_rows, copy_routed, gather_routed, local_ids
and combine_into.

Each is checked against the torch operations it replaces in the data plane (the CPU path
of megaserve.runtime.device_plane: copies, a masked lookup, kernels.combine) and, where it
computes, a float64 reference; slots start poisoned (NaN, or a sentinel integer) so a
store outside the contract shows; row subsets give the same bits (torch.equal). The same
checks run on a GPU in bfloat16 in tests/kernels/test_plane_gpu.py (the interpreter
mis-reads bfloat16 loads: here float32 and float16). TRITON_INTERPRET=1 must be set before
kernels are defined, so the checks run in a child process (this file run as a script).
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support

CHECKS = ["pack_rows", "route_rows", "copy_routed", "gather_routed", "local_ids", "combine_into",
          "bad_input"]
POISON_ID = -7  # an int32 no pack writes


def _bits(torch, t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def check_pack_rows(torch, ti, device="cpu", dtypes=None, shapes=None) -> None:
    """Rows, int32 ids, weights and the count of every token; rows past T untouched."""
    from megaserve.kernels.triton_impl import plane_pack

    dtypes = dtypes or [torch.float32, torch.float16]
    for dtype in dtypes:
        for t, d, k, slots in shapes or [(5, 40, 8, 9), (1, 64, 2, 1), (13, 1500, 3, 16)]:
            for with_weights in (True, False):
                x = torch.randn(t, d, device=device).to(dtype)
                topk_ids = torch.randint(0, 128, (t, k), device=device)
                topk_w = torch.rand(t, k, device=device)
                rows = torch.full((slots + 1, d), float("nan"), device=device).to(dtype)
                ids = torch.full((slots + 1, k), POISON_ID, dtype=torch.int32, device=device)
                weights = torch.full((slots + 1, k), float("nan"), device=device)
                count = torch.full((1,), POISON_ID, dtype=torch.int32, device=device)
                plane_pack.pack_rows(x, topk_ids, topk_w if with_weights else None, rows, ids,
                                     weights, count)
                assert int(count) == t, f"count {int(count)} != {t}"
                assert torch.equal(_bits(torch, rows[:t]), _bits(torch, x)), "rows differ"
                assert torch.isnan(rows[t:].float()).all(), "rows past T were written"
                assert torch.equal(ids[:t], topk_ids.to(torch.int32)), "ids differ"
                assert (ids[t:] == POISON_ID).all(), "ids past T were written"
                if with_weights:
                    assert torch.equal(weights[:t], topk_w), "weights differ"
                    assert torch.isnan(weights[t:]).all(), "weights past T were written"
                else:
                    assert torch.isnan(weights).all(), "weights written without topk_weights"


def _route_ref(torch, x, topk_ids, owner, worker, slots):
    """The data plane's torch path (megaserve.runtime.device_plane.pack for several
    workers, run on the CPU): rows, ids, count and positions, the dump row dropped."""
    from megaserve.runtime.device_plane import InboxSlot, pack

    t, d = x.shape
    k = topk_ids.shape[1]
    slot = InboxSlot(rows=torch.zeros(1, slots + 1, d, dtype=x.dtype),
                     ids=torch.zeros(1, slots + 1, k, dtype=torch.int32),
                     counts=torch.zeros(1, dtype=torch.int32),
                     flags=torch.zeros(1, dtype=torch.int32),
                     weights=torch.zeros(1, slots + 1, k))
    ids_cpu = topk_ids.cpu()
    pos = pack(slot, 0, x.cpu(), ids_cpu, owner.cpu()[ids_cpu], worker, False)
    return (slot.rows[0].to(x.device), slot.ids[0].to(x.device), int(slot.counts[0]),
            pos.to(x.device))


def check_route_rows(torch, ti, device="cpu", dtypes=None, shapes=None) -> None:
    """Each worker's rows, ids, count and positions equal the torch path's; slot rows past
    the count and every row of a token the worker does not need stay poisoned; a prefix of
    the tokens gives the same rows (row invariance)."""
    from megaserve.kernels.triton_impl import plane_pack

    for dtype in dtypes or [torch.float32, torch.float16]:
        for t, d, k, experts, workers in shapes or [(5, 40, 8, 16, 2), (1, 64, 2, 4, 2),
                                                     (37, 600, 8, 128, 3), (16, 8, 1, 8, 2)]:
            x = torch.randn(t, d, device=device).to(dtype)
            topk_ids = torch.stack([torch.randperm(experts)[:k] for _ in range(t)]).to(device)
            owner = (torch.arange(experts) * workers // experts).to(device)
            for worker in range(workers):
                rows = torch.full((t + 1, d), float("nan"), device=device).to(dtype)
                ids = torch.full((t + 1, k), POISON_ID, dtype=torch.int32, device=device)
                count = torch.full((1,), POISON_ID, dtype=torch.int32, device=device)
                pos = plane_pack.route_rows(x, topk_ids, owner, worker, rows, ids, count)
                ref_rows, ref_ids, ref_count, ref_pos = _route_ref(torch, x, topk_ids, owner,
                                                                   worker, t)
                n = ref_count
                assert int(count) == n, f"count {int(count)} != {n}"
                assert torch.equal(pos, ref_pos), f"positions differ: {pos} vs {ref_pos}"
                assert torch.equal(_bits(torch, rows[:n]), _bits(torch, ref_rows[:n])), \
                    "rows differ"
                assert torch.isnan(rows[n:].float()).all(), "rows past the count were written"
                assert torch.equal(ids[:n], ref_ids[:n]), "ids differ"
                assert (ids[n:] == POISON_ID).all(), "ids past the count were written"
                if t > 1:
                    head = torch.full((t, d), float("nan"), device=device).to(dtype)
                    head_ids = torch.full((t, k), POISON_ID, dtype=torch.int32, device=device)
                    plane_pack.route_rows(x[:-1], topk_ids[:-1], owner, worker, head,
                                          head_ids, count)
                    m = int(count)
                    assert torch.equal(_bits(torch, head[:m]), _bits(torch, rows[:m])), \
                        "a prefix of the tokens routes differently"


def check_copy_routed(torch, ti, device="cpu", dtypes=None, shapes=None) -> None:
    """Exactly the entries with a local expert are copied, bitwise, into a strided slice of
    a larger buffer (the replica's inbox); everything else stays poisoned."""
    from megaserve.kernels.triton_impl import plane_pack

    for dtype in dtypes or [torch.float32, torch.float16]:
        for c, k, d in shapes or [(6, 8, 40), (1, 2, 2048), (9, 3, 1100)]:
            src = torch.randn(c, k, d, device=device).to(dtype)
            sentinel = 5
            local = torch.randint(0, sentinel + 1, (c * k,), device=device)
            inbox = torch.full((2, c + 3, k, d), float("nan"), device=device).to(dtype)
            dst = inbox[1, :c]
            plane_pack.copy_routed(src, local, sentinel, dst)
            live = (local != sentinel).view(c, k)
            assert torch.equal(_bits(torch, dst[live]), _bits(torch, src[live])), "copies differ"
            assert torch.isnan(dst[~live].float()).all(), "an entry with no expert was written"
            outside = torch.cat([inbox[0].flatten(), inbox[1, c:].flatten()])
            assert torch.isnan(outside.float()).all(), "copy_routed wrote outside its rows"


def check_gather_routed(torch, ti, device="cpu", dtypes=None, shapes=None) -> None:
    """Bitwise the data plane's torch gather (megaserve.runtime.device_plane.gather for
    several workers, run on the CPU) for random owners and slot rows; a prefix of the
    tokens gives the same rows."""
    from types import SimpleNamespace

    from megaserve.kernels.triton_impl import plane_pack
    from megaserve.runtime.device_plane import gather

    for dtype in dtypes or [torch.float32, torch.float16]:
        for t, e, cap, k, d in shapes or [(5, 2, 7, 8, 40), (1, 3, 2, 2, 64),
                                          (23, 2, 30, 3, 1100)]:
            out = torch.randn(1, e, cap, k, d, device=device).to(dtype)  # [m, E, C, k, D]
            owners = torch.randint(0, e, (t, k), device=device)
            positions = torch.randint(0, cap, (e, t), device=device)

            ref = gather(SimpleNamespace(out=out.cpu()), 0, owners.cpu(),
                         positions.cpu()).to(device)
            got = plane_pack.gather_routed(out[0], owners, positions)
            assert got.shape == (t, k, d) and got.dtype == dtype
            assert torch.equal(_bits(torch, got), _bits(torch, ref)), "rows differ"
            if t > 1:
                head = plane_pack.gather_routed(out[0], owners[:-1], positions[:, :-1])
                assert torch.equal(_bits(torch, head), _bits(torch, got[:-1])), \
                    "a prefix of the tokens gathers differently"


def _local_ids_ref(torch, ids, counts, replicas, lookup, rows):
    """The data plane's CPU path: mask rows past the count, look every id up."""
    counts = counts[replicas]
    valid = torch.arange(rows, device=ids.device)[None, :] < counts[:, None]
    masked = torch.where(valid[..., None], ids[replicas, :rows], -1)
    return lookup[masked.long()].reshape(-1)


def check_local_ids(torch, ti, device="cpu", shapes=None) -> None:
    """Equal to the masked lookup for every replica subset and row count; a subset of the
    replicas gives that subset's rows of the full call (row invariance)."""
    from megaserve.kernels.triton_impl import plane_pack

    for r, s, k, num_experts, mine in shapes or [(1, 7, 8, 16, 5), (3, 300, 8, 128, 40),
                                                  (2, 5, 1, 4, 4)]:
        ids = torch.randint(-1, num_experts, (r, s, k), dtype=torch.int32, device=device)
        counts = torch.randint(0, s + 1, (r,), dtype=torch.int32, device=device)
        experts = torch.randperm(num_experts)[:mine].sort().values
        lookup = torch.full((num_experts + 1,), mine, dtype=torch.int64)
        lookup[experts] = torch.arange(mine)
        lookup = lookup.to(device)
        full = list(range(r))
        for replicas in (full, full[::-1], full[-1:]):
            sel = torch.tensor(replicas, dtype=torch.int64, device=device)
            for rows in (s, max(1, s // 2), 0):
                got = plane_pack.local_ids(ids, counts, sel, lookup, rows)
                ref = _local_ids_ref(torch, ids, counts, sel, lookup, rows)
                assert got.dtype == torch.int64 and torch.equal(got, ref), \
                    f"local_ids differ: replicas {replicas}, rows {rows}"
        sel = torch.arange(r, dtype=torch.int64, device=device)
        whole = plane_pack.local_ids(ids, counts, sel, lookup, s).view(r, s * k)
        # waiting on raised flags (SET, or ABORT) clears exactly the tick's replicas'
        flags = torch.tensor([1, 2, 1][:r], dtype=torch.int32, device=device)
        waited = plane_pack.local_ids(ids, counts, sel[-1:], lookup, s, flags)
        assert torch.equal(waited, whole[-1]), "the waiting kernel's ids differ"
        assert flags.tolist() == [1, 2, 1][:r - 1] + [0], f"flags after the wait: {flags}"
        waited = plane_pack.local_ids(ids, counts, sel, lookup, s, flags.fill_(1))
        assert torch.equal(waited, whole.reshape(-1)), "the waiting kernel's ids differ"
        assert not flags.any(), f"flags after waiting for every replica: {flags}"
        for p in range(r):
            one = plane_pack.local_ids(ids, counts, sel[p: p + 1], lookup, s)
            assert torch.equal(one, whole[p]), f"replica {p} alone differs from the batch"


def check_combine_into(torch, ti, device="cpu", dtypes=None, shapes=None) -> None:
    """Bitwise kernels.combine, within the float64 reference's tolerance, into a strided
    slice of a larger buffer (the replica's inbox), nothing else written."""
    from megaserve.kernels.triton_impl import plane_pack

    for dtype in dtypes or [torch.float32, torch.float16]:
        for t, k, d in shapes or [(6, 8, 40), (1, 2, 2048), (9, 3, 1100)]:
            eo = torch.randn(t, k, d, device=device).to(dtype)
            w = torch.rand(t, k, device=device)
            inbox = torch.full((2, t + 3, 1, d), float("nan"), device=device)
            out = inbox[1, :t, 0]
            plane_pack.combine_into(eo, w, out)
            assert torch.equal(_bits(torch, out), _bits(torch, ti.combine(eo, w))), \
                f"{dtype} {t}x{k}x{d}: differs from kernels.combine"
            ref = (eo.double() * w.double()[..., None]).sum(1)
            err = float((out.double() - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, f"{dtype} {t}x{k}x{d}: error {err}"
            assert torch.isnan(inbox[0]).all() and torch.isnan(inbox[1, t:]).all(), \
                "combine_into wrote outside its rows"
            if t > 1:
                sub = torch.full((t - 1, d), float("nan"), device=device)
                plane_pack.combine_into(eo[1:], w[1:], sub)
                assert torch.equal(_bits(torch, sub), _bits(torch, out[1:])), "not row-invariant"


def check_bad_input(torch, ti, device="cpu") -> None:
    """Shapes and dtypes that do not fit are refused with ValueError."""
    from megaserve.kernels.triton_impl import plane_pack

    x = torch.randn(4, 8, device=device)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=device)
    rows = torch.empty(3, 8, device=device)  # too few rows
    slot_ids = torch.empty(5, 2, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    cases = [
        lambda: plane_pack.pack_rows(x, ids, None, rows, slot_ids, None, count),
        lambda: plane_pack.pack_rows(x, ids, None, torch.empty(5, 8, device=device),
                                     slot_ids.long(), None, count),
        lambda: plane_pack.local_ids(slot_ids[None], torch.zeros(1, dtype=torch.int32),
                                     torch.zeros(1, dtype=torch.int64),
                                     torch.zeros(3, dtype=torch.int32), 2),
        lambda: plane_pack.combine_into(torch.randn(2, 2, 8), torch.rand(2, 2),
                                        torch.empty(2, 8, dtype=torch.float16)),
        lambda: plane_pack.route_rows(x, ids, torch.zeros(4, dtype=torch.int64, device=device),
                                      0, rows, slot_ids, count),  # too few rows
        lambda: plane_pack.route_rows(x, ids.int(), torch.zeros(4, dtype=torch.int64,
                                      device=device), 0, torch.empty(5, 8, device=device),
                                      slot_ids, count),  # int32 topk ids
        lambda: plane_pack.gather_routed(torch.randn(2, 3, 2, 8, device=device),
                                         torch.zeros(4, 2, dtype=torch.int32, device=device),
                                         torch.zeros(2, 4, dtype=torch.int64, device=device)),
        lambda: plane_pack.copy_routed(torch.randn(2, 2, 8, device=device),
                                       torch.zeros(3, dtype=torch.int64, device=device), 1,
                                       torch.empty(2, 2, 8, device=device)),
    ]
    for i, case in enumerate(cases):
        try:
            case()
        except ValueError:
            continue
        raise AssertionError(f"bad input {i} was accepted")


def _child() -> None:
    interp_support.install()  # scalar kernel arguments as loop bounds (numpy >= 2.4)
    interp_support.run_checks(globals(), CHECKS)


interp_results = interp_support.results_fixture(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_plane_kernel_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    interp_support.assert_check_passed(interp_results, name)


def _compile_sm90(fn, pointers: dict, ints: list[str], ones: list[str], constexprs: dict):
    """Compile ``fn`` for sm_90 with Triton's bundled ptxas (no GPU), the ``ones``
    arguments specialised to the constant 1 as the JIT does when a launch passes 1."""
    from megaserve.kernels.triton_impl.sm90 import compile_sm90

    compile_sm90(fn, {**pointers, **{n: 1 if n in ones else "i32" for n in ints}}, constexprs)


@pytest.mark.parametrize("variant", [True, False])
def test_plane_kernels_compile_for_sm90(variant: bool) -> None:
    """The interpreter runs what the compiler refuses (an integer argument the JIT turns
    into the constant 1, a loop variable reused with another type): every kernel compiles
    for an H100/H200 with its integer arguments as they come, and with the ones a batch of
    one token or one replica makes 1, with and without its optional part."""
    from megaserve.kernels.triton_impl import plane_pack as pp

    ints = ["T", "D", "stride_x", "stride_ids", "stride_w", "stride_rows", "stride_sids",
            "stride_sw"]
    pointers = dict(x_ptr="*bf16", ids_ptr="*i64", w_ptr="*fp32", rows_ptr="*bf16",
                    slot_ids_ptr="*i32", slot_w_ptr="*fp32", count_ptr="*i32")
    for ones in ([], ["T"], ints):
        _compile_sm90(pp._pack_kernel, pointers, ints, ones,
                      dict(TOP_K=8, KP=8, HAS_W=variant, BLOCK_D=1024))
    ints = ["T", "D", "WORKER", "stride_x", "stride_ids", "stride_rows", "stride_sids"]
    pointers = dict(x_ptr="*bf16", ids_ptr="*i64", owner_ptr="*i64", rows_ptr="*bf16",
                    slot_ids_ptr="*i32", count_ptr="*i32", pos_ptr="*i64")
    for ones in ([], ["T"], ["T", "WORKER"]):
        _compile_sm90(pp._route_kernel, pointers, ints, ones,
                      dict(TOP_K=8, KP=8, BLOCK_T=16, BLOCK_D=512))
    ints = ["N", "D", "SENTINEL", "stride_src", "stride_dst"]
    pointers = dict(src_ptr="*bf16", local_ptr="*i64", dst_ptr="*bf16")
    for ones in ([], ["N", "SENTINEL"]):
        _compile_sm90(pp._copy_routed_kernel, pointers, ints, ones,
                      dict(BLOCK_N=4, BLOCK_D=1024))
    ints = ["N", "D", "TOP_K", "stride_pe", "stride_we", "stride_wr"]
    pointers = dict(out_ptr="*bf16", owners_ptr="*i64", pos_ptr="*i64", dst_ptr="*bf16")
    for ones in ([], ["N"], ["N", "TOP_K"]):
        _compile_sm90(pp._gather_routed_kernel, pointers, ints, ones,
                      dict(BLOCK_N=4, BLOCK_D=1024))
    ints = ["P", "C", "stride_ir", "stride_it", "stride_cr", "stride_fr", "SENTINEL"]
    pointers = dict(ids_ptr="*i32", counts_ptr="*i32", replica_ptr="*i64", lookup_ptr="*i64",
                    out_ptr="*i64", flag_ptr="*i32")
    for ones in ([], ["P"], ["P", "C", "stride_cr", "stride_fr"]):
        _compile_sm90(pp._local_ids_kernel, pointers, ints, ones,
                      dict(TOP_K=8, BLOCK=1024, WAIT=variant))


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

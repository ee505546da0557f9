"""The MLA Triton kernel (kernels/triton_impl/mla.py) under the Triton interpreter (CPU,
CI): values against a float64 reference, and a token's bits alone, in a batch, in prefill
chunks of any size and as a decode token. Also on CPU: the CPU path of
``kernels.mla_attention`` against the same reference."""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support
from tests.kernels.poison import poisoned_empty

CHECKS = ["mla", "router", "head_linear"]
RANK, ROPE, HEADS, BLOCK = 64, 16, 20, 16  # 20 heads: a partial head block


def _case(torch, lens, dtype):
    """A paged latent cache holding ``lens`` tokens per sequence (blocks shuffled)."""
    total_blocks = sum(-(-n // BLOCK) for n in lens) + 3
    cache = torch.randn(total_blocks, BLOCK, 1, RANK + ROPE).to(dtype)
    perm = torch.randperm(total_blocks).tolist()
    width = max(-(-n // BLOCK) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // BLOCK)):
            tables[s, b] = perm.pop()
    return cache, tables


def _reference(torch, q, cache, tables, lens, queries, scale):
    """float64 attention of each query token over keys 0..its position."""
    out, t = [], 0
    for s, (n, k) in enumerate(zip(lens, queries)):
        rows = torch.stack([cache[int(tables[s, j // BLOCK]), j % BLOCK, 0] for j in range(n)]).double()
        for i in range(k):
            pos = n - k + i
            sc = (q[t].double() @ rows[: pos + 1].T) * scale  # [H, pos + 1]
            out.append(torch.softmax(sc, -1) @ rows[: pos + 1, :RANK])
            t += 1
    return torch.stack(out)


def _run(torch, ti, q, cache, tables, lens, queries, scale):
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32)
    return ti.mla.mla_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts,
                                RANK, scale)


def check_mla(torch, ti) -> None:
    import megaserve.kernels.triton_impl.mla  # noqa: F401  (ti.mla)

    scale = 0.1
    lens, queries = [5, 70, 1, 33], [5, 3, 1, 33]  # prefills, a chunk, a decode token
    for dtype in (torch.float32, torch.float16):
        cache, tables = _case(torch, lens, dtype)
        q = torch.randn(sum(queries), HEADS, RANK + ROPE).to(dtype)
        with poisoned_empty():
            full = _run(torch, ti, q, cache, tables, lens, queries, scale)
        assert not full.isnan().any(), "unwritten output"
        ref = _reference(torch, q, cache, tables, lens, queries, scale)
        err = float((full.double() - ref).abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), f"{dtype}: max error {err}"
        # sequence 1's last token alone, as a decode step (one query of its sequence)
        alone = _run(torch, ti, q[7:8], cache, tables[1:2], [70], [1], scale)
        assert torch.equal(alone[0], full[7]), "decode token != same token in a batch"
        # sequence 3 as prefill chunks 20 + 13 (context grows with each chunk)
        first = _run(torch, ti, q[9:29], cache, tables[3:4], [20], [20], scale)
        second = _run(torch, ti, q[29:42], cache, tables[3:4], [33], [13], scale)
        assert torch.equal(torch.cat([first, second]), full[9:42]), "chunked prefill differs"


def check_router(torch, ti) -> None:
    """The float32 router GEMM: values against float64, each row's bits alone and in any
    batch (M 1..70, ragged E and D tiles), from bf16 and float32 rows."""
    from megaserve.kernels.triton_impl.mla_router import router_logits

    torch.manual_seed(3)
    w = torch.randn(40, 100)  # 40 experts: a partial column tile; D 100: a partial K step
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(70, 100).to(dtype)
        with poisoned_empty():
            full = router_logits(x, w)
        ref = x.double() @ w.double().T
        bound = x.double().abs() @ w.double().abs().T
        assert bool(((full.double() - ref).abs() <= bound * 2**-20).all()), f"values {dtype}"
        for m in (1, 3, 16, 17, 69):
            assert torch.equal(router_logits(x[:m], w), full[:m]), f"M={m} {dtype}"
        assert torch.equal(router_logits(x[33:34], w)[0], full[33]), "row alone"
    try:
        router_logits(x, w.bfloat16())
    except ValueError as e:
        assert "float32" in str(e)
    else:
        raise AssertionError("a bf16 router weight was accepted")


def check_head_linear(torch, ti) -> None:
    """MLA's per-head linear (absorbed W_UK / W_UV) in one launch: values against float64,
    a token's bits alone and in any batch (T 1..70, ragged N and K tiles), from a strided
    view (q_nope inside q) as from a contiguous copy, and a clear error on bad weights."""
    from megaserve.kernels.triton_impl.mla import per_head_linear

    torch.manual_seed(4)
    heads, n, k = 3, 70, 80
    for dtype in (torch.float16, torch.float32):  # (interp_support's dot has no bf16)
        w = torch.randn(heads, n, k).to(dtype)
        q = torch.randn(70, heads, k + 16).to(dtype)
        x = q[..., :k]  # strided, as q_nope inside q
        with poisoned_empty():
            full = per_head_linear(x, w)
        ref = torch.einsum("thk,hnk->thn", x.double(), w.double())
        bound = torch.einsum("thk,hnk->thn", x.double().abs(), w.double().abs())
        tol = 2**-10 if dtype == torch.float16 else 2**-20  # output rounding to x.dtype
        assert bool(((full.double() - ref).abs() <= bound * tol).all()), f"values {dtype}"
        assert torch.equal(per_head_linear(x.contiguous(), w), full), f"contiguous {dtype}"
        for t in (1, 5, 64, 65):
            assert torch.equal(per_head_linear(x[:t], w), full[:t]), f"T={t} {dtype}"
    try:
        per_head_linear(x, w[:, :, :-1])
    except ValueError as e:
        assert "per_head_linear" in str(e)
    else:
        raise AssertionError("mismatched weights were accepted")


def _child() -> None:
    interp_support.install()
    interp_support.run_checks(globals(), CHECKS)


interp_results = interp_support.results_fixture(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_mla_kernel_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    interp_support.assert_check_passed(interp_results, name)


def test_mla_attention_cpu_path_matches_float64():
    import torch

    from megaserve import kernels

    torch.manual_seed(0)
    lens, queries = [5, 40, 9], [5, 1, 4]
    cache, tables = _case(torch, lens, torch.float32)
    q = torch.randn(sum(queries), HEADS, RANK + ROPE)
    starts = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    out = kernels.mla_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32), starts,
                                RANK, 0.1)
    ref = _reference(torch, q, cache, tables, lens, queries, 0.1)
    assert float((out.double() - ref).abs().max()) < 1e-5


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

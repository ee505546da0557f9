"""The MLA Triton kernel on a CUDA GPU at DeepSeek-V3's dims (kv_lora_rank 512, rope 64,
128 heads): float64 reference, and a token's bits alone, in a batch, in prefill chunks and
as a decode token."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
RANK, ROPE, HEADS, BLOCK = 512, 64, 128, 16


def _run(q, cache, tables, lens, queries, scale):
    from megaserve.kernels import mla_attention

    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")
    return mla_attention(q, cache, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                         starts, RANK, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_kernel_values_and_invariance(dtype):
    torch.manual_seed(0)
    lens, queries = [300, 1000, 1, 77], [300, 1, 1, 20]
    blocks = sum(-(-n // BLOCK) for n in lens)
    cache = torch.randn(blocks, BLOCK, 1, RANK + ROPE, device="cuda").to(dtype)
    perm = torch.randperm(blocks).tolist()
    tables = torch.zeros(len(lens), max(-(-n // BLOCK) for n in lens), dtype=torch.int32)
    for s, n in enumerate(lens):
        for b in range(-(-n // BLOCK)):
            tables[s, b] = perm.pop()
    tables = tables.cuda()
    q = (torch.randn(sum(queries), HEADS, RANK + ROPE, device="cuda") * 0.05).to(dtype)
    scale = 192 ** -0.5
    full = _run(q, cache, tables, lens, queries, scale)
    # float64 reference for sequence 1's decode token and sequence 3's last chunk token
    for t, s, pos in ((300, 1, 999), (321, 3, 76)):
        rows = torch.stack([cache[int(tables[s, j // BLOCK]), j % BLOCK, 0] for j in range(pos + 1)]).double()
        ref = torch.softmax((q[t].double() @ rows.T) * scale, -1) @ rows[:, :RANK]
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert float((full[t].double() - ref).abs().max()) < tol
    assert torch.equal(_run(q[300:301], cache, tables[1:2], [1000], [1], scale)[0], full[300])
    first = _run(q[:128], cache, tables[:1], [128], [128], scale)
    second = _run(q[128:300], cache, tables[:1], [300], [172], scale)
    assert torch.equal(torch.cat([first, second]), full[:300])


def test_router_logits_match_float64_and_are_batch_invariant():
    """DeepSeek-V3's float32 router GEMM (7168 -> 256) at M in 1..4096: within float32
    rounding of the float64 product, and every row's bits the same at every M."""
    from megaserve.kernels import router_logits

    torch.manual_seed(2)
    w = torch.randn(256, 7168, device="cuda") * 0.02
    x = torch.randn(4096, 7168, device="cuda").bfloat16()
    full = router_logits(x, w)
    ref = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    assert bool(((full.double() - ref).abs() <= bound * 7168 * 2**-23).all())
    for m in (1, 7, 64, 255, 1000):
        assert torch.equal(router_logits(x[:m], w), full[:m]), f"M={m}"
    perm = torch.randperm(4096, device="cuda")
    assert torch.equal(router_logits(x[perm], w), full[perm])


def test_per_head_linear_matches_float64_and_is_batch_invariant():
    """MLA's absorbed W_UK (q_nope 128 -> latent 512) and W_UV (512 -> 128) per head, 128
    heads, in one launch: within bf16 rounding of float64, every token's bits the same at
    every T, from q_nope's strided view as from a copy."""
    from megaserve.kernels import per_head_linear

    torch.manual_seed(5)
    for n, k in ((512, 128), (128, 512)):
        w = (torch.randn(HEADS, n, k, device="cuda") * k ** -0.5).bfloat16()
        q = torch.randn(4096, HEADS, k + 64, device="cuda").bfloat16()
        x = q[..., :k]
        full = per_head_linear(x, w)
        ref = torch.einsum("thk,hnk->thn", x[:64].double(), w.double())
        bound = torch.einsum("thk,hnk->thn", x[:64].abs().double(), w.abs().double())
        assert bool(((full[:64].double() - ref).abs() <= bound * 2**-7).all()), f"{n}x{k}"
        assert torch.equal(per_head_linear(x.contiguous(), w), full)
        for t in (1, 3, 64, 65, 1000):
            assert torch.equal(per_head_linear(x[:t], w), full[:t]), f"T={t} {n}x{k}"

"""The compiled CPU kernels at the shapes where their tiling changes, in every ISA build this
CPU runs (baseline SSE2, AVX2, AVX-512: 4, 8 or 16 lanes, GEMM micro-kernels of other
heights and widths): within float32 rounding of a float64 reference, a row's bits the same
in a batch of any size, and the same bits in every build."""

from __future__ import annotations

import pytest
import torch

from megaserve.kernels import cpu, cpu_ext

from .test_cpu_batched_kernels import _attend
from .test_cpu_kernels import _paged_setup, rel_err

ISA_RANK = {"baseline": 0, "avx2": 1, "avx512": 2}
# Output widths around the vector widths, the panel (64 columns in the AVX-512 build, 16 in
# the others) and the 64-column block a micro-kernel for few rows spans (several panels:
# all of them, a partial last one, fewer left than it spans), reductions of odd lengths.
LINEAR_SHAPES = [(3, 5), (64, 40), (64, 60), (37, 100), (33, 136), (128, 200)]  # (K, N)
# Row counts covering every single-pass height (1..6 rows), the near-equal passes of more
# rows (7 = 4 + 3, 13 = 5 + 4 + 4, ...) and several 24-row blocks of a linear's tasks.
ROW_COUNTS = [1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 25, 31, 50]


def _builds() -> list[str]:
    here = ISA_RANK[cpu_ext.default_isa()]
    return [isa for isa, rank in ISA_RANK.items() if rank <= here]


@pytest.fixture
def each_build(monkeypatch):
    """Calls ``fn`` with every ISA build loaded in turn; returns ``{isa: fn()}``."""
    def run(fn):
        results = {}
        for isa in _builds():
            monkeypatch.setattr(cpu_ext, "_lib", cpu_ext.load(isa))
            cpu._PACKED.clear()
            results[isa] = fn()
        cpu._PACKED.clear()
        return results
    yield run
    cpu._PACKED.clear()


def _assert_same_in_every_build(results: dict) -> None:
    default = results[cpu_ext.default_isa()]
    for isa, got in results.items():
        for a, b in zip(got, default):
            assert torch.equal(a, b), f"{isa} build differs from {cpu_ext.default_isa()}"


@pytest.mark.parametrize("k, n", LINEAR_SHAPES)
def test_linear_every_tile_height_and_column_tail(k, n, each_build):
    g = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    rows = torch.randn(max(ROW_COUNTS), k, generator=g)
    want = rows.double() @ w.double().T + bias.double()

    def run():
        full = cpu.linear(rows, w, bias)
        assert rel_err(full, want) < 1e-5
        for m in ROW_COUNTS:  # the first m rows: each row's bits as in the full batch
            assert torch.equal(cpu.linear(rows[:m], w, bias), full[:m]), m
        last = cpu.linear(rows[-1:], w)  # no bias: the bias add is the kernel's last step
        assert torch.equal(last[0] + bias, full[-1])
        return [full]

    _assert_same_in_every_build(each_build(run))


@pytest.mark.parametrize("d, inter", [(40, 24), (64, 48), (96, 100), (300, 280)])
def test_expert_ffn_odd_widths(d, inter, each_build):
    """Hidden and intermediate widths that are not multiples of a panel or a vector, and
    (300, 280) wide enough for several column tasks of both GEMMs with a partial last one
    (256 gate/up and 128 output columns a task); experts loaded with 1..13 rows (every
    micro-kernel height) and with a block of EXPERT_ROW_TILE rows and 2 more."""
    g = torch.Generator().manual_seed(d + inter)
    e = 5
    w_gate_up = torch.randn(e, 2 * inter, d, generator=g) / 8
    w_down = torch.randn(e, d, inter, generator=g) / 8
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate([1, 4, 6, 13, 2 + cpu.EXPERT_ROW_TILE])])
    ids = ids[torch.randperm(len(ids), generator=g)]
    x = torch.randn(len(ids), d, generator=g)
    gu = torch.einsum("rd,rkd->rk", x.double(), w_gate_up[ids].double())
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    want = torch.einsum("ri,rdi->rd", act, w_down[ids].double())

    def run():
        out = cpu.expert_ffn(x, ids, w_gate_up, w_down)
        assert rel_err(out, want) < 1e-5
        for m in (1, 3, 7, 20):
            assert torch.equal(cpu.expert_ffn(x[:m], ids[:m], w_gate_up, w_down), out[:m]), m
        return [out]

    _assert_same_in_every_build(each_build(run))


@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_head_dims(head_dim, dtype, each_build):
    """Head dims of one to eight vectors of every width and one that is not a multiple of
    16 (24: the generic value sums; a vector transpose only where the lanes divide it);
    prefill of whole sequences, then each sequence's last token as a decode step."""
    heads = (8, 2)
    lengths = [1, 19, 70]
    k_cache, v_cache, tables = _paged_setup(lengths, dtype, heads=heads, head_dim=head_dim,
                                            poison=True)
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(sum(lengths), heads[0], head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]

    def run():
        full = _attend(q, k_cache, v_cache, tables, lengths, lengths, scale)
        s = len(lengths) - 1
        k = k_cache[tables[s].long()].reshape(-1, heads[1], head_dim)[:lengths[s]].double()
        v = v_cache[tables[s].long()].reshape(-1, heads[1], head_dim)[:lengths[s]].double()
        k, v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
        qs = q[offsets[s]:offsets[s + 1]].double()
        scores = torch.einsum("thd,lhd->thl", qs, k) * scale
        causal = torch.arange(lengths[s])[None, :] > torch.arange(lengths[s])[:, None]
        scores = scores.masked_fill(causal[:, None, :], float("-inf"))
        want = torch.einsum("thl,lhd->thd", torch.softmax(scores, -1), v)
        assert rel_err(full[offsets[s]:offsets[s + 1]], want) < (1e-5 if dtype == torch.float32 else 1e-2)
        last = [offsets[i + 1] - 1 for i in range(len(lengths))]
        decode = _attend(q[last], k_cache, v_cache, tables, lengths, [1] * len(lengths), scale)
        assert torch.equal(decode, full[last])
        return [full]

    _assert_same_in_every_build(each_build(run))

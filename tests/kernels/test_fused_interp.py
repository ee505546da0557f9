"""The fused decode-path kernels under the Triton interpreter (CPU, CI): rotary_and_cache
(per-head q/k RMSNorm + rotary + KV write), combine_residual (combine + residual + the
next input RMSNorm), and rms_norm's residual mode standing in for ``h + delta`` and a norm.

Each is checked against a float64 reference, with poisoned outputs and caches (NaN where
nothing may be written), for row invariance (torch.equal on row subsets) and bitwise
against the unfused composition it replaces (the kernels rms_norm, combine and
write_kv_cache with torch's elementwise ops). The same checks run on a GPU in
tests/kernels/test_fused_gpu.py, bfloat16 included (the interpreter mis-reads bfloat16
loads: here float32 and float16). TRITON_INTERPRET=1 must be set before kernels are
defined, so the checks run in a child process (this file run as a script).
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support
from tests.kernels.poison import poisoned_empty

CHECKS = ["rotary_and_cache", "combine_residual", "residual_rms_norm"]


def _rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _bits(torch, t):
    """``t``'s bit pattern (NaN-safe bitwise comparison)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _rotary_tables(torch, positions: int, dim: int, dtype, device):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _rotary_ref(torch, x, cos, sin, positions, w, eps):
    """float64 reference: x `[T, H, Dh]` (normed per head by ``w`` if given), rotated."""
    x = x.double()
    if w is not None:
        x = w.double() * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[positions][:, None].double() + rotated * sin[positions][:, None].double()


# rotary_and_cache launches (rows, warps, tiles[, tokens]: RotaryLaunch) beside the default:
# one row a program, a tail tile, several tiles a program, several rows a warp, a token's
# rows over programs; then tiles of tokens with all their heads: a token over 4 warps (the
# prefill default), 4 tokens a tile and 2 tiles a program (a tail), 2 tokens over 8 warps
# (heads padded to a row a warp)
ROTARY_LAUNCHES = [(1, 1, 1), (4, 4, 2), (16, 4, 1), (8, 2, 2), (1, 4, 1, 1), (1, 2, 2, 4),
                   (1, 8, 1, 2)]


def check_rotary_and_cache(torch, ti, device="cpu", dtypes=None, shapes=None,
                           t: int = 11, launches=None) -> None:
    """rotary_and_cache against the unfused kernels (bitwise) and a float64 reference, in
    its default launch, then in each of ``launches`` (default ROTARY_LAUNCHES; several rows
    a program only where the head has 64 columns or more) bitwise against the default, q
    and both caches."""
    from megaserve.kernels.cpu import composed_rotary_and_cache

    dtypes = dtypes or [torch.float32, torch.float16]
    # (Hq, Hkv, Dh): narrow heads, a padded head, 6 + 2 + 2 heads of 64 and 128
    shapes = shapes or [(4, 2, 16), (8, 2, 48), (2, 1, 64), (6, 2, 64), (6, 2, 128)]
    eps, bs = 1e-6, 4
    nb = t // bs + 3
    for dtype in dtypes:
        for hq, hkv, dh in shapes:
            for has_norm in (True, False):
                qkv = torch.randn(t, (hq + 2 * hkv) * dh, device=device).to(dtype)
                qkv[:, : (hq + hkv) * dh] *= 3  # an RMS away from 1: the norm matters
                positions = torch.randint(0, 300, (t,), device=device)
                cos, sin = _rotary_tables(torch, 300, dh, dtype, device)
                qn = (torch.rand(dh, device=device) + 0.5).to(dtype) if has_norm else None
                kn = (torch.rand(dh, device=device) + 0.5).to(dtype) if has_norm else None
                slots = torch.randperm(nb * bs, device=device)[:t]
                slots[[2, 7]] = -1  # padding tokens: nothing written
                shape = (nb, bs, hkv, dh)
                caches = [torch.full(shape, float("nan"), device=device, dtype=dtype)
                          for _ in range(4)]
                args = (qkv, positions, cos, sin, qn, kn, eps)
                with poisoned_empty():
                    q = ti.rotary_and_cache(*args, caches[0], caches[1], slots, hq)
                ref_q = composed_rotary_and_cache(ti.rms_norm, ti.write_kv_cache, *args,
                                                  caches[2], caches[3], slots, hq)
                what = f"{dtype} {(hq, hkv, dh)} norm={has_norm}"
                assert q.shape == (t, hq, dh) and not q.isnan().any(), f"{what}: q unwritten"
                assert torch.equal(q, ref_q), f"{what}: q differs from the unfused kernels"
                for c, ref_c in zip(caches[:2], caches[2:]):
                    assert torch.equal(_bits(torch, c), _bits(torch, ref_c)), \
                        f"{what}: cache differs from the unfused kernels"
                # float64 reference; the written slots only, padding rows left NaN
                x = qkv.view(t, hq + 2 * hkv, dh)
                live = slots >= 0
                ref = _rotary_ref(torch, x[:, :hq], cos, sin, positions, qn, eps)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                assert _rel_err(q, ref) < tol, f"{what}: q error {_rel_err(q, ref)}"
                k_ref = _rotary_ref(torch, x[:, hq : hq + hkv], cos, sin, positions, kn, eps)
                k_got = caches[0].view(-1, hkv, dh)[slots[live]]
                assert _rel_err(k_got, k_ref[live]) < tol, f"{what}: k error"
                v_got = caches[1].view(-1, hkv, dh)[slots[live]]
                assert torch.equal(v_got, x[live, hq + hkv :]), f"{what}: v not copied"
                written = torch.zeros(nb * bs, dtype=torch.bool, device=device)
                written[slots[live]] = True
                assert caches[0].view(nb * bs, -1)[~written].isnan().all(), \
                    f"{what}: a slot outside slot_mapping was written"
                # row invariance: a subset of the tokens alone gives the same bits
                for rows in (slice(3, 4), slice(5, 9)):
                    c2 = [torch.full(shape, float("nan"), device=device, dtype=dtype)
                          for _ in range(2)]
                    sub = ti.rotary_and_cache(qkv[rows], positions[rows], cos, sin, qn, kn,
                                              eps, *c2, slots[rows], hq)
                    assert torch.equal(sub, q[rows]), f"{what}: rows {rows} changed with T"
                # Under the interpreter (CPU) the launch sweep runs once a shape: launches
                # change the index logic, not the arithmetic of a dtype or of the norm.
                sweep = device != "cpu" or (dtype == dtypes[0] and has_norm)
                for spec in (ROTARY_LAUNCHES if launches is None else launches) if sweep else ():
                    launch = ti.attention.RotaryLaunch(*spec)
                    if not launch.one_row and dh <= 32:  # refused: a narrow head
                        continue
                    c2 = [torch.full(shape, float("nan"), device=device, dtype=dtype)
                          for _ in range(2)]
                    with poisoned_empty():
                        q2 = ti.rotary_and_cache(*args, *c2, slots, hq, launch=launch)
                    assert torch.equal(q2, q), f"{what}: q changed with the launch {launch}"
                    for c, c_default in zip(c2, caches[:2]):
                        assert torch.equal(_bits(torch, c), _bits(torch, c_default)), \
                            f"{what}: a cache changed with the launch {launch}"
    with pytest.raises(ValueError):  # odd head dim
        ti.rotary_and_cache(torch.zeros(1, 9, device=device), torch.zeros(1, dtype=torch.long,
                            device=device), cos, sin, None, None, eps,
                            torch.zeros(1, 1, 1, 3, device=device),
                            torch.zeros(1, 1, 1, 3, device=device),
                            torch.zeros(1, dtype=torch.long, device=device), 1)


def check_combine_residual(torch, ti, device="cpu", dtypes=None, shapes=None,
                           t: int = 9) -> None:
    dtypes = dtypes or [torch.float32, torch.float16]
    shapes = shapes or [(1, 40), (2, 200), (3, 64)]  # (k, D)
    eps = 1e-6
    for dtype in dtypes:
        for k, d in shapes:
            eo = torch.randn(t, k, d, device=device).to(dtype)
            wt = torch.rand(t, k, device=device)
            res = torch.randn(t, d, device=device).to(dtype)
            w = (torch.rand(d, device=device) + 0.5).to(dtype)
            what = f"{dtype} k={k} D={d}"
            with poisoned_empty():
                y, h = ti.combine_residual(eo, wt, res, w, eps)
                h_only = ti.combine_residual(eo, wt, res)
            assert not (y.isnan().any() or h.isnan().any()), f"{what}: output unwritten"
            h_ref = res + ti.combine(eo, wt).to(dtype)  # the unfused sequence
            assert torch.equal(h, h_ref) and torch.equal(h_only, h_ref), f"{what}: h differs"
            assert torch.equal(y, ti.rms_norm(h_ref, w, eps)), f"{what}: norm differs"
            hd = res.double() + (wt.double()[..., None] * eo.double()).sum(1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert _rel_err(h, hd) < tol, f"{what}: h error {_rel_err(h, hd)}"
            yd = w.double() * hd / torch.sqrt((hd * hd).mean(-1, keepdim=True) + eps)
            assert _rel_err(y, yd) < tol, f"{what}: norm error {_rel_err(y, yd)}"
            for rows in (slice(4, 5), slice(2, 7)):
                y1, h1 = ti.combine_residual(eo[rows], wt[rows], res[rows], w, eps)
                assert torch.equal(y1, y[rows]) and torch.equal(h1, h[rows]), \
                    f"{what}: rows {rows} changed with T"


def check_residual_rms_norm(torch, ti, device="cpu", dtypes=None, sizes=None,
                            t: int = 9) -> None:
    """rms_norm's residual mode is the add then the norm, bitwise: the model folds each
    ``h + delta`` into the norm that follows it."""
    dtypes = dtypes or [torch.float32, torch.float16]
    for dtype in dtypes:
        for d in sizes or (40, 64, 200):
            x = torch.randn(t, d, device=device).to(dtype)
            res = torch.randn(t, d, device=device).to(dtype)
            w = (torch.rand(d, device=device) + 0.5).to(dtype)
            y, h = ti.rms_norm(x, w, 1e-6, res)
            assert torch.equal(h, res + x), f"{dtype} D={d}: h differs from the add"
            assert torch.equal(y, ti.rms_norm(res + x, w, 1e-6)), f"{dtype} D={d}: norm differs"


def _child() -> None:
    interp_support.install()  # the interpreter's look-ups made cheap (same results)
    interp_support.run_checks(globals(), CHECKS)


interp_results = interp_support.results_fixture(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_fused_kernel_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    interp_support.assert_check_passed(interp_results, name)


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

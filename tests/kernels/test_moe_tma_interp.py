"""The expert GEMMs' TMA paths (kernels/triton_impl/moe.py) under the Triton interpreter
(CPU): every weight path gives the pointer path's bits.

TRITON_INTERPRET=1 must be set before kernels are defined, so the check runs in a child
process (this file run as a script; tests/kernels/interp_support.py). fp16: the
interpreter mis-reads bfloat16 through TMA descriptors.
"""

from __future__ import annotations

import sys

import pytest

from tests.kernels import interp_support
from tests.kernels.poison import poisoned_empty

CHECKS = ["moe_tma"]


def check_moe_tma(torch, ti) -> None:
    moe = ti.moe
    T = moe.GemmTiles
    pointer = moe.MoeLaunch(T(32, 16, 4, 3), T(32, 32, 4, 3))  # the reference bits
    launches = [
        moe.MoeLaunch(T(32, 16, 4, 3, tma=True), T(32, 32, 4, 3, tma=True)),
        moe.MoeLaunch(T(16, 32, 4, 3, tma=True, join=True),
                      T(16, 64, 4, 3, 128, tma=True, n_major=True)),
        moe.MoeLaunch(T(64, 16, 4, 3, 128, tma=True, join=True, n_major=True),
                      T(64, 16, 4, 3, tma=True)),
    ]
    # (D, I): K tails (96, 48 vs K steps 64/128), I not a multiple of the column tiles;
    # then rows that are not 16-byte aligned (D = 100, I = 44: the pointer path).
    for e, d, i in ((6, 96, 48), (5, 100, 44)):
        for rows_per_token, num_tokens in ((1, 45), (3, 17)):
            r = num_tokens * rows_per_token  # odd
            x = torch.randn(num_tokens, d, dtype=torch.float16)
            wgu = torch.randn(e, 2 * i, d, dtype=torch.float16) / 8
            wd = torch.randn(e, d, i, dtype=torch.float16) / 8
            # Ragged: expert 0 and 3 get no rows, expert 1 most; id e: routed nowhere.
            ids = torch.tensor([1, 1, 2, 1, 4, e, 1, 2, 1][: e] * (r // 5 + 1))[:r]
            ids[-1] = e - 1
            routed = ids < e
            with poisoned_empty():
                ref = ti.expert_ffn(x, ids, wgu, wd, rows_per_token=rows_per_token,
                                    launch=pointer)
                assert not ref[routed].isnan().any(), "routed rows left unwritten"
                for lp in launches:
                    for fused in (True, False):
                        got = ti.expert_ffn(x, ids, wgu, wd, rows_per_token=rows_per_token,
                                            launch=lp, fused=fused)
                        assert torch.equal(got[routed], ref[routed]), \
                            f"{lp} fused={fused} D={d} k'={rows_per_token}"
            row = int(routed.nonzero()[0, 0])
            g, u = (wgu[ids[row]].double() @ x[row // rows_per_token].double()).chunk(2)
            want = wd[ids[row]].double() @ (g * torch.sigmoid(g) * u)
            assert float((ref[row].double() - want).norm() / want.norm()) < 2e-2
    try:
        T(64, 64, 4, 3, join=True)
    except ValueError:
        pass
    else:
        raise AssertionError("join without tma accepted")


def _child() -> None:
    interp_support.install()  # fixed-order tl.dot: bits independent of the host BLAS
    interp_support.run_checks(globals(), CHECKS)


@pytest.fixture(scope="module")
def interp_results() -> dict[str, dict]:
    try:
        return interp_support.child_results(__file__)
    except RuntimeError as e:
        pytest.fail(str(e))


@pytest.mark.parametrize("name", CHECKS)
def test_moe_tma_under_interpreter(interp_results: dict[str, dict], name: str) -> None:
    r = interp_results.get(name)
    assert r is not None, f"check {name} did not run"
    assert r["ok"], r.get("error")


if __name__ == "__main__" and "--child" in sys.argv:
    _child()

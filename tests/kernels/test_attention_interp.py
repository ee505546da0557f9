"""Paged-attention launch switches under the Triton interpreter (CPU, CI).

The launch modes (serial, chunk) and loop switches (unmasked full splits, block
ids one split ahead, long rows first, a fold over head_dim chunks, fold warps, the l-dot's
width) must not
change a token's bits: every launch below equals the reference serial launch on a prefill,
on single decodes at split and chunk boundaries, on a mixed batch and on a decode batch
read as one token per sequence (``one_token_per_seq``); block-table entries past a
sequence's context are out of range, so a read through one would fail. Chunks are lowered
to 2 splits, so the two-level reduction crosses chunk boundaries at this small size. (Under the interpreter a dot accumulates serially over k in fp32
(tests/kernels/interp_support.py), not in the tensor cores' k16 steps, so this checks the
index, mask and loop logic; the tile-shape claim is checked on the GPU.)
TRITON_INTERPRET=1 must be set before kernels are defined: the checks run in a child.
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.kernels import interp_support


def _child() -> None:
    import itertools

    from tests.kernels import interp_support

    interp_support.install()  # fixed-order tl.dot: bits independent of the host BLAS
    import torch

    from megaserve.kernels.triton_impl import attention, write_kv_cache
    from megaserve.kernels.triton_impl.attention import AttentionLaunch, paged_attention

    attention.POISON_BUFFERS = True  # unwritten elements and unread parts -> NaN
    attention.CHUNK_SPLITS = 2  # chunk boundaries at 128 and 256 keys (3 splits here)
    torch.manual_seed(0)
    hq, hkv, dh, bs, length = 4, 2, 16, 4, 160
    nb = -(-length // bs)
    kc = torch.randn(nb + 3, bs, hkv, dh, dtype=torch.float16)
    vc = torch.randn_like(kc)
    table = torch.randperm(nb + 3)[:nb].int()
    k = torch.randn(length, hkv, dh, dtype=torch.float16)
    v = torch.randn_like(k)
    pos = torch.arange(length)
    write_kv_cache(k, v, kc, vc, table.long()[pos // bs] * bs + pos % bs)
    q = torch.randn(length, hq, dh, dtype=torch.float16)

    def run(rows, lens, n_new, launch, exp2, one_token_per_seq=False):
        qsl = torch.tensor([0, *itertools.accumulate(n_new)]).int()
        tables = table[None].repeat(len(lens), 1)
        for row, c in zip(tables, lens):
            row[-(-c // bs):] = 10**6  # past the context: no block to read
        return paged_attention(rows, kc, vc, tables, torch.tensor(lens).int(), qsl, 0.25,
                               launch=launch, exp2=exp2, one_token_per_seq=one_token_per_seq)

    ref = AttentionLaunch("serial", 64, 4, 2)
    lens, n_new = [length, 1, 65, 64, 100], [1, 1, 3, 64, 30]
    qb = torch.cat([q[c - n : c] for c, n in zip(lens, n_new)])
    fails = []
    fulls = {}
    launches = (AttentionLaunch("serial", 16, 2, 3, mask_tail=True, prefetch=True),
                AttentionLaunch("serial", 32, 4, 3, mask_tail=True, prefetch=True,
                                long_first=True),
                AttentionLaunch("chunk", 16, 2, 3, mask_tail=True, prefetch=True,
                                long_first=True, fold_block_d=16, fold_unroll=4,
                                fold_warps=1),
                AttentionLaunch("chunk", 32, 4, 2, fold_tokens=4),
                AttentionLaunch("chunk", 16, 2, 3, mask_tail=True, prefetch=True,
                                fold_block_d=16, fold_warps=1),
                AttentionLaunch("chunk", 32, 4, 2, fold_tokens=2),
                AttentionLaunch("serial", 32, 8, 3, mask_tail=True, prefetch=True,
                                l_cols=16),
                AttentionLaunch("chunk", 16, 2, 3, mask_tail=True, l_cols=16),
                AttentionLaunch("serial", 16, 2, 2, mask_tail=True, prefetch=True,
                                maxnreg=128))
    for exp2 in (False, True):  # the exp and the EXP2 arithmetic
        full = fulls[exp2] = run(q, [length], [length], ref, exp2)
        want = torch.cat([full[c - n : c] for c, n in zip(lens, n_new)])
        # The arithmetic is orthogonal to the loop switches: every switch runs with EXP2,
        # a serial and a chunk launch with exp (the interpreter is slow on a CI box).
        for launch in (launches if exp2 else launches[1:3]):
            if not torch.equal(run(q, [length], [length], launch, exp2), full):
                fails.append(f"prefill {launch} exp2={exp2}")
            if not torch.equal(run(qb, lens, n_new, launch, exp2), want):
                fails.append(f"batch {launch} exp2={exp2}")
            for t in (63, 64, 127, 128, length - 1):
                if not torch.equal(run(q[t : t + 1], [t + 1], [1], launch, exp2)[0], full[t]):
                    fails.append(f"decode {t} {launch} exp2={exp2}")
            # A decode batch with query_start_loc promised to be 0, 1, ..., S.
            dec = [length, 1, 64, 65, 128]
            got = run(torch.stack([q[c - 1] for c in dec]), dec, [1] * len(dec), launch, exp2,
                      one_token_per_seq=True)
            if not torch.equal(got, torch.stack([full[c - 1] for c in dec])):
                fails.append(f"one token per sequence {launch} exp2={exp2}")
    # Both arithmetics give the same values to within rounding.
    if not (fulls[False].float() - fulls[True].float()).abs().max().item() < 1e-2:
        fails.append("exp2=False differs from exp2=True by more than rounding")
    print(json.dumps({"fails": fails}), flush=True)


interp_child_output = interp_support.output_fixture(__file__)


def test_attention_launch_switches_keep_bits(interp_child_output: tuple[str, str]) -> None:
    stdout, stderr = interp_child_output
    line = next((ln for ln in stdout.splitlines() if ln.startswith("{")), None)
    assert line is not None, f"interpreter child failed: {stderr[-3000:]}"
    assert json.loads(line)["fails"] == []


if __name__ == "__main__" and "--child" in sys.argv:
    _child()


def test_prefill_launch_choice() -> None:
    """Serial prefill tiles of head_dim <= 128 run 3 stages with block ids one split ahead;
    wider heads keep 2 stages (shared memory); few sequences that can span several chunks
    get chunk mode; decode that fills the GPU runs serial."""
    from megaserve.kernels.triton_impl.attention import (DECODE_SERIAL_TILE, DECODE_TILE,
                                                         PREFILL_TILE, PREFILL_SERIAL_TILE,
                                                         AttentionLaunch, choose_launch)

    ws = 4 * 4096 * 32 * 130 * 4  # the fp32 chunk states of a 4,096-token prompt
    assert choose_launch(4096, 1, 4, 8, 64, ws) == AttentionLaunch("serial",
                                                                   **PREFILL_SERIAL_TILE)
    assert choose_launch(4096, 1, 4, 8, 64, ws, 64).num_stages == 3
    assert choose_launch(4096, 1, 4, 8, 64, ws, 256) == AttentionLaunch("serial", **PREFILL_TILE)
    # A short chunk of a long prompt: chunk mode while the serial grid has fewer programs
    # than an H100 has SMs.
    assert choose_launch(256, 1, 8, 4, 40, 1 << 20) == AttentionLaunch("chunk", **PREFILL_TILE)
    assert choose_launch(512, 1, 8, 4, 40, 1 << 20) == AttentionLaunch("serial",
                                                                       **PREFILL_SERIAL_TILE)
    assert choose_launch(64, 64, 8, 4, 64, 1 << 20) == AttentionLaunch("serial",
                                                                       **DECODE_SERIAL_TILE)
    # Batch 1: chunk mode while a sequence can outgrow one chunk, else serial.
    assert choose_launch(1, 1, 4, 8, 65, 1 << 20) == AttentionLaunch(
        "chunk", **dict(DECODE_TILE, fold_block_d=16, fold_warps=1))
    assert choose_launch(1, 1, 4, 8, 8, 1 << 20) == AttentionLaunch("serial",
                                                                     **DECODE_SERIAL_TILE)
    assert PREFILL_SERIAL_TILE["l_cols"] == 16 and PREFILL_SERIAL_TILE["long_first"]


def test_decode_tile_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """$MEGASERVE_ATTN_DECODE_TILE replaces the serial decode tile's warps, stages and
    register cap (tuning runs) and nothing else; a malformed value is refused."""
    from megaserve.kernels.triton_impl.attention import (DECODE_SERIAL_TILE, AttentionLaunch,
                                                         choose_launch)

    monkeypatch.setenv("MEGASERVE_ATTN_DECODE_TILE", "2,1,128")
    assert choose_launch(64, 64, 8, 4, 64, 1 << 20) == AttentionLaunch(
        "serial", **dict(DECODE_SERIAL_TILE, num_stages=1, maxnreg=128))
    monkeypatch.setenv("MEGASERVE_ATTN_DECODE_TILE", "4,3")
    assert choose_launch(64, 64, 8, 4, 64, 1 << 20) == AttentionLaunch(
        "serial", **dict(DECODE_SERIAL_TILE, num_warps=4, num_stages=3))
    monkeypatch.setenv("MEGASERVE_ATTN_DECODE_TILE", "2")
    with pytest.raises(ValueError, match="WARPS,STAGES"):
        choose_launch(64, 64, 8, 4, 64, 1 << 20)


def test_gluon_prefill_tma_boxes() -> None:
    """The Gluon prefill kernel's TMA boxes: the keys that divide both a split and a cache
    block, taken only where they are whole 8-row swizzle atoms and both caches are
    contiguous and 16-byte aligned (otherwise paged_attention runs the Triton kernel)."""
    import torch

    from megaserve.kernels.triton_impl.attention_gluon import box_rows, tma_boxes

    assert [box_rows(bs, 64) for bs in (8, 16, 32, 48, 64, 128)] == [8, 16, 32, 16, 64, 64]

    def caches(bs):
        return [torch.zeros(4, bs, 2, 128, dtype=torch.bfloat16) for _ in range(2)]

    assert tma_boxes(*caches(16), 64) and tma_boxes(*caches(128), 64)
    assert not tma_boxes(*caches(4), 64)  # 4-key boxes: half an atom
    k, v = caches(16)
    assert not tma_boxes(k, v[:, :, :1], 64)  # one kv head of two: not contiguous
    shifted = v.flatten()[1 : 1 + 3 * 16 * 2 * 128].view(3, 16, 2, 128)  # 2-byte aligned
    assert shifted.is_contiguous() and not tma_boxes(k, shifted, 64)

"""The interpreter's fixed-order dot (tests/kernels/interp_support.py): accurate, serial
over k (so chaining two half-K dots through the accumulator equals one dot), and
bitwise the committed probe on this machine."""

from __future__ import annotations

import numpy as np

from tests.kernels import interp_support


def test_fixed_order_dot_matches_float64_reference() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((17, 96)).astype(np.float16)
    b = rng.standard_normal((96, 40)).astype(np.float16)
    d = rng.standard_normal((17, 40)).astype(np.float32)
    out = interp_support.fixed_order_dot(a, b, d)
    ref = a.astype(np.float64) @ b.astype(np.float64) + d
    assert out.dtype == np.float32
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


def test_fixed_order_dot_is_serial_over_k() -> None:
    rng = np.random.default_rng(2)
    a = rng.standard_normal((8, 64)).astype(np.float16)
    b = rng.standard_normal((64, 24)).astype(np.float16)
    d = np.zeros((8, 24), dtype=np.float32)
    whole = interp_support.fixed_order_dot(a, b, d)
    halves = interp_support.fixed_order_dot(
        a[:, 32:], b[32:], interp_support.fixed_order_dot(a[:, :32], b[:32], d))
    assert np.array_equal(whole, halves)
    reordered = interp_support.fixed_order_dot(a[:, ::-1], b[::-1], d)
    assert not np.array_equal(whole, reordered)  # the order is part of the result


def test_probe_bits_are_the_committed_ones() -> None:
    assert interp_support.probe_digest() == interp_support.PROBE_SHA256

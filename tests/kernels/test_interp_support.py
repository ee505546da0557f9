"""The interpreter patches (tests/kernels/interp_support.py): the fixed-order dot is
accurate, serial over k (so chaining two half-K dots through the accumulator equals one
dot), and bitwise the committed probe on this machine; the integer XOR/OR reductions give
the interpreter's own bits."""

from __future__ import annotations

import sys

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



def test_bitwise_reductions_give_the_interpreters_own_bits() -> None:
    """install()'s XOR/OR reductions equal the interpreter's element-by-element fold
    (ReduceOps.generic_reduce) on every axis, with and without keep_dims, and run as one
    numpy call: they need no patched tensor operators, which the fold calls per element."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    originals = _installed_originals(interp)
    interp_support.install()

    def host():  # a function whose globals see triton.language, as a kernel's do
        pass

    host.__globals__.setdefault("tl", tl)
    try:
        rng = np.random.default_rng(3)
        for combine in (tl.standard._xor_combine, tl.standard._or_combine):
            for np_dtype, dtype in ((np.int16, tl.int16), (np.int32, tl.int32),
                                    (np.int64, tl.int64)):
                data = rng.integers(-2**15, 2**15, size=(2,) * 8, dtype=np_dtype)
                x = tl.core.tensor(interp.TensorHandle(data, dtype),
                                   tl.block_type(dtype, list(data.shape)))
                for axis in (0, 3, 7):
                    for keep_dims in (True, False):
                        op = interp.ReduceOps(axis, combine, keep_dims)
                        (got,) = op.apply((x,))  # outside a kernel: no combine calls
                        scope = interp._patch_lang(host)  # what a combine call needs
                        try:
                            (want,) = op.generic_reduce((x,))
                        finally:
                            scope.restore()
                        assert got.handle.data.dtype == want.handle.data.dtype
                        assert np.array_equal(got.handle.data, want.handle.data), (axis,
                                                                                   keep_dims)
    finally:
        _restore(originals)


def _installed_originals(interp) -> list[tuple[object, str, object]]:
    """What install() replaces, to put back after a test in this (non-interpreter) process."""
    import triton.language as tl
    from triton.language.semantic import TritonSemantic

    patched = [(TritonSemantic, "binary_op_sanitize_overflow_impl"),
               (interp.InterpreterBuilder, "create_dot"), (interp, "_patch_lang_tensor"),
               (interp.ReduceOps, "apply_impl"), (interp, "_get_np_dtype"),
               (interp, "_patch_builtin"), (interp, "_patch_lang"),
               (interp.GridExecutor, "__call__"), (tl.core.tuple_type, "__init__")]
    return [(owner, name, getattr(owner, name)) for owner, name in patched]


def _restore(originals: list[tuple[object, str, object]]) -> None:
    """Undo install() in this process: the replaced functions back, the lazy name gone."""
    import triton.language as tl

    for owner, name, value in originals:
        setattr(owner, name, value)
    if isinstance(tl.core.tuple_type.__dict__.get("name"), property):
        del tl.core.tuple_type.name


class _RecordingScope:
    """A patch scope that records what would be patched and changes nothing."""

    def __init__(self) -> None:
        self.names: list[tuple[int, str]] = []

    def set_attr(self, obj: object, name: str, value: object) -> None:
        self.names.append((id(obj), name))


def test_fast_lookups_give_the_interpreters_results() -> None:
    """install()'s dtype table and builtin walk: the same numpy dtype for every Triton
    dtype, block and pointer type, and the same (namespace, name) patches in the same
    order as the interpreter's own functions."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    originals = _installed_originals(interp)
    own = dict((name, value) for _, name, value in originals)
    interp_support.install()
    try:
        assert interp._get_np_dtype is not own["_get_np_dtype"]
        assert interp._patch_builtin is not own["_patch_builtin"]
        scalars = [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                   tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16,
                   tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]
        types = scalars + [tl.pointer_type(tl.float16), tl.block_type(tl.pointer_type(
            tl.int32), [4, 8])] + [tl.block_type(t, [2, 16]) for t in scalars]
        for t in types:
            assert interp._get_np_dtype(t) == own["_get_np_dtype"](t), t
        for ns in (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base):
            fast, full = _RecordingScope(), _RecordingScope()
            interp._patch_builtin(ns, interp.interpreter_builder, fast)
            own["_patch_builtin"](ns, interp.interpreter_builder, full)
            assert fast.names and fast.names == full.names, ns
    finally:
        _restore(originals)


def test_tuple_type_names_are_the_interpreters() -> None:
    """install()'s tuple types name themselves when asked, with the name their constructor
    formatted: "[field:type,...]"."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    members = [tl.int32, tl.block_type(tl.float16, [4, 8]), tl.core.constexpr_type(3)]
    want = [tl.core.tuple_type(members, ["a", "b", "c"]).name,
            tl.core.tuple_type(members).name]
    originals = _installed_originals(interp)
    interp_support.install()
    try:
        lazy = tl.core.tuple_type(members, ["a", "b", "c"])
        assert "name" not in vars(lazy)  # not formatted at construction
        assert [lazy.name, str(tl.core.tuple_type(members))] == want
        assert want[0].startswith("[a:int32,b:<") and want[0].endswith(",c:constexpr_type[3]]")
    finally:
        _restore(originals)


def test_overflow_checks_are_skipped_only_where_device_assert_drops_them() -> None:
    """install() builds no int32 overflow check when the builder's options say no debug
    (device_assert discards it there: an overflowing add wraps, no error, as before), and
    keeps the interpreter's check when they do (the overflow raises)."""
    import dataclasses

    import triton.language as tl
    import triton.runtime.interpreter as interp
    from triton.language.semantic import TritonSemantic

    checked = TritonSemantic.binary_op_sanitize_overflow_impl
    originals = _installed_originals(interp)
    interp_support.install()
    try:
        assert TritonSemantic.binary_op_sanitize_overflow_impl is not checked
        builder = interp.InterpreterBuilder()
        semantic = TritonSemantic(builder)
        big = np.array([2**31 - 1, 5], dtype=np.int32)
        x = tl.core.tensor(interp.TensorHandle(big, tl.int32), tl.block_type(tl.int32, [2]))
        one = tl.core.tensor(interp.TensorHandle(np.ones(2, np.int32), tl.int32),
                             tl.block_type(tl.int32, [2]))
        out = semantic.add(x, one, sanitize_overflow=True)  # debug off: wraps
        assert out.handle.data.tolist() == [-2**31, 6]
        builder.options = dataclasses.replace(builder.options, debug=True)
        try:
            semantic.add(x, one, sanitize_overflow=True)
        except AssertionError as e:
            assert "overflow" in str(e)
        else:
            raise AssertionError("debug on: the overflow went unreported")
    finally:
        _restore(originals)


interp_results = interp_support.results_fixture(__file__)


def test_helper_calls_inside_a_launch_patch_nothing_more(interp_results: dict[str, dict]) -> None:
    """Under the interpreter (a child process), with install(): a kernel whose programs
    call a ``@triton.jit`` helper computes the same values, patches the language once (at
    the launch, not again per helper call) and leaves it as it found it."""
    interp_support.assert_check_passed(interp_results, "launch_scope")


if __name__ == "__main__" and "--child" in sys.argv:
    import json

    import torch
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    interp_support.install()

    @triton.jit
    def _plus_one(x):
        return x + 1

    @triton.jit
    def _plus_two_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, _plus_one(_plus_one(tl.load(x_ptr + offs))))

    def _launch_scope() -> None:
        spaces = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
        before = {(id(ns), name): getattr(ns, name) for ns in spaces for name in dir(ns)}
        walks = []
        walk = interp._patch_builtin
        interp._patch_builtin = lambda *a: (walks.append(a[0]), walk(*a))[1]
        x = torch.arange(12, dtype=torch.float32)
        out = torch.zeros_like(x)
        _plus_two_kernel[(3,)](x, out, BLOCK=4)  # 3 programs, 2 helper calls each
        interp._patch_builtin = walk
        assert torch.equal(out, x + 2), out
        # the launch's own patch: tl, tl.tensor, tl.math, the descriptor base; no more
        assert len(walks) == 4, len(walks)
        after = {(id(ns), name): getattr(ns, name) for ns in spaces for name in dir(ns)}
        assert after.keys() == before.keys()
        changed = [k[1] for k in before if after[k] is not before[k]
                   and not (k[1].startswith("__") and after[k] == before[k])]  # bound methods
        assert not changed, f"the launch left the language patched: {changed}"

    try:
        _launch_scope()
        print(json.dumps({"check": "launch_scope", "ok": True}), flush=True)
    except Exception as e:  # reported to the parent test, which fails on it
        print(json.dumps({"check": "launch_scope", "ok": False, "error": repr(e)}), flush=True)

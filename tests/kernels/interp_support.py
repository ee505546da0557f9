"""Make the Triton interpreter's results a function of the kernel alone, not of the host.

The interpreter (``TRITON_INTERPRET=1``) runs ``tl.dot`` as one ``np.matmul``, i.e. the
host BLAS's ``sgemm``, whose summation order depends on the BLAS kernel the CPU selects
(``OPENBLAS_CORETYPE``, AVX2 vs AVX-512, block sizes). Bitwise comparisons between two
launches of a kernel then compare the host's BLAS blockings, not the kernel's reduction
order (it failed on a 2-core AMD EPYC with ``OPENBLAS_CORETYPE=Haswell``).

:func:`install` replaces the interpreter's dot by a fixed-order one: the accumulator
starts from ``d`` and adds the rank-1 products ``a[:, k] * b[k, :]`` for k = 0, 1, ... in
``d``'s dtype, one elementwise IEEE multiply and one add per step (numpy elementwise
ufuncs round each operation, with no contraction into FMAs and no host library). That is
the order of a serial fp32 accumulator, the same on every x86-64 CPU. Call it in the
interpreter child before any kernel is defined.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

# sha256 of :func:`probe`'s output bytes: the fixed-order dot's bits on a reference
# input. A machine whose result differs is one where the interpreter tests cannot hold:
# tests/conftest.py stops the whole session there with that message.
PROBE_SHA256 = "d088938dffe0840a04c65b10f32494bf6f5a4c952c344c769732ff9f367d85d6"


# The environment of an interpreter child. The interpreter runs one program at a time in
# Python; torch's intra-op threads (the tests' tensor set-up and copies) only spin there.
CHILD_ENV = {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}


def fixed_order_dot(a: np.ndarray, b: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``d + a @ b`` summed serially over k in ``d``'s dtype.

    a: ``[M, K]``, b: ``[K, N]`` (any float dtype; promoted to ``d``'s dtype first, which
    is exact for fp16/bf16 into fp32); d: ``[M, N]``, the accumulator. Returns a new array.
    """
    acc = np.array(d, dtype=d.dtype, copy=True)
    a = a.astype(d.dtype, copy=False)
    b = b.astype(d.dtype, copy=False)
    for k in range(a.shape[-1]):
        np.add(acc, np.multiply(a[..., :, k : k + 1], b[..., k : k + 1, :]), out=acc)
    return acc


def install() -> None:
    """Patch the interpreter: fixed-order ``tl.dot``; ``int()`` of 1-element tensors; integer
    XOR/OR reductions in one numpy call (exact, so the same bits as the interpreter's own);
    cheaper dtype and builtin look-ups, no discarded overflow checks
    (:func:`_install_fast_patching`), no re-patching at helper calls inside a launch
    (:func:`_install_launch_scoped_patching`). Call it once, before any kernel runs."""
    import triton.language as tl
    import triton.runtime.interpreter as interp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = interp._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = interp._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        return interp.TensorHandle(fixed_order_dot(a_data, b_data, d.data), d.dtype.scalar)

    interp.InterpreterBuilder.create_dot = create_dot

    # numpy >= 2.4 refuses int() of a 1-element array, which the interpreter relies on for
    # scalar kernel arguments used as loop bounds.
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    # The interpreter reduces with any combine function other than sum/min/max/argmin/argmax
    # one element at a time in Python (ReduceOps.generic_reduce): tl.sort's bitonic network
    # runs an xor_sum per stage, seconds per launch. XOR and OR of integers are exact in any
    # order, so one numpy reduction gives the element-by-element fold's bits.
    exact_bitwise = {tl.standard._xor_combine: np.bitwise_xor,
                     tl.standard._or_combine: np.bitwise_or}
    generic_apply = interp.ReduceOps.apply_impl

    def apply_impl(self, input):
        ufunc = exact_bitwise.get(self.combine_fn)
        if (ufunc is None or self.axis is None or len(input) != 1
                or not input[0].dtype.is_int()):
            return generic_apply(self, input)
        data = input[0].handle.data
        return self.to_tensor(ufunc.reduce(data, axis=self.axis, keepdims=self.keep_dims),
                              input[0].dtype)

    interp.ReduceOps.apply_impl = apply_impl
    _install_fast_patching(tl, interp)


def _install_fast_patching(tl, interp) -> None:
    """Work the interpreter repeats per operation, made cheap with the same results. Two
    look-ups: the numpy dtype of a Triton dtype from one table built once
    (``_get_np_dtype`` rebuilt its 19-entry dict per call), and ``_patch_builtin`` (run
    for five namespaces at every launch and every call of a ``@triton.jit`` helper)
    walking only the names that hold Triton builtins instead of ``inspect.getmembers``
    of the whole namespace. Nothing assigns new builtins to these namespaces, so the names
    taken here, before any kernel runs, are every name the full walk could patch. And the
    int32 overflow checks that device_assert would discard are not built."""
    np_types = {
        tl.int1: np.dtype(bool), tl.float16: np.dtype(np.float16),
        tl.float32: np.dtype(np.float32), tl.float64: np.dtype(np.float64),
        tl.int8: np.dtype(np.int8), tl.uint8: np.dtype(np.uint8),
        tl.int16: np.dtype(np.int16), tl.uint16: np.dtype(np.uint16),
        tl.int32: np.dtype(np.int32), tl.uint32: np.dtype(np.uint32),
        tl.int64: np.dtype(np.int64), tl.uint64: np.dtype(np.uint64),
        tl.bfloat16: np.dtype(np.uint16),  # stored as uint16
        tl.float8e5: np.dtype(np.uint8), tl.float8e5b16: np.dtype(np.uint8),  # as uint8
        tl.float8e4nv: np.dtype(np.uint8), tl.float8e4b8: np.dtype(np.uint8),
        tl.float8e4b15: np.dtype(np.uint8),
    }
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            if isinstance(tt_dtype.element_ty, tl.pointer_type):
                return pointer
            return np_types[tt_dtype.element_ty]
        return np_types[tt_dtype]

    interp._get_np_dtype = get_np_dtype

    namespaces = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    builtin_names = {id(ns): [name for name in sorted(dir(ns))
                              if tl.core.is_builtin(getattr(ns, name, None))]
                     for ns in namespaces}
    full_walk = interp._patch_builtin

    def patch_builtin(pkg, builder, scope):
        names = builtin_names.get(id(pkg))
        if names is None:
            return full_walk(pkg, builder, scope)
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                interp._patch_attr(pkg, name, member, builder, scope)

    interp._patch_builtin = patch_builtin

    # Every int32 add/sub/mul builds an int64 overflow check (~10 interpreted ops) whose
    # result goes to device_assert, which drops it unless the options say debug (the
    # interpreter's never do). Skipped in that case only: nothing observable changes.
    from triton.language.semantic import TritonSemantic

    checked = TritonSemantic.binary_op_sanitize_overflow_impl

    def sanitize_overflow(self, lhs, rhs, binary_op):
        if not self.builder.options.debug:
            return None
        return checked(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow

    _install_lazy_type_names(tl)
    _install_launch_scoped_patching(tl, interp)


def _install_lazy_type_names(tl) -> None:
    """A tuple type formats its name ("[field:type,...]", every member's repr) when built,
    and the interpreter builds one per ``triton.language`` tuple, millions per check; the
    name is read for messages only. Formatted when read instead, from the same fields
    (which nothing changes after construction)."""
    tuple_type = tl.core.tuple_type

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [''] * len(types)

    def tuple_type_name(self):
        return '[' + ','.join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + ']'

    tuple_type.__init__ = tuple_type_init
    tuple_type.name = property(tuple_type_name)


def _install_launch_scoped_patching(tl, interp) -> None:
    """The interpreter patches ``triton.language`` (``_patch_lang``) at each launch, undone
    when the launch ends, and again at every call of a ``@triton.jit`` helper inside it.
    A helper whose module sees only language modules the launch has patched finds every
    builtin patched already and re-sets closures that behave the same; its patches are
    undone with the launch's. That call is skipped here; any other runs as before."""
    full_patch_lang = interp._patch_lang
    launch = {"depth": 0, "patched": []}  # language modules patched by the current launch

    def patch_lang(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        patched = launch["patched"]
        if launch["depth"] and langs and all(any(m is p for p in patched) for m in langs):
            return interp._LangPatchScope()  # nothing to do, nothing to undo
        scope = full_patch_lang(fn)
        if launch["depth"]:
            patched.extend(langs)
        return scope

    grid_call = interp.GridExecutor.__call__

    def launch_call(self, *args, **kwargs):
        outer = launch["patched"]
        launch["patched"] = []
        launch["depth"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launch["depth"] -= 1
            launch["patched"] = outer

    interp._patch_lang = patch_lang
    interp.GridExecutor.__call__ = launch_call


def probe() -> bytes:
    """The fixed-order dot's bytes on a reference input with many rounding steps."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((32, 256)).astype(np.float16)
    b = rng.standard_normal((256, 48)).astype(np.float16)
    d = rng.standard_normal((32, 48)).astype(np.float32)
    return fixed_order_dot(a, b, d).tobytes()


def probe_digest() -> str:
    return hashlib.sha256(probe()).hexdigest()



def run_checks(namespace: dict, names: list[str]) -> None:
    """In an interpreter child: call ``check_<name>(torch, ti)`` from ``namespace`` for each
    name (seed 0 each), printing one JSON line per check for :func:`child_results`."""
    import torch

    import megaserve.kernels.triton_impl as ti

    for name in names:
        torch.manual_seed(0)
        try:
            namespace[f"check_{name}"](torch, ti)
            print(json.dumps({"check": name, "ok": True}), flush=True)
        except Exception as e:  # reported to the parent test, which fails on it
            print(json.dumps({"check": name, "ok": False, "error": repr(e)}), flush=True)


CHILD_TIMEOUT_S = 540


class _Children:
    """The session's interpreter children, run one at a time by a background thread from
    the end of collection (:func:`start_children`, tests/conftest.py), so that they use the
    CPU while the tests before theirs wait on servers and sockets; a module's fixture then
    takes its child's output (:func:`child_output`). One at a time: each child is one
    single-threaded process, and the suite runs beside it."""

    def __init__(self) -> None:
        self.futures: dict[str, Future] = {}
        self.pool: ThreadPoolExecutor | None = None
        self.running: subprocess.Popen | None = None
        self.stopped = False
        self.lock = threading.Lock()

    def start(self, test_files: list[str], env: dict) -> None:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp-children")
        for f in test_files:
            key = str(Path(f).resolve())
            if key not in self.futures:
                self.futures[key] = self.pool.submit(self._run, key, env)

    def _run(self, test_file: str, env: dict) -> tuple[str, str]:
        with self.lock:
            if self.stopped:
                raise RuntimeError("the session ended before this interpreter child ran")
            self.running = subprocess.Popen(_command(test_file), cwd=REPO, env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True)
        try:
            return self.running.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.running.kill()
            self.running.communicate()
            raise
        finally:
            self.running = None

    def take(self, test_file: str) -> Future | None:
        return self.futures.pop(str(Path(test_file).resolve()), None)

    def stop(self) -> None:
        """Cancel the children not started and kill the running one (end of session)."""
        with self.lock:
            self.stopped = True
            if self.pool is not None:
                self.pool.shutdown(wait=False, cancel_futures=True)
            if self.running is not None:
                self.running.kill()


_CHILDREN = _Children()


def _command(test_file: str) -> list[str]:
    return [sys.executable, test_file, "--child"]


def child_env() -> dict:
    """The environment of an interpreter child (TRITON_INTERPRET=1: the variable must be set
    before kernels are defined)."""
    return dict(os.environ, PYTHONPATH=str(REPO), **CHILD_ENV)


def start_children(test_files: list[str]) -> None:
    """Run the interpreter children of ``test_files`` in the background from now on."""
    _CHILDREN.start(test_files, child_env())


def stop_children() -> None:
    _CHILDREN.stop()


def child_output(test_file: str) -> tuple[str, str]:
    """``test_file --child``'s (stdout, stderr): its background run's (:func:`start_children`)
    once it ends, else a run now."""
    future = _CHILDREN.take(test_file)
    if future is not None and not future.cancelled():
        return future.result()
    proc = subprocess.run(_command(test_file), cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    return proc.stdout, proc.stderr


def child_results(test_file: str) -> dict[str, dict]:
    """``test_file --child``'s :func:`run_checks` lines by check name (:func:`child_output`);
    raises RuntimeError with the child's stderr when it reported nothing."""
    stdout, stderr = child_output(test_file)
    results = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["check"]] = r
    if not results:
        raise RuntimeError(f"interpreter child failed: {stderr[-3000:]}")
    return results


# The fixture names of tests that take an interpreter child's output (tests/conftest.py
# starts those children when such a test is selected).
CHILD_FIXTURES = ("interp_results", "interp_child_output")


def results_fixture(test_file: str):
    """A module-scoped ``interp_results`` fixture for ``test_file``: its interpreter child
    runs once (:func:`child_results`); a child that reported nothing fails the tests."""

    @pytest.fixture(scope="module")
    def interp_results() -> dict[str, dict]:
        try:
            return child_results(test_file)
        except RuntimeError as e:
            pytest.fail(str(e))

    return interp_results


def output_fixture(test_file: str):
    """A module-scoped ``interp_child_output`` fixture: ``test_file --child``'s (stdout,
    stderr), for a child that reports in its own shape."""

    @pytest.fixture(scope="module")
    def interp_child_output() -> tuple[str, str]:
        return child_output(test_file)

    return interp_child_output


def assert_check_passed(results: dict[str, dict], name: str) -> None:
    """The child ran check ``name`` and it passed (else its error is the message)."""
    r = results.get(name)
    assert r is not None, f"check {name} did not run"
    assert r["ok"], r.get("error")

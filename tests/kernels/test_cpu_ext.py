"""The compiled CPU kernels (kernels/cpu_src/): every output element written, bits
independent of the ISA build and of threads, fused multiply-adds only where the source
writes them, a concurrent first build done once, a clear error without a compiler."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from megaserve.kernels import cpu, cpu_ext
from megaserve.kernels.api import set_cpu_threads

from .test_cpu_batched_kernels import _attend
from .test_cpu_kernels import _paged_setup
from .test_fused_interp import _bits, _rel_err, _rotary_ref, _rotary_tables

ISA_RANK = {"baseline": 0, "avx2": 1, "avx512": 2}


def _inputs(dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(5)
    e, d, inter, v = 8, 256, 512, 512
    lengths = [1, 17, 64, 65, 130]
    k_cache, v_cache, tables = _paged_setup(lengths, dtype, poison=True)
    return dict(
        x=torch.randn(37, d, generator=g).to(dtype),
        res=torch.randn(37, d, generator=g).to(dtype),
        w=(torch.randn(384, d, generator=g) / 16).to(dtype),
        bias=torch.randn(384, generator=g).to(dtype),
        norm=torch.rand(d, generator=g).to(dtype),
        ids=torch.randint(0, e, (37,), generator=g),
        w_gate_up=(torch.randn(e, 2 * inter, d, generator=g) / 16).to(dtype),
        w_down=(torch.randn(e, d, inter, generator=g) / 16).to(dtype),
        router=torch.randn(37, e, generator=g) * 3,
        expert_out=torch.randn(37, 2, d, generator=g),
        topk_w=torch.rand(37, 2, generator=g),
        logits=torch.randn(37, v, generator=g) * 4,
        q=torch.randn(sum(lengths), 8, 32, generator=g).to(dtype),
        cache=(k_cache, v_cache, tables, lengths),
        qkv=(torch.randn(37, (8 + 2 * 2) * 32, generator=g) * 3).to(dtype),
        positions=torch.randint(0, 300, (37,), generator=g),
        rotary=_rotary_tables(torch, 300, 32, dtype, "cpu"),
        head_norm=(torch.rand(32, generator=g) + 0.5).to(dtype),
    )


def _rotary(a: dict, norm: bool = True, rows: slice = slice(None)) -> list[torch.Tensor]:
    """rotary_and_cache on ``a`` (8 + 2 + 2 heads of 32) into fresh zeroed caches; returns
    q and both caches."""
    qkv, positions = a["qkv"][rows], a["positions"][rows]
    caches = [torch.zeros(16, 4, 2, 32, dtype=qkv.dtype) for _ in range(2)]
    slots = torch.arange(qkv.shape[0]) * 3 % 64
    slots[1::5] = -1  # padding tokens: nothing written
    w = a["head_norm"] if norm else None
    q = cpu.rotary_and_cache(qkv, positions, *a["rotary"], w, w, 1e-6, *caches, slots, 8)
    return [q, *caches]


def _run_all(a: dict) -> list[torch.Tensor]:
    """Every compiled kernel once on ``a``."""
    k_cache, v_cache, tables, lengths = a["cache"]
    ids, weights = cpu.topk_route(a["router"], 2, renormalize=True)
    return [
        cpu.linear(a["x"], a["w"], a["bias"]),
        *cpu.rms_norm(a["x"], a["norm"], 1e-5, residual=a["res"]),
        cpu.expert_ffn(a["x"], a["ids"], a["w_gate_up"], a["w_down"]),
        ids, weights,
        cpu.combine(a["expert_out"], a["topk_w"]),
        cpu.log_softmax(a["logits"]),
        _attend(a["q"], k_cache, v_cache, tables, lengths, lengths, 32 ** -0.5),
        *_rotary(a),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_output_element_is_written(dtype, monkeypatch):
    """Outputs start as NaN (poisoned): a kernel that skipped an element would leave one."""
    def poisoned(*shape, dtype=torch.float32):
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype)
        return torch.full(shape, -1, dtype=dtype)

    monkeypatch.setattr(cpu, "_output", poisoned)
    for out in _run_all(_inputs(dtype)):
        assert not (out.isnan().any() if out.is_floating_point() else (out < 0).any())


def test_exp_and_log_accuracy_over_the_float_range():
    """log_softmax's exp and log polynomials against float64, down to underflow."""
    x = torch.cat([torch.linspace(-110.0, 0.0, 4001), torch.tensor([-87.5, -103.0, -104.5])])
    logits = torch.stack([x, torch.zeros_like(x)], dim=1)  # log_softmax([x, 0])
    got = cpu.log_softmax(logits)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(got.double(), ref, rtol=2e-6, atol=2e-6)


@pytest.fixture(scope="module")
def first_builds(tmp_path_factory) -> tuple:
    """Four processes load the library from an empty cache at once, the baseline build
    (``MEGASERVE_CPU_ISA``); returns the cache, the processes and their outputs. The ISA
    test loads that build instead of compiling it again."""
    cache = tmp_path_factory.mktemp("cpu-ext-first-builds")
    code = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout); "
            "from megaserve.kernels import cpu_ext; cpu_ext.load(); print('loaded')")
    env = {**os.environ, "MEGASERVE_CACHE": str(cache), "MEGASERVE_CPU_ISA": "baseline"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return cache, procs, outs


def test_bits_do_not_depend_on_the_isa_build(monkeypatch, first_builds):
    """The baseline (SSE2) and AVX2 builds give the bits of the default build: vector width
    never changes an element's sequence of operations."""
    a = _inputs()
    default = _run_all(a)
    here = ISA_RANK[cpu_ext.default_isa()]
    others = [isa for isa, rank in ISA_RANK.items() if rank < here]
    if not others:
        pytest.skip("this CPU runs only the baseline build")
    monkeypatch.setenv("MEGASERVE_CACHE", str(first_builds[0]))  # the baseline build is there
    for isa in others:
        monkeypatch.setattr(cpu_ext, "_lib", cpu_ext.load(isa))
        cpu._PACKED.clear()
        for got, want in zip(_run_all(a), default):
            assert torch.equal(got, want), isa
    cpu._PACKED.clear()


def test_threads_change_no_bits():
    a = _inputs()
    one = _run_all(a)
    try:
        cpu.set_num_lanes(2)
        two = _run_all(a)
    finally:
        cpu.set_num_lanes(1)
    for got, want in zip(two, one):
        assert torch.equal(got, want)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_fused_multiply_adds_only_where_the_source_writes_them():
    """The compiler contracts nothing (-ffp-contract=off): the row kernels, whose sums are
    written as a multiply then an add, hold no FMA instruction; the GEMM's explicit
    fmadd() is one (AVX2 / AVX-512 builds)."""
    isa = cpu_ext.default_isa()
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(cpu_ext.build(isa))],
                          capture_output=True, text=True, check=True).stdout
    functions, name = {}, None
    for line in text.splitlines():
        if line.endswith(">:"):
            name = line.split("<", 1)[1][:-2]
            functions[name] = []
        elif name is not None:
            functions[name].append(line)
    fused = ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub")
    for row_kernel in ("ms_rms_norm", "ms_log_softmax", "ms_combine", "ms_rotary_and_cache"):
        body = "\n".join(line for fn, lines in functions.items() if row_kernel in fn
                         for line in lines)
        assert body and not any(f in body for f in fused), row_kernel
    if isa != "baseline":
        assert any(f in line for fn, lines in functions.items() if "micro_kernel" in fn
                   for line in lines for f in fused)


def test_concurrent_first_builds_compile_once(first_builds):
    """Four processes load the library from an empty cache at once: one compiles, the
    others wait on the lock and load its file; no temporary file is left behind."""
    cache, procs, outs = first_builds
    assert all(p.returncode == 0 and "loaded" in out for p, out in zip(procs, outs)), outs
    assert sum(out.count("built the CPU kernels (baseline)") for out in outs) == 1
    files = sorted(p.relative_to(cache / "cpu_ext").parts[1] for p in
                   (cache / "cpu_ext").rglob("*") if p.is_file() and
                   p.relative_to(cache / "cpu_ext").parts[0].startswith("baseline-"))
    assert files == ["build.lock", "megaserve_cpu_ext.so"]


def test_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-megaserve")
    with pytest.raises(cpu_ext.CpuKernelBuildError, match="C\\+\\+ compiler"):
        cpu_ext.build("baseline")


def _linear_with_two_lanes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # As the engine does: torch's own (OpenMP) threads pinned to 1, which also keeps a
    # forked child out of the OpenMP pool it inherited without its threads.
    set_cpu_threads(2)
    return cpu.linear(x, w)


def test_thread_pool_works_in_a_forked_child():
    """A child forked after the parent's pool started gets a pool of its own (the
    parent's threads do not exist in it): same bits, no hang."""
    import multiprocessing

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(100, 64, generator=g), torch.randn(96, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        want = _linear_with_two_lanes(x, w)  # starts this process's helper thread
    finally:
        cpu.set_num_lanes(1)
        torch.set_num_threads(threads)
    with multiprocessing.get_context("fork").Pool(1) as workers:
        got = workers.apply_async(_linear_with_two_lanes, (x, w)).get(timeout=120)
    assert torch.equal(got, want)


def test_expert_ids_out_of_range_are_rejected():
    g = torch.Generator().manual_seed(4)
    w_gate_up, w_down = torch.randn(4, 32, 16, generator=g), torch.randn(4, 16, 16, generator=g)
    x = torch.randn(3, 16, generator=g)
    for bad in (5, -1):
        with pytest.raises(ValueError, match="expert ids"):
            cpu.expert_ffn(x, torch.tensor([0, bad, 1]), w_gate_up, w_down)
    out = cpu.expert_ffn(x, torch.tensor([0, 4, 1]), w_gate_up, w_down)  # 4 = routed nowhere
    assert torch.equal(out[[0, 2]], cpu.expert_ffn(x[[0, 2]], torch.tensor([0, 1]), w_gate_up, w_down))


def test_rotary_and_cache_compiled_equals_the_composition():
    """The compiled float32 rotary_and_cache gives the bits of the torch composition it
    replaces (q, both caches; with and without the q/k norm; padding slots written nowhere;
    a negative position counts from the end of the tables, as a torch index does), is
    within float32 rounding of a float64 reference, and a subset of tokens alone gives the
    same rows. A position past the tables raises IndexError."""
    a = _inputs()
    a["positions"][4] = -1
    for norm in (True, False):
        got = _rotary(a, norm)
        w = a["head_norm"] if norm else None
        caches = [torch.zeros(16, 4, 2, 32) for _ in range(2)]
        slots = torch.arange(37) * 3 % 64
        slots[1::5] = -1
        want_q = cpu.composed_rotary_and_cache(cpu.rms_norm, cpu.write_kv_cache, a["qkv"],
                                               a["positions"], *a["rotary"], w, w, 1e-6,
                                               *caches, slots, 8)
        assert got[0].is_contiguous() and torch.equal(got[0], want_q), f"q, norm={norm}"
        for c, want in zip(got[1:], caches):
            assert torch.equal(_bits(torch, c), _bits(torch, want)), f"cache, norm={norm}"
        x = a["qkv"].view(37, 12, 32)
        ref = _rotary_ref(torch, x[:, :8], *a["rotary"], a["positions"], w, 1e-6)
        assert _rel_err(got[0], ref) < 1e-6
        for rows in (slice(3, 4), slice(5, 17)):
            assert torch.equal(_rotary(a, norm, rows)[0], got[0][rows]), f"rows {rows}"
    a["positions"][0] = 300
    with pytest.raises(IndexError):
        _rotary(a)


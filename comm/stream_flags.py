"""Device-visible flags written and waited on by CUDA streams, with no host in the loop.

A flag is one int32 in GPU memory (or host memory the GPU maps). A producer's stream
raises it after the work before it (``cuStreamWriteValue32``: the write waits for the
stream's earlier work and carries a memory barrier, so the bytes it guards are visible
first); a consumer's stream blocks until it holds a value (``cuStreamWaitValue32``), with
no kernel spinning on an SM. Both are stream operations, so both can be captured in CUDA
graphs and replayed every step.

NOTE: the protocol the data plane uses is a **toggle**: the producer writes ``SET``; the
consumer waits for ``SET`` and writes ``CLEAR`` right after, on its own stream, before it
issues whatever lets the producer write that flag again. Values baked into a CUDA graph are
constants, so the flags cannot count steps; the toggle needs none.

HAZARD: a wait has no timeout of its own. A stream whose producer died would block
forever, so :meth:`Releaser.release` lets the host raise a flag (to ``ABORT``) from a
separate non-blocking stream; the data plane calls it when its host-side deadline passes,
the waits drain, and the step's results are discarded with a typed error.

Nothing here imports torch or cuda-python at import time.
"""

from __future__ import annotations

from typing import Any

CLEAR = 0
SET = 1
ABORT = 2  # raised by the host to drain a stream whose producer is gone

_driver: Any = None


def _drv():
    """cuda-python's driver module (``cuda.bindings.driver``, or the older ``cuda.cuda``)."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver
        except ImportError:
            try:
                from cuda import cuda as driver  # cuda-python < 12.6
            except ImportError as e:
                raise RuntimeError("stream flags need cuda-python (pip install cuda-python)") from e
        _driver = driver
    return _driver


def available() -> str | None:
    """None where stream flags work here, else why not (no CUDA, no cuda-python)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        _drv()
    except (ImportError, RuntimeError) as e:
        return str(e)
    return None


def _check(result: tuple, what: str) -> None:
    err = result[0]
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")


def _stream(stream: Any):
    import torch

    stream = torch.cuda.current_stream() if stream is None else stream
    return _drv().CUstream(stream.cuda_stream)


def _address(flag: Any) -> Any:
    """A flag is a one-element int32 tensor (a view into a flag array)."""
    import torch

    if flag.dtype != torch.int32 or flag.numel() != 1:
        raise ValueError(f"a flag is one int32 element, got {flag.dtype} x {flag.numel()}")
    return _drv().CUdeviceptr(flag.data_ptr())


def write(flag: Any, value: int, stream: Any = None) -> None:
    """Queue ``flag = value`` on ``stream`` (default: current), after its earlier work."""
    drv = _drv()
    _check(drv.cuStreamWriteValue32(_stream(stream), _address(flag), value,
                                    drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT),
           "cuStreamWriteValue32")


def wait(flag: Any, value: int, stream: Any = None) -> None:
    """Queue a wait on ``stream`` until ``flag >= value`` (so ``ABORT`` also releases it)."""
    drv = _drv()
    _check(drv.cuStreamWaitValue32(_stream(stream), _address(flag), value,
                                   drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32")


def wait_and_clear(flag: Any, stream: Any = None) -> None:
    """The consumer's half of the toggle: wait for ``SET`` (or ``ABORT``), then ``CLEAR``."""
    wait(flag, SET, stream)
    write(flag, CLEAR, stream)


class Releaser:
    """Raises flags from the host side without waiting behind any blocked stream.

    Uses its own non-blocking stream: a stream stuck on a wait never delays it.
    """

    def __init__(self, device: Any) -> None:
        import torch

        self._stream = torch.cuda.Stream(device)

    def release(self, flags: list) -> None:
        """Write ``ABORT`` into every flag now (returns once the writes are done)."""
        for flag in flags:
            write(flag, ABORT, self._stream)
        self._stream.synchronize()

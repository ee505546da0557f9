"""``cuda_ipc``: CUDA tensors between GPUs (processes) of one host.

Data plane: each receiver allocates its ring for a sender in its own GPU memory and hands
the sender a CUDA IPC handle in the WELCOME (``torch.multiprocessing`` tensor reduction).
A write is a device-to-device peer copy (NVLink / PCIe) on a dedicated copy stream into
the mapped slot; once the copy stream has finished, a NOTIFY frame with the immediate goes
over the tcp control connection and the receiver posts a completion whose ``data`` is a
``[nbytes]`` uint8 CUDA tensor view of the slot. Credits, liveness and failure handling
are the tcp provider's.

HAZARD: the copy is ordered after the work already queued on the sender's current stream
(the copy stream waits on it), and the receiver may use the slot as soon as it sees the
completion because the sender synchronised the copy stream before notifying.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from .protocol import ChannelConfig
from .tcp import InPeer, TcpEndpoint
from .wire import Hello

logger = logging.getLogger(__name__)


# Allocations of at least this size get a cudaMalloc segment of their own in PyTorch's
# caching allocator.
_OWN_SEGMENT_BYTES = 16 << 20


def share_tensor(tensor: Any) -> bytes:
    """A CUDA tensor as bytes another process of this host can map (:func:`open_tensor`).

    The tensor should sit in a cudaMalloc segment of its own (allocate at least 16 MiB):
    see the NOTE in ``CudaIpcEndpoint._ring_storage``. Keep it alive while peers use it.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    return pickle.dumps(reduce_tensor(tensor))


def open_tensor(data: bytes, user: Any = None) -> Any:
    """Map a tensor shared by :func:`share_tensor` into this process (no copy). ``user``:
    the CUDA device whose kernels and stream operations will read and write it; the
    buffer is mapped into that device's context and the tensor carries that device,
    though its memory may be another GPU's (default: the buffer's own device).

    NOTE: torch's sharing also exports an IPC event the opener waits on; buffers shared
    at start-up have no pending writes, and opening that event is where 4-GPU runs failed
    intermittently (cudaErrorInvalidResourceHandle), so it is skipped; a failed open is
    retried once.

    NOTE: torch maps a shared buffer in the context of the GPU it was allocated on. A
    kernel on another GPU then faults on its pointer (an illegal address, even with peer
    access enabled between the two: the device data plane's runs on two H200s), while
    peer memcpys pass. Mapped in the user's context instead, CUDA enables peer access for
    the mapping itself (``cudaIpcMemLazyEnablePeerAccess``, which torch passes).
    """
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, args = pickle.loads(data)
    if rebuild is rebuild_cuda_tensor:
        if isinstance(args[-1], bool):
            args = (*args[:-1], False)  # event_sync_required
        if user is not None:  # args[6]: the device the storage is mapped on
            index = torch.device(user).index
            args = (*args[:6], torch.cuda.current_device() if index is None else index,
                    *args[7:])
    try:
        return rebuild(*args)
    except RuntimeError as e:  # torch.AcceleratorError is a RuntimeError
        logger.warning("mapping a peer's CUDA buffer failed (%s); retrying once", e)
        time.sleep(0.05)
        return rebuild(*args)


class CudaIpcEndpoint(TcpEndpoint):
    """Endpoint of one GPU worker process. ``device``: its CUDA device (default: current)."""

    provider = "cuda_ipc"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None, *,
                 device: Any = None, host: str = "127.0.0.1", port: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("the cuda_ipc provider needs a CUDA device; use tcp or inproc on CPU")
        self._torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self._copy_stream = torch.cuda.Stream(self.device)
        self._rings_keepalive: list[Any] = []
        super().__init__(rank, world_size, config, host=host, port=port)

    def _ring_storage(self, hello: Hello) -> tuple[Any, bytes]:
        torch = self._torch
        # NOTE: a ring smaller than the caching allocator's large-segment threshold (10 MiB)
        # shares one cudaMalloc segment, hence one IPC handle, with other rings and tensors
        # of this process; several peer processes then open that same handle. Seen on
        # 2x H200: an expert worker's rebuild_cuda_tensor failed with
        # cudaErrorInvalidResourceHandle when two processes on GPU 1 mapped rings of one
        # process on GPU 0. Padding each ring to its own segment gives every sender its own
        # handle.
        size = max(self.config.ring_bytes, _OWN_SEGMENT_BYTES)
        ring = torch.empty(size, dtype=torch.uint8, device=self.device)[: self.config.ring_bytes]
        self._rings_keepalive.append(ring)
        return ring, share_tensor(ring)

    def _attach(self, welcome: Hello) -> Any:
        """The receiver's ring, mapped into this process (:func:`open_tensor`)."""
        return open_tensor(welcome.extra)

    def _prepare(self, payload: Any) -> tuple[Any, int]:
        """payload: a tensor (any dtype, contiguous or not, CUDA or CPU) or a list of them."""
        torch = self._torch
        parts = payload if isinstance(payload, (list, tuple)) else [payload]
        flats = []
        for part in parts:
            if not isinstance(part, torch.Tensor):
                raise ValueError(f"cuda_ipc sends tensors, got {type(part).__name__}")
            flats.append(part.detach().contiguous().reshape(-1).view(torch.uint8))
        return flats, sum(int(f.numel()) for f in flats)

    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        torch = self._torch
        peer = self._out[dst]
        base = slot * peer.welcome.slot_bytes
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for flat in obj:
                n = int(flat.numel())
                peer.remote[base:base + n].copy_(flat, non_blocking=True)
                base += n
        stream.synchronize()  # the slot is complete before the receiver can learn of it
        with peer.lock:
            self._notify(peer, imm, nbytes)

    def _on_notify(self, peer: InPeer, slot: int, nbytes: int) -> Any:
        sb = self.config.slot_bytes
        return peer.storage[slot * sb: slot * sb + nbytes]

    def _release_storage(self) -> None:
        for peer in self._out.values():
            peer.remote = None
        self._rings_keepalive.clear()

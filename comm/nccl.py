"""``nccl``: a two-sided torch.distributed baseline (NCCL on GPUs, gloo on CPU).

It is what the one-sided providers are measured against, so it stays as plain as NCCL
send/recv: every message is a 2-int64 header (imm, nbytes) then the payload. It differs
from the other providers in two documented ways: ``poll`` must name ``src`` (a receive is
posted to one peer), and there are no credits (NCCL's own rendezvous blocks the sender).
It joins the default process group of ``torch.distributed`` (``init_method`` =
``tcp://<address of rank 0>``).
"""

from __future__ import annotations

import socket
from typing import Any, Iterable, Sequence

from comm.endpoint import Endpoint
from comm.errors import CommError, PeerLostError
from comm.imm import encode_imm
from comm.protocol import ChannelConfig, Completion


class NcclEndpoint(Endpoint):
    """torch.distributed P2P endpoint. ``backend``: "nccl" (CUDA ``device``) or "gloo" (CPU)."""

    provider = "nccl"

    def __init__(self, rank: int, world_size: int, config: ChannelConfig | None = None, *,
                 backend: str = "nccl", device: Any = None, host: str = "127.0.0.1") -> None:
        import torch

        super().__init__(rank, world_size, config)
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={backend!r}: use 'nccl' or 'gloo'")
        self._torch = torch
        self.backend = backend
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        with socket.socket() as s:  # a free port for the process-group store (rank 0's)
            s.bind((host, 0))
            self._address = f"{host}:{s.getsockname()[1]}"
        self._slot = torch.empty(self.config.slot_bytes, dtype=torch.uint8, device=self.device)
        self._busy = False

    @property
    def address(self) -> str:
        return self._address

    def connect(self, addresses: Sequence[str], send_to: Iterable[int] | None = None) -> None:
        import datetime

        dist = self._torch.distributed
        if not dist.is_initialized():
            dist.init_process_group(self.backend, init_method=f"tcp://{addresses[0]}", rank=self.rank,
                                    world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.config.connect_timeout_s))

    def send(self, dst: int, payload: Any, *, layer: int, microbatch: int, tag: int = 0,
             timeout: float | None = None) -> int:
        torch = self._torch
        self._check_open()
        imm = encode_imm(layer, microbatch, 0, tag)
        parts = payload if isinstance(payload, (list, tuple)) else [payload]
        flat = torch.cat([torch.as_tensor(p).reshape(-1).view(torch.uint8) for p in parts]).to(self.device)
        if flat.numel() > self.config.slot_bytes:
            raise ValueError(f"payload of {flat.numel()} bytes exceeds the slot size {self.config.slot_bytes}")
        header = torch.tensor([imm, flat.numel()], dtype=torch.int64, device=self.device)
        try:
            torch.distributed.send(header, dst)
            if flat.numel():
                torch.distributed.send(flat, dst)
        except RuntimeError as e:
            raise PeerLostError(dst, f"torch.distributed send failed ({e})") from e
        return imm

    def poll(self, timeout: float | None = None, *, src: int | None = None) -> Completion:
        """Receive the next message from ``src`` (required: NCCL receives are two-sided)."""
        torch = self._torch
        self._check_open()
        if src is None:
            raise ValueError("the nccl baseline is two-sided: poll(src=...) must name the sender")
        if self._busy:
            raise CommError("release() the previous completion before polling again (one slot)")
        header = torch.empty(2, dtype=torch.int64, device=self.device)
        try:
            torch.distributed.recv(header, src)
            imm, nbytes = (int(v) for v in header.tolist())
            view = self._slot[:nbytes]
            if nbytes:
                torch.distributed.recv(view, src)
        except RuntimeError as e:
            raise PeerLostError(src, f"torch.distributed recv failed ({e})") from e
        self._busy = True
        return Completion(src, imm, nbytes, view)

    def release(self, completion: Completion) -> None:
        self._busy = False

    def _write(self, dst: int, slot: int, imm: int, obj: Any, nbytes: int) -> None:
        raise NotImplementedError  # send() is overridden

    def _return_credit(self, src: int, slot: int) -> None:
        raise NotImplementedError  # release() is overridden

    def _shutdown(self) -> None:
        dist = self._torch.distributed
        if dist.is_initialized():
            dist.destroy_process_group()

"""A NaN-poisoned ``torch.empty`` for the kernel tests: while it is active, fresh
floating-point tensors start as NaN, so an output element no program wrote shows up."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def poisoned_empty(cuda_only: bool = False):
    """Poison ``torch.empty``'s floating-point tensors (only CUDA ones with ``cuda_only``)
    inside the block."""
    import torch

    orig = torch.empty

    def poisoned(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.is_floating_point() and (t.is_cuda or not cuda_only):
            t.fill_(float("nan"))
        return t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = orig

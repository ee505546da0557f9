"""Pieces the kernel sweep scripts share (matmul_sweep, matmul_smallk, linear_decode): the
Triton interpreter patch their ``--smoke`` runs need, and a NaN-poisoned ``torch.empty``
for their bitwise checks. Imported as a sibling module (a script's own folder is first on
``sys.path``, in its spawned workers too)."""

from __future__ import annotations


def patch_interpreter() -> None:
    """numpy >= 2.4 refuses int() of a 1-element array, which the Triton interpreter relies
    on for scalar kernel arguments used as loop bounds (tests/kernels/interp_support.py
    patches its child the same way)."""
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


def poisoned_empty(torch):
    """``(torch.empty, poisoned)``: ``poisoned`` fills fresh floating-point tensors with NaN,
    so an output element no program wrote shows up in a check. The caller installs it as
    ``torch.empty`` and restores the original before timing."""
    orig = torch.empty

    def poisoned(*args, **kwargs):
        t = orig(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    return orig, poisoned

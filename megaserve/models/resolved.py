"""ResolvedModel: a model name turned, once, into its checkpoint directory and config.

Every part of megaserve that needs "which checkpoint, with which architecture" takes a
:class:`ResolvedModel` from its caller instead of resolving the name again; this module is
the one place that calls :func:`~megaserve.models.builtin.resolve_model` and
:meth:`~megaserve.models.config.ModelConfig.from_dir` (tests/architecture checks it). The
object is frozen and picklable, so a worker process receives it rather than a name to
re-resolve.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megaserve.models.builtin import resolve_model
from megaserve.models.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    """``"auto"`` → the checkpoint's dtype; otherwise one of :data:`DTYPES`."""
    if name == "auto":
        name = config.dtype if config.dtype in DTYPES else "float32"
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True)
class ResolvedModel:
    """``name``: as the caller gave it (``builtin:tiny-moe`` or a directory); ``path``: the
    checkpoint directory (a built-in model is generated into the cache first); ``config``:
    its ``config.json``, normalised."""

    name: str
    path: Path
    config: ModelConfig

    @classmethod
    def resolve(cls, name_or_path: str | Path) -> ResolvedModel:
        """Resolve ``name_or_path`` and read its config. Raises ``ValueError`` for an
        unknown built-in name, a path that is not a directory, or a directory without a
        readable, supported ``config.json`` (naming the input or the file)."""
        path = resolve_model(str(name_or_path))
        return cls(str(name_or_path), path, ModelConfig.from_dir(path))

    @property
    def has_tokenizer(self) -> bool:
        """Whether the checkpoint ships a ``tokenizer.json`` (else: token ids only)."""
        return (self.path / "tokenizer.json").is_file()

    def dtype(self, requested: str = "auto") -> torch.dtype:
        """The torch dtype weights are computed in for a requested dtype name (``"auto"``:
        the checkpoint's). Raises ``ValueError`` for an unknown name."""
        return resolve_dtype(requested, self.config)

"""Read tensors from an HF checkpoint directory (single or sharded safetensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointReader:
    """Maps tensor names to safetensors files and reads them on demand.

    Raises ``ValueError`` naming the file for a missing, corrupt or inconsistent checkpoint
    (at construction for the file layout, at :meth:`get` for a tensor).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._handles: dict[Path, object] = {}
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"model: {index} is not a valid safetensors index: {e}") from e
            files = {name: self.path / shard for name, shard in weight_map.items()}
        else:
            single = self.path / SINGLE_FILE
            candidates = [single] if single.is_file() else sorted(self.path.glob("*.safetensors"))
            if not candidates:
                raise ValueError(f"model: no *.safetensors weights in {self.path}")
            files = {}
            for file in candidates:
                for name in self._open(file).keys():
                    files[name] = file
        self._file_of: dict[str, Path] = files

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        if not file.is_file():
            raise ValueError(f"model: weight file {file} listed in the index does not exist")
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"model: cannot read {file}: corrupt or not a safetensors file ({e})") from e
        self._handles[file] = handle
        return handle

    def names(self) -> set[str]:
        return set(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (dtype unchanged); ValueError if absent or unreadable."""
        file = self._file_of.get(name)
        if file is None:
            raise ValueError(f"model: tensor {name!r} missing from the checkpoint in {self.path}")
        try:
            return self._open(file).get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"model: cannot read tensor {name!r} from {file}: {e}") from e

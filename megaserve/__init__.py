"""megaserve: serve Mixture-of-Experts models with disaggregated attention and experts.

``from megaserve import LLM, SamplingParams`` is the Python API. Names are resolved lazily
so that importing the package (and starting the CLI) does not import torch.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "megaserve.entrypoints.llm",
    "SamplingParams": "megaserve.sampling_params",
    "RequestOutputKind": "megaserve.sampling_params",
    "RequestOutput": "megaserve.outputs",
    "CompletionOutput": "megaserve.outputs",
    "AsyncLLMEngine": "megaserve.runtime.async_engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megaserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

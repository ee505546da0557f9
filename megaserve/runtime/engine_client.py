"""EngineClient: the written interface of every engine-shaped class (vLLM's ``EngineClient``).

``LLM``, ``AsyncLLMEngine`` and the servers drive an engine through exactly this: the
one-process :class:`~megaserve.engine.engine.LLMEngine`, the host data plane's front-end
(:class:`~megaserve.runtime.cluster.DisaggregatedEngine`: disaggregated layouts,
co-located expert parallelism, data parallelism) and the device data plane's
(``DevicePlaneEngine``). The engine layer never imports the runtime, so ``LLMEngine``
conforms by shape (``issubclass`` checks the methods, :meth:`EngineClient.__subclasshook__`)
rather than by naming this class; the runtime's front-ends subclass it.

Engines with workers may add ``health() -> WorkerHealth`` (the servers poll it where it
exists) and ``expert_stats`` (expert worker counters).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from megaserve.engine.engine import EngineStats, Prompt
from megaserve.outputs import RequestOutput
from megaserve.sampling_params import SamplingParams

# The attributes an engine sets in its constructor (what front-ends describe the model by).
ATTRIBUTES = ("tokenizer", "model_name", "max_model_len", "vocab_size", "eos_token_ids")


class EngineClient(ABC):
    """A synchronous engine: requests in, one step's outputs at a time out.

    Attributes (set by the constructor): ``tokenizer`` (None for a checkpoint without one),
    ``model_name`` (as the caller named it), ``max_model_len`` (prompt + generated
    tokens), ``vocab_size``, ``eos_token_ids`` (tuple or list of int).
    Not thread-safe unless an implementation says so; ``shutdown`` is idempotent.
    """

    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: Any

    @abstractmethod
    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids; raises ``ValueError`` starting with the bad field.
        Queues nothing."""

    @abstractmethod
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    seed: int | None = None) -> None:
        """Queue a request. ``seed`` None: derived from the engine's seed and the arrival
        order. Raises ``ValueError`` for bad input or a running ``request_id``."""

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request with reason "abort": its last output now, or (front-ends over
        workers) from a later :meth:`step`; None for an unknown id."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """Advance running requests; the outputs produced (each by its ``output_kind``)."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued or running."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Gauges and counters as of the last step (counters never go backwards)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and devices; idempotent."""

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool:
        if cls is not EngineClient:
            return NotImplemented
        return all(callable(getattr(subclass, name, None)) for name in cls.__abstractmethods__)

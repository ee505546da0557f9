"""LLM: the offline Python API (a vLLM-compatible subset)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from megaserve.engine.config import EngineConfig
from megaserve.runtime.factory import make_engine
from megaserve.outputs import RequestOutput
from megaserve.sampling_params import RequestOutputKind, SamplingParams

PromptInput = str | dict[str, Any]


class LLM:
    """Generate with a MoE model in this process.

    ``LLM(model=..., dtype=..., device=..., max_num_seqs=..., max_model_len=...,
    block_size=16, seed=..., **engine_options)`` where ``engine_options`` are the other
    fields of :class:`~megaserve.engine.config.EngineConfig` (``attention_replicas``,
    ``expert_workers``, ``microbatches``, ``transport``, ``data_parallel_size`` and
    ``enable_expert_parallel`` (vLLM's data / co-located expert parallelism),
    ``max_num_batched_tokens``, and the KV
    pool's size: ``gpu_memory_utilization`` (default 0.9 on CUDA), ``kv_cache_memory_bytes``
    or ``num_kv_blocks``). ``device="auto"`` (the default) runs on CUDA where torch sees a GPU.
    Use as a context manager, or call :meth:`shutdown`, to stop worker processes.
    """

    def __init__(
        self,
        model: str = "builtin:tiny-moe",
        dtype: str = "auto",
        device: str = "auto",
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        block_size: int = EngineConfig.block_size,
        seed: int = EngineConfig.seed,
        **engine_options: Any,
    ) -> None:
        config = EngineConfig(
            model=model, dtype=dtype, device=device, max_num_seqs=max_num_seqs,
            max_model_len=max_model_len, block_size=block_size, seed=seed, **engine_options,
        )
        self.engine = make_engine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; returns one RequestOutput per prompt, in order.

        prompts: a str, a list of str, or a list of ``{"prompt_token_ids": [...]}``.
        sampling_params: one for all prompts or a list of the same length (default
        ``SamplingParams()``). Every prompt is validated before any runs, so a bad one
        raises ``ValueError`` (naming the field) and nothing is queued. Requests of the
        default output kind run as FINAL_ONLY (as in vLLM): only the final output is
        built.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts"
            )
        inputs = [_prompt_of(p) for p in prompts]
        for prompt, params in zip(inputs, sampling_params):
            self.engine.validate(prompt, params)
        sampling_params = [
            dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
            if p.output_kind is RequestOutputKind.CUMULATIVE else p
            for p in sampling_params]
        request_ids = [f"llm-{next(self._ids)}" for _ in inputs]
        for request_id, prompt, params in zip(request_ids, inputs, sampling_params):
            self.engine.add_request(request_id, prompt, params)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in request_ids]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _prompt_of(prompt: PromptInput) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError(
        "prompt: expected a str or a dict with 'prompt_token_ids', got "
        f"{type(prompt).__name__}"
    )

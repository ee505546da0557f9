"""The workload the layout tests compare bitwise with one engine: five prompts of uneven
length under greedy, seeded, seed-derived and top-k sampling, with and without logprobs."""

from __future__ import annotations

from megaserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [(7 * i + j) % 500 for j in range(3 + 9 * i)]} for i in range(5)]
PARAMS = [
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True, logprobs=1),
    SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, logprobs=1),  # seed derived
    SamplingParams(max_tokens=6, temperature=0.8, seed=9, top_k=20, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
]


def signature(outs):
    """What must be bitwise equal: each request's token ids and logprobs."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def single_engine_signature():
    """The workload on the one-process engine (builtin:tiny-moe, float32)."""
    with LLM(dtype="float32") as llm:
        return signature(llm.generate(PROMPTS, PARAMS))


def run_with_steady_steps_under(engine, prompts, max_tokens: int, warm_steps: int,
                                mode: str = "error", steady_steps: int = 6) -> dict[str, list[int]]:
    """Greedy requests ``r0..`` (token id lists ``prompts``, no logprobs: a step returning
    them reads its tokens first, by design) through ``engine.step()``: ``warm_steps`` steps
    (prefill, then decode graphs captured), ``steady_steps`` steps with the engine's
    ``step_sync_debug`` set to ``mode`` (every role launches its step under
    ``torch.cuda.set_sync_debug_mode(mode)``), then to the end. Returns each request's
    token ids; asserts that every steady step ran and no worker was restarted."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {}

    def collect(outs) -> None:
        for out in outs:
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids

    for _ in range(warm_steps):
        collect(engine.step())
    engine.step_sync_debug = mode
    steady = 0
    while engine.has_unfinished_requests() and steady < steady_steps:
        collect(engine.step())
        steady += 1
    engine.step_sync_debug = None
    while engine.has_unfinished_requests():
        collect(engine.step())
    assert steady == steady_steps, f"only {steady} steps were left to run under {mode!r}"
    assert engine.health().restarts == 0, engine.health()
    return outputs

"""A dead engine makes the server refuse work instead of failing each request forever."""

from __future__ import annotations

import asyncio

import pytest

from megaserve.sampling_params import SamplingParams
from megaserve.server.core import ServerState, ServingCore
from megaserve.server.errors import ErrorCode, RequestError


def test_engine_thread_failure_marks_the_server_failed(model_cache):
    from megaserve.engine.async_engine import AsyncLLMEngine, EngineDeadError

    async def scenario():
        engine = AsyncLLMEngine(model="builtin:tiny-moe", dtype="float32", device="cpu",
                                max_num_seqs=4, max_model_len=256, seed=0)

        def broken_step():  # a fault inside the real engine thread, e.g. a device error
            raise RuntimeError("simulated device fault")

        engine.engine.step = broken_step
        core = ServingCore("builtin:tiny-moe", max_num_seqs=4, max_waiting=4)
        core.engine, core.state = engine, ServerState.SERVING
        params = SamplingParams(max_tokens=4, temperature=0.0)
        with core.admit("r1") as rid:
            ids = await core.prepare("hello", params)
            with pytest.raises(EngineDeadError):
                async for _ in core.stream(rid, ids, params):
                    pass
        assert core.state is ServerState.FAILED and core.failed.is_set()
        with pytest.raises(RequestError) as e:
            with core.admit("r2"):
                pass
        assert e.value.code is ErrorCode.UNAVAILABLE and "restart" in e.value.message
        await engine.shutdown()

    asyncio.run(scenario())

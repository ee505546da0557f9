"""A dead engine makes the server refuse work instead of failing each request forever."""

from __future__ import annotations

import asyncio

import pytest

from megaserve.sampling_params import SamplingParams
from megaserve.server.core import ServerState, ServingCore
from megaserve.server.errors import ErrorCode, RequestError


def test_engine_thread_failure_marks_the_server_failed(model_cache):
    from megaserve.runtime.async_engine import AsyncLLMEngine, EngineDeadError

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


def test_engine_failure_reaches_clients_without_internals(model_cache):
    """An engine fault whose message carries a worker's traceback: HTTP and gRPC clients
    get a short error naming no file, line or exception text; the log has the details."""
    import grpc
    from aiohttp import web

    from megaserve.runtime.async_engine import AsyncLLMEngine
    from megaserve.server.client import build_request, generation_stub
    from megaserve.server.grpc_service import GenerationService, build_grpc_server
    from megaserve.server.openai_http import build_app

    from .conftest import free_port, http_post
    from .test_hostile import assert_clean

    secret = 'Traceback (most recent call last):\n  File "/secret/worker.py", line 7'

    async def scenario():
        engine = AsyncLLMEngine(model="builtin:tiny-moe", dtype="float32", device="cpu",
                                max_num_seqs=4, max_model_len=256, seed=0)

        def broken_step():
            raise RuntimeError(secret)

        engine.engine.step = broken_step
        core = ServingCore("builtin:tiny-moe", max_num_seqs=4, max_waiting=4)
        core.engine, core.state = engine, ServerState.SERVING
        runner = web.AppRunner(build_app(core))
        await runner.setup()
        http_port, grpc_port = free_port(), free_port()
        await web.TCPSite(runner, "127.0.0.1", http_port).start()
        server, _ = build_grpc_server(GenerationService(core, "float32", "cpu"),
                                      f"127.0.0.1:{grpc_port}")
        await server.start()
        try:
            status, body = await asyncio.to_thread(
                http_post, f"http://127.0.0.1:{http_port}/v1/completions",
                {"prompt": "boom", "max_tokens": 3})
            core.state = ServerState.SERVING  # let the gRPC call reach the dead engine too

            def grpc_call():
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                    try:
                        list(generation_stub(channel)["Generate"](build_request("boom"),
                                                                  timeout=30))
                    except grpc.RpcError as e:
                        return e.code(), e.details()
                return None, ""
            code, details = await asyncio.to_thread(grpc_call)
        finally:
            await server.stop(0)
            await runner.cleanup()
            await engine.shutdown()
        return status, body, code, details

    status, body, code, details = asyncio.run(scenario())
    assert status == 500 and body["error"]["type"] == "internal_error", body
    for message in (body["error"]["message"], details):
        assert_clean(message)
        assert "secret" not in message and "see the server log" in message
    assert code is not None


def test_gauges_read_idle_after_an_engine_failure(model_cache):
    """The engine dies mid-request: running, waiting and KV usage read 0 (the engine's
    last report froze them at the in-flight request); health and GetServerInfo agree."""
    from megaserve.runtime.async_engine import AsyncLLMEngine, EngineDeadError
    from megaserve.server.grpc_service import GenerationService
    from megaserve.server.metrics import parse_text

    from .conftest import LABEL

    async def scenario():
        engine = AsyncLLMEngine(model="builtin:tiny-moe", dtype="float32", device="cpu",
                                max_num_seqs=4, max_model_len=256, seed=0)
        real_step, steps = engine.engine.step, []

        def step_then_fault():  # two real steps (the request runs, holds blocks), then a fault
            steps.append(1)
            if len(steps) > 2:
                raise RuntimeError("simulated device fault")
            return real_step()

        engine.engine.step = step_then_fault
        core = ServingCore("builtin:tiny-moe", max_num_seqs=4, max_waiting=4)
        core.engine, core.state = engine, ServerState.SERVING
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        with core.admit("r1") as rid:
            ids = await core.prepare("hello there", params)
            with pytest.raises(EngineDeadError):
                async for _ in core.stream(rid, ids, params):
                    pass
        assert engine.stats().num_running == 1  # the engine's last report
        m = parse_text(core.metrics.render().decode())
        assert m[f"vllm:num_requests_running{LABEL}"] == 0
        assert m[f"vllm:num_requests_waiting{LABEL}"] == 0
        assert m[f"megaserve:num_requests_in_flight{LABEL}"] == 0
        assert m[f"vllm:kv_cache_usage_perc{LABEL}"] == 0
        assert m[f"megaserve:num_free_kv_blocks{LABEL}"] == m[f"megaserve:num_kv_blocks{LABEL}"] > 0
        info = await GenerationService(core, "float32", "cpu").GetServerInfo(None, None)
        assert info.state == core.health().state == "FAILED" and not core.health().serving
        assert (info.num_running, info.num_free_kv_blocks) == (0, info.num_kv_blocks)
        await engine.shutdown()

    asyncio.run(scenario())

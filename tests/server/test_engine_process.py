"""The server's engine runs in a process of its own (megaserve.runtime.async_engine): it
serves the same outputs, a dead engine process fails the server cleanly, and the engine
process does not outlive the server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request, generation_stub

from .conftest import http_get, http_post, ready_server


def _stat(pid: int) -> tuple[str, int]:
    """(comm, parent pid) of a live process."""
    text = Path(f"/proc/{pid}/stat").read_text()
    comm = text[text.index("(") + 1:text.rindex(")")]
    return comm, int(text[text.rindex(")") + 2:].split()[1])


def engine_pids(server_pid: int) -> list[int]:
    """Processes named megaserve-core below ``server_pid`` (a forkserver sits between)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm, ppid = _stat(int(entry))
            ancestors = [ppid]
            while ancestors[-1] > 1 and len(ancestors) < 4:
                ancestors.append(_stat(ancestors[-1])[1])
        except (OSError, ValueError, IndexError):
            continue
        if comm == "megaserve-core" and server_pid in ancestors:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return text[text.rindex(")") + 2] != "Z"


@pytest.fixture()
def own_server(model_cache, tmp_path):
    with ready_server(tmp_path / "server.log", model_cache, "--dtype", "float32",
                      "--max-num-seqs", "8", "--max-model-len", "512") as srv:
        yield srv


def test_engine_runs_in_its_own_process(server):
    pids = engine_pids(server.proc.pid)
    assert len(pids) == 1 and pids[0] != server.proc.pid


def test_killed_engine_process_fails_the_server_cleanly(own_server):
    (pid,) = engine_pids(own_server.proc.pid)
    with grpc.insecure_channel(own_server.grpc_address) as channel:
        stub = generation_stub(channel)
        assert list(stub["Generate"](build_request("warm up", max_tokens=2), timeout=30))
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60  # bounds a hang; the health loop notices in ~0.1 s
        while http_get(own_server.url + "/health")[0] == 200:  # no request needed to notice
            assert time.monotonic() < deadline, own_server.log()
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as e:
            list(stub["Generate"](build_request("after"), timeout=60))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "restart" in e.value.details()
    status, body = http_post(own_server.url + "/v1/completions", {"prompt": "after"})
    assert status == 503 and body["error"]["message"], body
    assert "engine failed" in own_server.log()


def test_engine_process_exits_with_the_server(own_server):
    (pid,) = engine_pids(own_server.proc.pid)
    own_server.proc.kill()  # no drain, no shutdown message: the command pipe closes
    own_server.proc.wait()
    deadline = time.monotonic() + 60
    while alive(pid):
        assert time.monotonic() < deadline, "the engine process outlived its server"
        time.sleep(0.05)


def test_async_engine_in_a_process_equals_the_thread(model_cache):
    """Both drivers of AsyncLLMEngine give the same bits, streamed as deltas; a bad model
    path fails the constructor with a ValueError naming it."""
    from megaserve.runtime.async_engine import AsyncLLMEngine
    from megaserve.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)

    async def run(engine_process: bool) -> list[tuple]:
        engine = AsyncLLMEngine(engine_process=engine_process, model="builtin:tiny-moe",
                                dtype="float32", device="cpu", max_num_seqs=4,
                                max_model_len=256)
        try:
            async def one(i: int) -> tuple:
                ids, text, logprobs = [], "", []
                async for out in engine.generate(f"r{i}", f"prompt number {i}", params):
                    ids += out.outputs[0].token_ids
                    text += out.outputs[0].text
                    logprobs += out.outputs[0].logprobs
                assert out.prompt == f"prompt number {i}" and out.prompt_token_ids
                return ids, text, logprobs, out.outputs[0].finish_reason
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await engine.shutdown()

    in_thread, in_process = asyncio.run(run(False)), asyncio.run(run(True))
    assert in_process == in_thread
    assert all(len(ids) == 12 for ids, *_ in in_process)
    with pytest.raises(ValueError, match="no-such-model"):
        AsyncLLMEngine(engine_process=True, model="/no-such-model", device="cpu")


def test_a_slow_consumer_gets_merged_deltas(model_cache):
    """A DELTA stream whose consumer falls behind gets fewer outputs holding the same
    tokens, text and logprobs (vLLM's RequestOutputCollector); a cumulative stream still
    gets one output a token."""
    from megaserve.runtime.async_engine import AsyncLLMEngine
    from megaserve.sampling_params import RequestOutputKind, SamplingParams

    async def run() -> tuple:
        engine = AsyncLLMEngine(model="builtin:tiny-moe", dtype="float32", device="cpu",
                                max_num_seqs=4, max_model_len=256)
        try:
            async def consume(request_id: str, kind: RequestOutputKind, delay: float):
                params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=1,
                                        ignore_eos=True, output_kind=kind)
                outs = []
                async for out in engine.generate(request_id, "the same prompt", params):
                    outs.append((list(out.outputs[0].token_ids), out.outputs[0].text,
                                 list(out.outputs[0].logprobs), out.finished))
                    await asyncio.sleep(delay)
                return outs
            fast = await consume("fast", RequestOutputKind.DELTA, 0)
            slow = await consume("slow", RequestOutputKind.DELTA, 0.05)
            cumulative = await consume("cum", RequestOutputKind.CUMULATIVE, 0.05)
            return fast, slow, cumulative
        finally:
            await engine.shutdown()

    fast, slow, cumulative = asyncio.run(run())

    def joined(outs):
        return ([t for o in outs for t in o[0]], "".join(o[1] for o in outs),
                [p for o in outs for p in o[2]])
    assert len(joined(fast)[0]) == 40 and len(slow) < min(20, len(fast)) and slow[-1][3]
    assert joined(slow) == joined(fast)
    assert len(cumulative) == 40 and cumulative[-1][:3] == joined(fast)

"""A checkpoint without a tokenizer is served in token ids: the model's info names its
EOS ids from the config, generation works on ids, and text-only features refuse clearly."""

from __future__ import annotations

import json

import grpc
import pytest

from megaserve.server import generation_pb2 as pb
from megaserve.server.client import build_request, generation_stub

from .conftest import http_post, ready_server


@pytest.fixture(scope="module")
def ids_server(model_cache, tmp_path_factory):
    from tests.megaserve.hf_models import make_checkpoint

    path = tmp_path_factory.mktemp("no-tokenizer")
    make_checkpoint(path, "qwen3_moe", eos_token_id=7)
    assert not (path / "tokenizer.json").exists()
    with ready_server(tmp_path_factory.mktemp("ids-server") / "server.log", model_cache,
                      "--model", str(path), "--dtype", "float32", "--max-num-seqs", "4") as srv:
        yield srv, path


def test_model_info_and_generation_in_token_ids(ids_server):
    srv, path = ids_server
    with grpc.insecure_channel(srv.grpc_address) as channel:
        stub = generation_stub(channel)
        info = stub["GetModelInfo"](pb.GetModelInfoRequest(), timeout=60)
        assert list(info.eos_token_ids) == [7]
        assert info.vocab_size == json.loads((path / "config.json").read_text())["vocab_size"]
        replies = list(stub["Generate"](build_request([3, 4, 5], max_tokens=6, ignore_eos=True,
                                                      temperature=0.0), timeout=30))
    complete = replies[-1].complete
    assert len(complete.output_ids) == 6 and complete.text == ""
    status, body = http_post(srv.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages", body
    assert "tokenizer" in body["error"]["message"]

"""Start-up checks: what cannot run fails before the server reports SERVING."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from megaserve.entrypoints.preflight import check_runtime, max_supported_len
from megaserve.models.builtin import TINY_MOE_CONFIG
from megaserve.models.config import ModelConfig, YarnScaling
from megaserve.server.app import ServeConfig, serve

from .conftest import MODEL, free_port


def test_a_model_that_loads_but_cannot_run_fails_start_up(model_cache, caplog):
    """float16 on CPU passes the engine's config (the CLI refuses it earlier): the warm-up
    request fails start-up with exit code 1 instead of the first client's request."""
    config = ServeConfig(engine={"model": MODEL, "dtype": "float16", "device": "cpu",
                                 "max_num_seqs": 4, "max_model_len": 256},
                         host="127.0.0.1", grpc_port=free_port(), http_port=free_port(),
                         grace_period=1.0)
    with caplog.at_level(logging.INFO, logger="megaserve.server.app"):
        assert asyncio.run(serve(config)) == 1
    messages = [r.getMessage() for r in caplog.records]
    assert any("loading builtin:tiny-moe failed" in m for m in messages), messages
    assert not any(m.startswith("megaserve: serving") for m in messages), messages


def test_max_model_len_is_bounded_by_positions_unless_rope_scaling_extends_them():
    plain = ModelConfig.from_hf_dict(TINY_MOE_CONFIG)
    assert max_supported_len(plain) == 4096
    check_runtime({"model": MODEL, "max_model_len": 4096})
    with pytest.raises(ValueError, match="max_model_len 4097 .* 4096 positions"):
        check_runtime({"model": MODEL, "max_model_len": 4097})
    yarn = dataclasses.replace(plain, rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=4096))
    assert max_supported_len(yarn) == 16384
    assert max_supported_len(dataclasses.replace(yarn, max_position_embeddings=32768)) == 32768

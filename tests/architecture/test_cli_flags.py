"""One fact, one place: the CLI's engine flags are derived from EngineConfig.

Every flag that sets an :class:`EngineConfig` field is one row of
``generate_cli.ENGINE_FLAGS``: its default is the field's default (never restated), the
parsed value reaches EngineConfig unchanged, and no command adds a second flag for a field
the table covers. The commands are read through their real ``--help`` output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re

import pytest

from megaserve.engine.config import EngineConfig
from megaserve.entrypoints.generate_cli import (ENGINE_FLAGS, EngineFlag, add_runtime_flags,
                                                runtime_options)

CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
# Commands that take the runtime flags: (megaserve argv) -> its --help must list each flag once.
COMMANDS = (["generate"], ["serve"], ["bench", "throughput"], ["bench", "decode"])
# Flags outside ENGINE_FLAGS whose name is an EngineConfig field's -> why.
OWN_FLAGS = {
    ("serve", "--seed"): "the engine seed; generate's --seed is the request's (a sampling flag)",
    ("generate", "--seed"): "the request's seed (a sampling flag), not EngineConfig.seed",
    ("throughput", "--seed"): "the seed of the benchmark's random prompts",
    ("serve", "--launcher"): "serve only (generate and bench run their workers locally); "
                             "checked with --ray-address in server/cli.py's _launcher_options",
    ("serve", "--ray-address"): "as --launcher",
}
# A value other than the default for each field's flag: (argv, value in the options).
CHANGED = {
    "model": (["--model", "/tmp/ckpt"], "/tmp/ckpt"),
    "dtype": (["--dtype", "float32"], "float32"),
    "quantization": (["--quantization", "fp8"], "fp8"),
    "device": (["--device", "cpu"], "cpu"),
    "max_model_len": (["--max-model-len", "64"], 64),
    "max_num_seqs": (["--max-num-seqs", "8"], 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512),
    "block_size": (["--block-size", "32"], 32),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "kv_cache_memory_bytes": (["--kv-cache-memory-bytes", "4096"], 4096),
    "attention_replicas": (["--attention-replicas", "2"], 2),
    "expert_workers": (["--expert-workers", "3"], 3),
    "microbatches": (["--microbatches", "2"], 2),
    "data_parallel_size": (["--data-parallel-size", "2", "--attention-replicas", "2"], 2),
    "enable_expert_parallel": (["--enable-expert-parallel"], True),
    "attention_gpus": (["--attention-gpus", "0,1"], (0, 1)),
    "expert_gpus": (["--expert-gpus", "2"], (2,)),
    "transport": (["--transport", "tcp"], "tcp"),
    "aggregation": (["--aggregation", "lockstep"], "lockstep"),
    "expert_aggregation_wait_ms": (["--expert-aggregation-wait-ms", "2"], 2.0),
    "disaggregate": (["--disaggregate"], True),
    "data_plane": (["--data-plane", "host"], "host"),
    "cuda_graphs": (["--no-cuda-graphs"], False),
    "async_scheduling": (["--async-scheduling"], True),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "speculative_config": (['--speculative-config', '{"num_speculative_tokens": 2}'],
                           '{"num_speculative_tokens": 2}'),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_runtime_flags(parser)
    return parser


def _help(argv: list[str]) -> str:
    from megaserve.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main([*argv, "--help"])
        except SystemExit as e:  # argparse's --help exits; some commands return instead
            code = int(e.code or 0)
    assert code == 0, out.getvalue()[-2000:]
    return out.getvalue()


def test_every_row_names_one_field_and_one_flag():
    fields = [entry.field for entry in ENGINE_FLAGS]
    flags = [entry.flag for entry in ENGINE_FLAGS]
    assert not set(fields) - set(CONFIG_FIELDS), "rows for fields EngineConfig does not have"
    assert len(set(fields)) == len(fields) and len(set(flags)) == len(flags)


def test_defaults_are_the_config_defaults():
    """No flag restates a default: with no flags, the options are EngineConfig's defaults."""
    options = runtime_options(_parser().parse_args([]))
    assert set(options) == {entry.field for entry in ENGINE_FLAGS}
    assert options == {name: CONFIG_FIELDS[name].default for name in options}
    EngineConfig(**options)  # and EngineConfig takes them


@pytest.mark.parametrize("entry", ENGINE_FLAGS, ids=lambda e: e.flag)
def test_each_flag_sets_its_field(entry):
    argv, value = CHANGED[entry.field]
    assert value != CONFIG_FIELDS[entry.field].default
    assert runtime_options(_parser().parse_args(argv))[entry.field] == value


def test_a_row_may_not_restate_a_default():
    with pytest.raises(ValueError, match="come from EngineConfig"):
        EngineFlag("--block-size", "block_size", dict(type=int, default=16))
    with pytest.raises(ValueError, match="must start with"):
        EngineFlag("block-size", "block_size")


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_commands_expose_each_config_field_through_one_flag(argv):
    """Every command taking the runtime flags lists every row's flag, and no other flag of
    its named after an EngineConfig field unless :data:`OWN_FLAGS` says why."""
    text = _help(argv)
    listed = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text)
    for entry in ENGINE_FLAGS:
        assert entry.flag in listed, f"megaserve {' '.join(argv)} --help lacks {entry.flag}"
    table = {entry.flag for entry in ENGINE_FLAGS} | {"--no-enable-prefix-caching"}
    extra = {flag for flag in listed if flag not in table
             and flag[2:].replace("-", "_") in CONFIG_FIELDS
             and (argv[-1], flag) not in OWN_FLAGS}
    assert not extra, f"megaserve {' '.join(argv)}: {sorted(extra)} restate EngineConfig " \
                      "fields outside ENGINE_FLAGS"

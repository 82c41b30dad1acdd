"""limits.max_context beyond the target's trained positions is refused, unless allowed explicitly."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.config import EngineConfig, LimitsConfig, ModelConfig, engine_config_from
from engine.model.pair import trained_positions
from engine.runtime import Engine
from engine.types import ConfigError
from tests.helpers.tiny_models import make_tiny_pair

TRAINED = 512  # tests.helpers.tiny_models: max_position_embeddings


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("context"), draft="noisy", seed=4)
    return str(target), str(draft)


def load(pair, **limits) -> Engine:
    return Engine.load(EngineConfig(model=ModelConfig(target=pair[0], draft=pair[1]), limits=LimitsConfig(**limits)))


def test_a_context_beyond_the_trained_positions_is_refused_saying_why(pair):
    with pytest.raises(ConfigError) as caught:
        load(pair, max_context=TRAINED + 1)
    message = str(caught.value)
    assert caught.value.field == "limits.max_context"
    assert f"{TRAINED + 1}" in message and f"{TRAINED} positions" in message
    assert "rotary" in message and "--allow-long-context" in message and "allow_long_context" in message


def test_the_override_allows_it_and_the_trained_length_needs_none(pair):
    assert load(pair, max_context=TRAINED * 2, allow_long_context=True).max_context == TRAINED * 2
    assert load(pair, max_context=TRAINED).max_context == TRAINED
    assert load(pair).max_context == TRAINED  # the default: the trained positions (capped at 8192)


def test_rope_scaling_extends_the_trained_positions():
    assert trained_positions({"max_position_embeddings": 4096}) == 4096
    yarn = {"max_position_embeddings": 32768,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert trained_positions(yarn) == 131072
    llama3 = {"max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}}
    assert trained_positions(llama3) == 131072
    assert trained_positions({}) is None


def test_the_flag_and_the_file_field_set_the_override(pair):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--target", pair[0], "--draft", pair[1], "--max-context", "1024", "--allow-long-context"])
    config, _ = engine_config_from_args(args)
    assert config.limits.allow_long_context and config.limits.max_context == 1024
    args = parser.parse_args(["--target", pair[0], "--draft", pair[1]])
    assert not engine_config_from_args(args)[0].limits.allow_long_context
    from_file = engine_config_from({"limits": {"max_context": 1024, "allow_long_context": True}})
    assert from_file.limits.allow_long_context
    with pytest.raises(ConfigError, match="limits.allow_long_context"):
        engine_config_from({"limits": {"allow_long_context": "yes"}})


@pytest.mark.slow
def test_the_cli_refuses_with_one_line_naming_the_field(pair):
    args = [sys.executable, "-m", "specexec", "generate", "--target", pair[0], "--draft", pair[1], "--prompt", "x",
            "--max-tokens", "4", "--max-context", str(TRAINED * 2)]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "limits.max_context" in lines[0], refused.stderr
    allowed = subprocess.run([*args, "--allow-long-context"], capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0, allowed.stderr

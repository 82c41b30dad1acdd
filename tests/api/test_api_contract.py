"""The server <-> engine contract: the real Engine (loaded on a tiny pair) and the tests' FakeEngine
both provide every member of `engine.types.GenerationEngine`, with the contract's signatures."""

from __future__ import annotations

import inspect
import typing
from pathlib import Path

import pytest

from engine.config import EngineConfig, ModelConfig
from engine.runtime import Engine
from engine.types import GenerationEngine
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tiny_models import make_tiny_pair

METHODS = sorted(name for name, value in vars(GenerationEngine).items()
                 if callable(value) and not name.startswith("_"))
ATTRIBUTES = typing.get_type_hints(GenerationEngine)
PROPERTIES = sorted(name for name, value in vars(GenerationEngine).items() if isinstance(value, property))


def test_the_contract_names_what_the_server_uses() -> None:
    assert METHODS == ["abort_request", "add_request", "close", "step", "validate_request", "validate_structured_output"]
    assert set(ATTRIBUTES) == {"tokenizer", "model_name", "max_context", "eos_token_ids", "max_running"}
    assert PROPERTIES == ["can_add"]


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    target, draft = make_tiny_pair(Path(tmp_path_factory.mktemp("pair")))
    return Engine.load(EngineConfig(model=ModelConfig(target=str(target), draft=str(draft))))


@pytest.fixture(params=["real", "fake"])
def engine(request: pytest.FixtureRequest) -> object:
    return request.getfixturevalue("real_engine") if request.param == "real" else FakeEngine()


def test_engine_has_every_attribute_of_the_contract(engine: object) -> None:
    for name, annotation in ATTRIBUTES.items():
        assert hasattr(engine, name), f"{type(engine).__name__} lacks {name}"
        expected = typing.get_origin(annotation) or annotation
        if expected is not typing.Any:
            assert isinstance(getattr(engine, name), expected), f"{type(engine).__name__}.{name}"


def test_engine_has_every_property_of_the_contract(engine: object) -> None:
    for name in PROPERTIES:
        assert isinstance(getattr(engine, name), bool), f"{type(engine).__name__}.{name}"


def test_engine_implements_every_method_of_the_contract(engine: object) -> None:
    for name in METHODS:
        method = getattr(type(engine), name, None)
        assert method is not None and method is not getattr(GenerationEngine, name), (
            f"{type(engine).__name__} does not implement {name}"
        )
        want = list(inspect.signature(getattr(GenerationEngine, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got == want, f"{type(engine).__name__}.{name}{got} != contract {want}"

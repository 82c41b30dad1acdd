"""dtype `auto`: float32 off CUDA; on CUDA the checkpoint's bfloat16 where the GPU computes in it
(compute capability 8.0+), float16 otherwise; an explicit dtype is taken as given."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig, ModelConfig, SpeculationConfig
from engine.model import checkpoint
from engine.model.pair import load_pair
from tests.helpers.tiny_models import make_tiny_pair

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def capability(monkeypatch):
    """Fake the CUDA compute capability query (no real CUDA call); `set(None)`: any query fails."""

    def set_capability(value: tuple[int, int] | None) -> None:
        def query(device=None) -> tuple[int, int]:
            if value is None:
                raise AssertionError("the CUDA capability must not be queried here")
            return value

        monkeypatch.setattr(torch.cuda, "get_device_capability", query)

    return set_capability


@pytest.mark.parametrize(
    ("config", "gpu", "want"),
    [
        ({"dtype": "bfloat16"}, (8, 0), torch.bfloat16),  # Llama-3 / Qwen2.5 on an A100
        ({"torch_dtype": "bfloat16"}, (8, 9), torch.bfloat16),  # the key transformers < 5 writes
        ({"torch_dtype": "torch.bfloat16"}, (9, 0), torch.bfloat16),
        ({"dtype": "bfloat16"}, (7, 5), torch.float16),  # pre-Ampere: no bf16 units
        ({"dtype": "bfloat16"}, (6, 0), torch.float16),
        ({"torch_dtype": "float16"}, (8, 0), torch.float16),
        ({"torch_dtype": "float16"}, (7, 0), torch.float16),
        ({"dtype": "float32"}, (8, 0), torch.float16),
        ({}, (8, 0), torch.float16),  # unknown
        ({"dtype": None, "torch_dtype": "bfloat16"}, (8, 0), torch.bfloat16),
    ],
)
def test_auto_on_cuda_takes_the_checkpoints_half_dtype_where_supported(capability, config, gpu, want):
    capability(gpu)
    assert checkpoint.resolve_dtype("auto", CUDA, config) == want


@pytest.mark.parametrize("stored", ["bfloat16", "float16", "float32", None])
def test_auto_off_cuda_is_float32(capability, stored):
    capability(None)
    assert checkpoint.resolve_dtype("auto", CPU, {"dtype": stored}) == torch.float32


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize(("name", "want"), list(checkpoint.DTYPES.items()))
def test_explicit_dtype_is_taken_as_given(capability, device, name, want):
    capability(None)
    assert checkpoint.resolve_dtype(name, device, {"dtype": "bfloat16"}) == want


def test_load_pair_resolves_auto_from_the_target_checkpoint(tmp_path, monkeypatch):
    target, draft = make_tiny_pair(tmp_path)
    config_file = target / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "dtype": "bfloat16"}))
    seen: list[tuple[str, torch.device, dict]] = []
    real = checkpoint.resolve_dtype

    def recording(dtype: str, device: torch.device, config: dict) -> torch.dtype:
        seen.append((dtype, device, config))
        return real(dtype, device, config)

    monkeypatch.setattr(checkpoint, "resolve_dtype", recording)
    cfg = EngineConfig(
        model=ModelConfig(target=str(target), draft=str(draft)), speculation=SpeculationConfig(budget=4)
    )
    pair = load_pair(cfg)
    assert [(dtype, device.type, config["dtype"]) for dtype, device, config in seen] == [
        ("auto", "cpu", "bfloat16")
    ]
    assert pair.draft is not None
    for runner in (pair.target, pair.draft):
        dtypes = {p.dtype for layer in runner.hf_layers for p in layer.parameters()}
        assert dtypes | {runner.lm_head.weight.dtype} == {torch.float32}

"""Device faults and out-of-memory: CUDA errors take the engine down (/health 503), an OOM fails one request.

Faults are injected into a real tiny engine (the step as engine.runtime calls it, or the offload
ring's device copy) and observed through Engine.generate and through the real app.
"""

from __future__ import annotations

import weakref

import httpx
import pytest
import torch

from engine import runtime
from engine.config import EngineConfig, LimitsConfig, ModelConfig, OffloadConfig, SpeculationConfig
from engine.model import faults
from engine.runtime import Engine
from engine.types import EngineFault, OffloadError, OutOfMemory, SamplingParams
from tests.helpers.sse_helpers import post_stream
from tests.helpers.tiny_models import make_tiny_pair

CUDA_ERROR = "CUDA error: an illegal memory access was encountered"
OOM = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.55 GiB"
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("exc, fault", [
    (RuntimeError(CUDA_ERROR), True),
    (RuntimeError("CUDA driver error: unknown error"), True),
    (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"), True),
    (RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR"), True),
    (torch.AcceleratorError("an illegal instruction was encountered"), True),
    (torch.OutOfMemoryError(OOM), False),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("CUDA error: not a RuntimeError"), False),
])
def test_device_fault_classification(exc: BaseException, fault: bool) -> None:
    assert faults.is_device_fault(exc) is fault
    assert faults.is_out_of_memory(exc) is isinstance(exc, torch.OutOfMemoryError)


def test_an_offload_error_is_a_fault_only_when_a_cuda_error_caused_it() -> None:
    def chained(cause: BaseException) -> OffloadError:
        try:
            try:
                raise cause
            except Exception as exc:
                raise OffloadError("loading target layer 3 from ram failed") from exc
        except OffloadError as exc:
            return exc

    assert faults.is_device_fault(chained(RuntimeError(CUDA_ERROR)))
    assert not faults.is_device_fault(chained(OSError("short read")))


# -- a real tiny engine -------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    target, draft = make_tiny_pair(tmp_path_factory.mktemp("pair"), arch="llama", draft="noisy", seed=8)
    return str(target), str(draft)


def load(pair: tuple[str, str], **offload) -> Engine:
    return Engine.load(EngineConfig(
        model=ModelConfig(target=pair[0], draft=pair[1]),
        speculation=SpeculationConfig(budget=8, max_depth=4),
        offload=OffloadConfig(**offload),
        limits=LimitsConfig(max_context=256),
    ))


@pytest.fixture(scope="module")
def tiny_engine(pair) -> Engine:
    return load(pair)


def fail_first_step(monkeypatch, error: BaseException, seen: list | None = None) -> None:
    """engine.runtime.run_batch raises `error` on its next call, then runs normally."""
    run_batch = runtime.run_batch
    pending = [error]

    def step(target, items, side=None):
        if pending:
            if seen is not None:
                seen.append(weakref.ref(items[0].seq.output_counts))
            raise pending.pop()
        return run_batch(target, items, side)

    monkeypatch.setattr(runtime, "run_batch", step)


def test_cuda_error_in_a_step_is_an_engine_fault(tiny_engine, monkeypatch) -> None:
    fail_first_step(monkeypatch, RuntimeError(CUDA_ERROR))
    with pytest.raises(EngineFault, match="illegal memory access"):
        tiny_engine.generate_ids([5, 6, 7], PARAMS)


def test_out_of_memory_fails_one_request_frees_it_and_the_next_runs(tiny_engine, monkeypatch) -> None:
    expected = tiny_engine.generate_ids([5, 6, 7], PARAMS)
    seen: list[weakref.ref] = []
    fail_first_step(monkeypatch, torch.OutOfMemoryError(OOM), seen)
    with pytest.raises(OutOfMemory) as info:
        tiny_engine.generate_ids([5, 6, 7], PARAMS)
    message = str(info.value)
    assert "out of device memory" in message and "Tried to allocate 2.00 GiB" in message
    assert "--budget" in message and "--max-context" in message
    assert info.value.__context__ is None  # the failed request's frames are not kept alive
    assert seen and seen[0]() is None  # the engine freed the request's tensors
    assert tiny_engine.generate_ids([5, 6, 7], PARAMS) == expected


def test_failing_device_copy_in_the_offload_ring_is_an_engine_fault(pair, monkeypatch) -> None:
    engine = load(pair, enabled=True, resident_layers=0)
    streamer = engine.pair.target.layers
    copy = streamer.copier.copy

    def failing_copy(slot, dst, src):
        raise RuntimeError(CUDA_ERROR)

    monkeypatch.setattr(streamer.copier, "copy", failing_copy)
    streamer.restart()  # drop what was prefetched: the next load copies
    with pytest.raises(EngineFault, match="illegal memory access"):
        engine.generate_ids([5, 6, 7], PARAMS)

    def failing_read(slot, dst, src):
        raise OSError("short read")

    monkeypatch.setattr(streamer.copier, "copy", failing_read)
    streamer.restart()
    with pytest.raises(OffloadError) as info:
        engine.generate_ids([5, 6, 7], PARAMS)
    assert not isinstance(info.value, EngineFault)
    monkeypatch.setattr(streamer.copier, "copy", copy)
    assert engine.generate_ids([5, 6, 7], PARAMS)  # the ring restarts; the engine goes on


# -- through the real app ------------------------------------------------------------------


def completion(engine: Engine, **extra) -> dict:
    return {"model": engine.model_name, "prompt": "def add(a, b):", "max_tokens": 8, **extra}


def test_cuda_error_takes_the_server_down(tiny_engine, fake_server, monkeypatch) -> None:
    srv = fake_server(tiny_engine)
    assert httpx.get(srv.url + "/health").status_code == 200
    fail_first_step(monkeypatch, RuntimeError(CUDA_ERROR))
    response = httpx.post(srv.url + "/v1/completions", json=completion(tiny_engine), timeout=60)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "engine_down"
    health = httpx.get(srv.url + "/health")
    assert health.status_code == 503 and "illegal memory access" in health.json()["error"]


def test_out_of_memory_is_an_openai_error_and_the_server_goes_on(tiny_engine, fake_server, monkeypatch) -> None:
    srv = fake_server(tiny_engine)
    fail_first_step(monkeypatch, torch.OutOfMemoryError(OOM))
    response = httpx.post(srv.url + "/v1/completions", json=completion(tiny_engine), timeout=60)
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "out_of_memory")
    assert "out of device memory" in error["message"] and response.headers["x-should-retry"] == "false"
    assert httpx.get(srv.url + "/health").status_code == 200
    ok = httpx.post(srv.url + "/v1/completions", json=completion(tiny_engine), timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]


def test_out_of_memory_while_streaming_is_an_error_event(tiny_engine, fake_server, monkeypatch) -> None:
    srv = fake_server(tiny_engine)
    fail_first_step(monkeypatch, torch.OutOfMemoryError(OOM))
    stream = post_stream(srv.url + "/v1/completions", completion(tiny_engine, stream=True))
    assert stream.status == 200 and stream.data[-1] == "[DONE]"
    error = stream.chunks()[-1]["error"]
    assert error["code"] == "out_of_memory" and "out of device memory" in error["message"]
    again = post_stream(srv.url + "/v1/completions", completion(tiny_engine, stream=True))
    assert again.data[-1] == "[DONE]" and "error" not in again.chunks()[-1]


"""Sampling defaults from the target's generation_config.json (`--generation-config auto|none`).

- Over the real app and a FakeEngine (which records each request's SamplingParams), driven by the
  openai SDK: a request that leaves temperature/top_p out gets the file's values, one that gives them
  keeps its own, `none` gives the API's defaults; /v1/models' entry shows the defaults. Every field of
  the five (temperature, top_p, top_k, min_p, repetition_penalty), left out or sent as null, on chat,
  completions and /v1/responses; /infill keeps llama.cpp's defaults whatever the file says.
- `specexec serve` on a tiny real pair whose generation_config.json says temperature 0.6: a
  completion without temperature reports log-probabilities (those of the distribution it samples
  from) equal to transformers' own log_softmax(logits / 0.6) at the prompt, not / 1.0.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig, LimitsConfig, ModelConfig
from server.app import build_app
from server.config import ServerConfig
from server.sampling_defaults import read_sampling_defaults
from tests.api.conftest import free_port, run_uvicorn
from tests.helpers.fake_engine import FakeEngine

GENERATION_CONFIG = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "bos_token_id": 0, "eos_token_id": 1}
MESSAGES = [{"role": "user", "content": "hi"}]


def write_generation_config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_the_file_sets_only_the_fields_it_names(tmp_path: Path) -> None:
    assert read_sampling_defaults(write_generation_config(tmp_path / "a", GENERATION_CONFIG)) == {
        "temperature": 0.6, "top_p": 0.9}
    qwen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 2048}
    assert read_sampling_defaults(write_generation_config(tmp_path / "q", qwen)) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert read_sampling_defaults(write_generation_config(tmp_path / "b", {"bos_token_id": 0})) == {}
    assert read_sampling_defaults(tmp_path / "missing") == {}


@pytest.fixture
def serve_fake(tmp_path: Path):
    """(mode) -> (openai client, FakeEngine): the real app over a FakeEngine, the target folder holding
    GENERATION_CONFIG."""
    target = write_generation_config(tmp_path / "target", GENERATION_CONFIG)
    running = []

    def start(mode: str, values: dict | None = None, engine: FakeEngine | None = None,
              ) -> tuple[openai.OpenAI, FakeEngine]:
        if values is not None:
            write_generation_config(target, values)
        port, engine = free_port(), engine or FakeEngine()
        engine_config = EngineConfig(model=ModelConfig(target=str(target)), limits=LimitsConfig(default_max_tokens=8))
        app = build_app(engine_config, ServerConfig(port=port, generation_config=mode), engine)
        server, thread = run_uvicorn(app, port)
        running.append((server, thread))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        return client, engine

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=15)


def test_a_request_without_temperature_gets_the_models_and_its_own_values_win(serve_fake) -> None:
    client, engine = serve_fake("auto")
    assert client.models.list().data[0].model_extra["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.9}
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4)
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4, temperature=1.0, top_p=1.0)
    client.completions.create(model="fake-model", prompt="hi", max_tokens=4, top_p=0.5)
    left_out, given, mixed = (request.params for request in engine.requests)
    assert (left_out.temperature, left_out.top_p) == (0.6, 0.9)
    assert (given.temperature, given.top_p) == (1.0, 1.0)
    assert (mixed.temperature, mixed.top_p) == (0.6, 0.5)


EVERY_FIELD = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
NULLS = {name: None for name in EVERY_FIELD}


def sampled(params) -> dict:
    return {name: getattr(params, name) for name in EVERY_FIELD}


def test_every_field_defaults_left_out_or_null_on_chat_completions_and_responses(serve_fake) -> None:
    client, engine = serve_fake("auto", {**EVERY_FIELD, "max_new_tokens": 2048, "bos_token_id": 0})
    assert client.models.list().data[0].model_extra["sampling_defaults"] == EVERY_FIELD
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4)
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4, extra_body=NULLS)
    client.completions.create(model="fake-model", prompt="hi", max_tokens=4, extra_body=NULLS)
    client.responses.create(model="fake-model", input="hi", max_output_tokens=4)
    client.responses.create(model="fake-model", input="hi", max_output_tokens=4, extra_body=NULLS)
    for request in engine.requests:
        assert sampled(request.params) == EVERY_FIELD, request.request_id
    own = {"temperature": 1.2, "top_p": 0.5, "top_k": 3, "min_p": 0.2, "repetition_penalty": 1.3}
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4, temperature=1.2, top_p=0.5,
                                   extra_body={k: own[k] for k in ("top_k", "min_p", "repetition_penalty")})
    client.responses.create(model="fake-model", input="hi", max_output_tokens=4, temperature=1.2, top_p=0.5,
                            extra_body={"top_k": 3, "min_p": 0.2})
    chat, responses = (sampled(request.params) for request in engine.requests[-2:])
    assert chat == own and responses == own | {"repetition_penalty": 1.05}  # Responses has no repetition_penalty


def test_infill_keeps_llama_cpps_defaults_whatever_the_file_says(serve_fake) -> None:
    import httpx

    from tests.api.test_fim import qwen_tokenizer
    from tests.api.test_infill import llama_vscode_body
    from tests.helpers.tool_models import scripted_engine

    client, engine = serve_fake("auto", EVERY_FIELD, scripted_engine(qwen_tokenizer(), "a + b<|fim_pad|>"))
    url = str(client.base_url).removesuffix("/v1/") + "/infill"
    llama_cpp = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}
    for fields in ({}, NULLS):
        body = {k: v for k, v in llama_vscode_body(**fields).items() if k not in ("top_k", "top_p")} | fields
        assert httpx.post(url, json=body, timeout=30).status_code == 200
        assert sampled(engine.requests[-1].params) == llama_cpp


def test_none_keeps_the_apis_defaults(serve_fake) -> None:
    client, engine = serve_fake("none")
    assert client.models.list().data[0].model_extra["sampling_defaults"] == {}
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4)
    assert (engine.requests[0].params.temperature, engine.requests[0].params.top_p) == (1.0, 1.0)


def test_the_flag_is_checked_naming_the_field() -> None:
    from engine.types import ConfigError

    with pytest.raises(ConfigError, match="server.generation_config"):
        ServerConfig(generation_config="yes")


@pytest.mark.slow
def test_the_real_server_samples_at_the_generation_configs_temperature(tiny_pair, tmp_path: Path) -> None:
    """Log-probabilities of a sampled completion are those of its sampling distribution: at 0.6
    they are transformers' log_softmax(logits / 0.6) (and with temperature 1 given, / 1)."""
    from tests.api.conftest import REPO, ServerProcess, serve_command, wait_healthy

    target = tmp_path / "target"
    shutil.copytree(tiny_pair[0], target)
    write_generation_config(target, {"temperature": 0.6, "bos_token_id": 0})
    port = free_port()
    log_path = tmp_path / "serve.log"
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("SPECEXEC_API_KEY", None)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([*serve_command(), "--target", str(target), "--draft", str(tiny_pair[1]),
                                    "--port", str(port), "--budget", "8"],
                                   stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    server = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        assert card.model_extra["sampling_defaults"] == {"temperature": 0.6}
        assert "sampling defaults from the target's generation_config.json" in server.log()
        prompt = [5, 6, 7, 8, 9]
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1].double()
        for temperature, sent in ((0.6, {}), (1.0, {"temperature": 1.0})):
            out = client.completions.create(model=card.id, prompt=prompt, max_tokens=1, logprobs=5, seed=1, **sent)
            got = out.choices[0].logprobs.top_logprobs[0]  # {token text: log-prob}; tiny tokens may share a text
            want = (logits / temperature).log_softmax(-1).topk(5).values
            other = (logits / (1.6 - temperature)).log_softmax(-1).topk(5).values  # the other temperature's
            assert got and all((want - value).abs().min() < 2e-3 for value in got.values()), temperature
            assert any((other - value).abs().min() > 1e-2 for value in got.values()), temperature
    finally:
        server.stop()

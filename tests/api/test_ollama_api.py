"""The Ollama API (/api/*) over raw HTTP, over a FakeEngine that emits a scripted output through a
tool-capable chat template: NDJSON streams and their final object, options -> sampling parameters, format
-> grammar, whole tool calls, model listing, errors in Ollama's shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.helpers.tool_models import HERMES_TEMPLATE, TOOLS, last_prompt, scripted_engine, tool_tokenizer

CALL = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|end|>'
USER = [{"role": "user", "content": "Weather in Paris?"}]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


def server(fake_server: Callable, script: str, **fields: Any) -> Any:
    return fake_server(scripted_engine(tool_tokenizer(HERMES_TEMPLATE), script, tokens_per_step=3), **fields)


def post(srv: Any, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=30, **kwargs)


def lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def check_final(final: dict[str, Any], srv: Any) -> None:
    assert final["done"] is True and final["done_reason"] in ("stop", "length")
    assert final["prompt_eval_count"] == len(srv.engine.requests[-1].prompt_ids) and final["eval_count"] > 0
    assert all(isinstance(final[key], int) and final[key] >= 0 for key in DURATIONS)
    assert final["total_duration"] > 0 and final["eval_duration"] > 0  # the fake engine's step times are made up


def test_chat_streams_ndjson_by_default_and_whole_without_stream(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    chunks = lines(post(srv, "/api/chat", {"model": "fake-model", "messages": USER}))
    assert all(chunk["model"] == "fake-model" and chunk["created_at"].endswith("Z") for chunk in chunks)
    assert [chunk["done"] for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(chunk["message"]["content"] for chunk in chunks) == "It is sunny."
    assert all(chunk["message"]["role"] == "assistant" for chunk in chunks)
    check_final(chunks[-1], srv)
    assert chunks[-1]["message"] == {"role": "assistant", "content": ""} and chunks[-1]["done_reason"] == "stop"
    whole = post(srv, "/api/chat", {"model": "fake-model:latest", "messages": USER, "stream": False}).json()
    assert whole["message"] == {"role": "assistant", "content": "It is sunny."} and whole["model"] == "fake-model:latest"
    check_final(whole, srv)


def test_options_map_to_sampling_parameters(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    options = {"num_predict": 3, "temperature": 0.5, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 0,
               "repeat_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25, "num_ctx": 4096,
               "num_gpu": 99, "num_thread": 8, "typical_p": 1.0, "mirostat": 0}
    body = post(srv, "/api/chat", {"model": "fake-model", "messages": USER, "stream": False, "options": options,
                                   "keep_alive": "5m", "think": False}).json()
    params = srv.engine.requests[-1].params
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.min_p, params.seed) == (
        3, 0.5, 20, 0.9, 0.05, 0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.1, 0.5, 0.25)
    assert body["done_reason"] == "length" and body["eval_count"] == 3
    post(srv, "/api/chat", {"messages": USER, "stream": False, "options": {"num_predict": -1, "seed": -1}})
    params = srv.engine.requests[-1].params
    assert params.max_tokens == srv.engine.max_context - len(srv.engine.requests[-1].prompt_ids)
    stopped = post(srv, "/api/chat", {"messages": USER, "stream": False, "options": {"stop": ["sunny"]}}).json()
    assert stopped["message"]["content"] == "It is " and stopped["done_reason"] == "stop"


def test_tool_calls_come_whole_streamed_and_not(fake_server) -> None:
    srv = server(fake_server, CALL)
    body = {"model": "fake-model", "messages": USER, "tools": TOOLS, "options": {"num_predict": 200}}
    whole = post(srv, "/api/chat", body | {"stream": False}).json()
    calls = whole["message"]["tool_calls"]
    assert whole["message"]["content"] == "Let me check." and whole["done_reason"] == "stop"
    assert [call["function"] for call in calls] == [{"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}]
    chunks = lines(post(srv, "/api/chat", body))
    streamed = [call for chunk in chunks for call in chunk["message"].get("tool_calls", [])]
    assert [call["function"] for call in streamed] == [call["function"] for call in calls]
    assert "".join(chunk["message"]["content"] for chunk in chunks) == "Let me check."
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C, sunny", "tool_name": "get_weather"}]
    post(srv, "/api/chat", {"messages": history, "tools": TOOLS, "stream": False})
    prompt = last_prompt(srv)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in prompt


def test_format_json_and_schema_are_grammars(fake_server) -> None:
    srv = server(fake_server, '{"city": "Paris"}<|end|>')
    post(srv, "/api/chat", {"messages": USER, "stream": False, "format": "json"})
    assert srv.engine.requests[-1].params.structured_output.kind == "json_object"
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = post(srv, "/api/generate", {"prompt": "City?", "stream": False, "format": schema}).json()
    spec = srv.engine.requests[-1].params.structured_output
    assert spec.kind == "json_schema" and json.loads(spec.spec) == schema and json.loads(body["response"])


def test_generate_templates_raw_and_streams(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    chunks = lines(post(srv, "/api/generate", {"model": "fake-model", "prompt": "Weather?", "system": "Be brief."}))
    assert "".join(chunk["response"] for chunk in chunks) == "It is sunny." and chunks[-1]["response"] == ""
    check_final(chunks[-1], srv)
    assert last_prompt(srv).endswith("<|system|>\nBe brief.<|end|>\n<|user|>\nWeather?<|end|>\n<|assistant|>\n")
    whole = post(srv, "/api/generate", {"prompt": "def f(", "raw": True, "stream": False}).json()
    assert whole["response"] == "It is sunny." and last_prompt(srv) == "def f("


def test_load_requests_answer_at_once(fake_server) -> None:
    srv = server(fake_server, "It is sunny.<|end|>")
    chat = post(srv, "/api/chat", {"model": "fake-model", "messages": []}).json()
    generate = post(srv, "/api/generate", {"model": "fake-model", "keep_alive": 0}).json()
    assert chat["done_reason"] == generate["done_reason"] == "load" and chat["done"] and generate["done"]
    assert chat["message"] == {"role": "assistant", "content": ""} and generate["response"] == ""
    assert srv.engine.requests == []


def test_tags_show_ps_version_and_pull(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>", served_model_name=("fake-model", "alias:7b"))
    models = httpx.get(srv.url + "/api/tags").json()["models"]
    assert [m["name"] for m in models] == ["fake-model:latest", "alias:7b"] and models[0]["model"] == models[0]["name"]
    assert set(models[0]["details"]) >= {"format", "family", "families", "parameter_size", "quantization_level"}
    shown = post(srv, "/api/show", {"model": "alias:7b"}).json()
    assert shown["capabilities"] == ["completion", "tools"] and shown["template"] == HERMES_TEMPLATE
    assert any(key.endswith(".context_length") and value == srv.engine.max_context
               for key, value in shown["model_info"].items())
    running = httpx.get(srv.url + "/api/ps").json()["models"]
    assert running[0]["name"] == "fake-model:latest" and running[0]["context_length"] == srv.engine.max_context
    assert httpx.get(srv.url + "/api/version").json()["version"]
    assert post(srv, "/api/pull", {"model": "fake-model", "stream": False}).json() == {"status": "success"}
    assert lines(post(srv, "/api/pull", {"model": "fake-model:latest"})) == [{"status": "success"}]
    post(srv, "/api/generate", {"model": "alias:7b", "prompt": "x", "stream": False})
    assert srv.engine.requests[-1].prompt_ids


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/api/chat", {"model": "llama3", "messages": USER}, 404, "llama3"),
    ("/api/chat", {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, 400, "Images"),
    ("/api/chat", {"messages": USER, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ("/api/chat", {"messages": USER, "options": {"num_predict": -5}}, 400, "options.num_predict"),
    ("/api/chat", {"messages": USER, "options": {"mirostat": 2}}, 400, "mirostat"),
    ("/api/chat", {"messages": USER, "format": "yaml"}, 400, "format"),
    ("/api/chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/api/chat", {"messages": USER, "tools": [{"type": "other"}]}, 400, "tools"),
    ("/api/chat", {"messages": USER, "logprobs": True}, 400, "logprobs"),
    ("/api/generate", {"prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
    ("/api/generate", {"prompt": "x", "context": [1, 2]}, 400, "context"),
    ("/api/generate", {"prompt": 5}, 400, "prompt"),
    ("/api/show", {}, 400, "model"),
    ("/api/show", {"model": "llama3"}, 404, "llama3"),
    ("/api/pull", {"model": "llama3"}, 404, "does not download"),
    ("/api/embed", {"model": "fake-model", "input": "x"}, 400, "embeddings"),
    ("/api/create", {"model": "m", "from": "fake-model"}, 400, "create"),
    ("/api/delete", {"model": "fake-model"}, 400, "delete"),
    ("/api/nothing", {}, 404, "/api/nothing"),
])
def test_bad_requests_get_ollama_shaped_errors(fake_server, path: str, body: dict, status: int, words: str) -> None:
    srv = server(fake_server, "Hi.<|end|>")
    response = post(srv, path, body)
    assert response.status_code == status, (path, body, response.text)
    assert list(response.json()) == ["error"] and words in response.json()["error"], response.json()


def test_api_key_and_content_type_errors_have_ollamas_shape(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>", api_key="secret")
    missing = post(srv, "/api/chat", {"messages": USER})
    assert missing.status_code == 401 and list(missing.json()) == ["error"]
    assert httpx.get(srv.url + "/api/tags").status_code == 401
    keyed = {"authorization": "Bearer secret"}
    assert httpx.get(srv.url + "/api/tags", headers=keyed).status_code == 200
    form = httpx.post(srv.url + "/api/chat", content=b"{}", headers=keyed | {"content-type": "text/plain"})
    assert form.status_code == 415 and list(form.json()) == ["error"]
    assert post(srv, "/api/chat", {"messages": USER, "stream": False}, headers=keyed).json()["done"]


def test_a_failing_generation_ends_the_stream_with_an_error_line(fake_server) -> None:
    srv = server(fake_server, "Hi.<|end|>")
    srv.engine.fail_with = RuntimeError("boom")
    chunks = lines(post(srv, "/api/chat", {"messages": USER}))
    assert list(chunks[-1]) == ["error"] and "boom" in chunks[-1]["error"]
    whole = post(srv, "/api/generate", {"prompt": "x", "stream": False})
    assert whole.status_code == 500 and list(whole.json()) == ["error"]
    srv.engine.fail_with = None
    assert post(srv, "/api/chat", {"messages": USER, "stream": False}).json()["message"]["content"] == "Hi."


def test_a_multimodal_release_is_described_by_its_language_model(tmp_path) -> None:
    """/api/show's family and sizes of a Gemma 3 / Mistral 3 / Qwen3.5 release come from its text_config."""
    from server.ollama_api.models import model_facts

    text = {"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "model_type": "gemma3", "text_config": text}))
    facts = model_facts(str(tmp_path))
    assert facts.family == "gemma3_text"
    assert (facts.config["hidden_size"], facts.config["num_hidden_layers"]) == (5376, 62)

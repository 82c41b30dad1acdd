"""POST /infill with llama.cpp's field names (llama.vscode's requests), streamed and not, over httpx."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from tests.api.test_fim import PREFIX, SUFFIX, qwen_tokenizer
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tool_models import scripted_engine

SCRIPT = "a + b<|fim_pad|>never"


def llama_vscode_body(**fields: object) -> dict[str, object]:
    """A request shaped like llama.vscode's (its scheduling fields included: they are ignored)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": "m.py", "text": "X = 1\n"}],
            "prompt": "", "n_predict": 16, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000, **fields}


def test_infill_returns_llama_cpp_fields(fake_server: Callable) -> None:
    tokenizer = qwen_tokenizer()
    engine = scripted_engine(tokenizer, SCRIPT)
    srv = fake_server(engine)
    r = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(prompt="  "), timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == "a + b" and body["stop"] is True and body["stop_type"] == "eos"
    assert body["tokens_predicted"] == len(tokenizer.encode("a + b", add_special_tokens=False))
    assert body["truncated"] is False and body["timings"]["predicted_n"] == body["tokens_predicted"]
    assert "<|repo_name|>" not in tokenizer.get_vocab()  # so input_extra takes the snippet pattern
    text = ("\n\n--- snippet ---\n\nX = 1\n<|fim_prefix|>" + PREFIX + "  <|fim_suffix|>" + SUFFIX + "<|fim_middle|>")
    assert engine.requests[-1].prompt_ids == tokenizer.encode(text)
    assert body["tokens_evaluated"] == len(engine.requests[-1].prompt_ids)
    params = engine.requests[-1].params
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.8, 40, 0.99, 0.05)


def test_infill_streams_data_events_ending_with_stop(fake_server: Callable) -> None:
    srv = fake_server(scripted_engine(qwen_tokenizer(), SCRIPT))
    with httpx.stream("POST", f"{srv.url}/infill", json=llama_vscode_body(stream=True, temperature=0),
                      timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[len("data: "):]) for line in lines]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == "a + b"
    assert events[-1]["content"] == "" and events[-1]["stop_type"] == "eos" and "timings" in events[-1]


def test_infill_stop_words_limit_and_warmup(fake_server: Callable) -> None:
    engine = scripted_engine(qwen_tokenizer(), "a + b + c + d + e + f + g")
    srv = fake_server(engine)
    word = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(stop=[" + c"]), timeout=30).json()
    assert word["content"] == "a + b" and word["stop_type"] == "word" and word["stopping_word"] == " + c"
    limit = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(n_predict=2), timeout=30).json()
    assert limit["stop_type"] == "limit" and limit["tokens_predicted"] == 2
    num_requests = len(engine.requests)
    warm = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(n_predict=0), timeout=30).json()
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["tokens_evaluated"] > 0
    assert len(engine.requests) == num_requests  # nothing generated


def test_infill_cuts_a_long_prompt_to_the_context(fake_server: Callable) -> None:
    engine = scripted_engine(qwen_tokenizer(), SCRIPT, max_context=128)
    srv = fake_server(engine)
    body = llama_vscode_body(input_prefix="x = 1\n" * 200, input_suffix="y = 2\n" * 200, n_predict=16)
    r = httpx.post(f"{srv.url}/infill", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["truncated"] is True and r.json()["content"] == "a + b"
    assert len(engine.requests[-1].prompt_ids) + 16 <= 128


def test_infill_errors_are_openai_shaped(fake_server: Callable) -> None:
    srv = fake_server(FakeEngine())  # no FIM tokens
    r = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"
    fim = fake_server(scripted_engine(qwen_tokenizer(), SCRIPT))
    r = httpx.post(f"{fim.url}/infill", json=llama_vscode_body(input_extra=[{"text": 5}]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_extra[0].text"
    r = httpx.post(f"{fim.url}/infill", json=llama_vscode_body(n_probs=3), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_probs"


def test_n_indent_stops_before_a_line_indented_less(fake_server: Callable) -> None:
    """llama.vscode's n_indent (the cursor's indentation): a generated line indented less ends the
    completion after its indentation, as llama.cpp's server cuts it; stop_type "limit"."""
    script = "x = 1\n    y = 2\n  z = 3\nw = 4<|fim_pad|>"
    srv = fake_server(scripted_engine(qwen_tokenizer(), script, tokens_per_step=2))
    for stream in (False, True):
        body = llama_vscode_body(n_indent=4, temperature=0, n_predict=64, stream=stream)
        if stream:
            with httpx.stream("POST", f"{srv.url}/infill", json=body, timeout=30) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
            content, final = "".join(e["content"] for e in events), events[-1]
        else:
            final = httpx.post(f"{srv.url}/infill", json=body, timeout=30).json()
            content = final["content"]
        assert content == "x = 1\n    y = 2\n  " and final["stop_type"] == "limit", (stream, content)
    whole = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(n_indent=0, temperature=0, n_predict=64),
                       timeout=30).json()
    assert whole["content"] == "x = 1\n    y = 2\n  z = 3\nw = 4" and whole["stop_type"] == "eos"


def test_t_max_predict_ms_stops_after_a_newline(fake_server: Callable) -> None:
    engine = scripted_engine(qwen_tokenizer(), "a = 1\nb = 2\nc = 3\nd = 4\n" * 8, tokens_per_step=2)
    engine.step_seconds = 0.02
    srv = fake_server(engine)
    body = llama_vscode_body(n_indent=0, t_max_predict_ms=100, temperature=0, n_predict=400)
    out = httpx.post(f"{srv.url}/infill", json=body, timeout=30).json()
    assert out["stop_type"] == "limit" and "\n" in out["content"] and out["tokens_predicted"] < 200


def test_tokens_cached_is_the_prefix_cache_count(fake_server: Callable) -> None:
    srv = fake_server(scripted_engine(qwen_tokenizer(), SCRIPT))
    out = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(), timeout=30).json()
    assert out["tokens_cached"] == out["timings"]["cache_n"]


def test_infill_ignores_model(fake_server: Callable) -> None:
    """llama.vscode puts its `ai_model` setting ("google/gemini-2.5-flash" by default) into every body;
    llama.cpp's single-model server ignores it, and so does /infill (streamed or not)."""
    srv = fake_server(scripted_engine(qwen_tokenizer(), SCRIPT), served_model_name=("local",))
    for model in ("google/gemini-2.5-flash", "", None):
        r = httpx.post(f"{srv.url}/infill", json=llama_vscode_body(model=model), timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["content"] == "a + b" and r.json()["model"] == "local"
    with httpx.stream("POST", f"{srv.url}/infill", json=llama_vscode_body(model="gpt-4o", stream=True),
                      timeout=30) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["stop"] is True and events[-1]["model"] == "local"

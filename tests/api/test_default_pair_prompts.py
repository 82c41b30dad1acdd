"""The built-in default pair continues code typed up to an indented new line (issue 23): each prompt
ends where Enter and auto-indent leave an editor's cursor, which byte-level BPE tokenizes as a whitespace
token that whole-text training put only before blank lines or the end of a text. A pair trained that way
answered all eight with EOS; builder/fim_corpus.py now trains on text tokenized at cursors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from builder.pair_eval import INDENTED_PROMPTS
from engine.config import EngineConfig, ModelConfig

DEFAULT_PAIR = Path(__file__).resolve().parents[2] / "models" / "default"

pytestmark = pytest.mark.skipif(not (DEFAULT_PAIR / "target").is_dir(), reason="models/default is missing")


@pytest.fixture(scope="module")
def default_pair_engine() -> Any:
    from engine.runtime import Engine

    model = ModelConfig(target=str(DEFAULT_PAIR / "target"), draft=str(DEFAULT_PAIR / "draft"), name="specexec-default")
    return Engine.load(EngineConfig(model=model))


def test_default_pair_continues_after_an_indented_new_line(fake_server: Callable, default_pair_engine: Any) -> None:
    srv = fake_server(default_pair_engine)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    for prompt in INDENTED_PROMPTS:
        out = client.completions.create(model="specexec-default", prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text.strip(), (prompt, out.choices[0].text, out.choices[0].finish_reason)


def test_the_readme_tool_calling_snippet_works_pasted_against_the_default_server(
        fake_server: Callable, default_pair_engine: Any, capsys: pytest.CaptureFixture) -> None:
    """README's tool-calling example, as pasted, against the built-in pair (whose template renders no tools):
    it names the served model and reads a text answer (it named a model this server does not serve: 404)."""
    readme = (DEFAULT_PAIR.parents[1] / "README.md").read_text()
    section = readme[readme.index("### Tool calling"):readme.index("### Agents: the Responses API")]
    snippet = section[section.index("```python\n") + len("```python\n"):]
    snippet = snippet[:snippet.index("```")]
    srv = fake_server(default_pair_engine)
    exec(compile(snippet.replace("http://127.0.0.1:8000", srv.url), "README tool calling", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed and printed[-1].split()[0] in ("stop", "length"), printed

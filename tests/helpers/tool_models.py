"""Tool-capable chat templates in the four families' styles, on the tiny test tokenizer, and a
FakeEngine that emits a scripted text through such a tokenizer.

The templates are short hand-written versions of the real ones (Qwen2.5's Hermes style,
Llama 3.1's JSON style, Mistral v0.3's): tools in the prompt, past calls and tool results
rendered the way the real templates do (arguments through `tojson`, Mistral's 9-character id
check). `tool_tokenizer(template, special=...)` adds marker tokens as special tokens, as
Llama 3 (`<|python_tag|>`) and Mistral (`[TOOL_CALLS]`) tokenizers have them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import openai

from tests.helpers.fake_engine import FakeEngine, tiny_tokenizer

HERMES_TEMPLATE = """\
{%- if tools %}<|system|>
# Tools

You may call one or more functions. Function signatures within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>
{% if m.content %}{{ m.content }}{% endif %}
{%- for tc in m.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|end|>
{% elif m.role == 'tool' %}<|user|>
<tool_response>
{{ m.content }}
</tool_response><|end|>
{% else %}<|{{ m.role }}|>
{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""

LLAMA_TEMPLATE = """\
{%- for m in messages %}
{%- if m.role == 'user' and tools is not none and loop.first %}<|start_header_id|>user<|end_header_id|>
Given the following functions, respond with a JSON for a function call.
Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.
{% for t in tools %}{{ t | tojson }}
{% endfor %}{{ m.content }}<|end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>
{%- set tc = m.tool_calls[0].function %}{{ '{"name": "' + tc.name + '", "parameters": ' }}{{ tc.arguments | tojson }}}<|end|>
{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>
{{ m.content }}<|end|>
{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>
{{ m.content }}<|end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{% endif %}"""

MISTRAL_TEMPLATE = """\
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}
[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for tc in m.tool_calls %}
{%- if tc.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}
{%- if not loop.last %}, {% endif %}{% endfor %}]<|end|>
{%- elif m.role == 'tool' %}
{%- if m.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
[TOOL_RESULTS]{"call_id": "{{ m.tool_call_id }}", "content": {{ m.content | tojson }}}[/TOOL_RESULTS]
{%- else %}{{ m.content }}<|end|>
{%- endif %}
{%- endfor %}"""

# The real Qwen3-Coder chat template (Qwen/Qwen3-Coder-30B-A3B-Instruct's), as llama.cpp keeps it in
# models/templates/Qwen3-Coder.jinja (github.com/ggml-org/llama.cpp; this copy was read from the fork
# wbpxre150/llama.cpp at commit 90dd63ae86bdad1b4bb6de69379956b0ae1189bf), byte for byte. Calls are
# XML (`<tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call>`), past
# calls print `tool_call.arguments|items`, each non-string value through `| string`.
QWEN3_CODER_TEMPLATE = (Path(__file__).parent / "templates" / "Qwen3-Coder.jinja").read_text()

# The real GLM-4.6 chat template (zai-org/GLM-4.6's; GLM-4.5's prints calls the same way), as llama.cpp
# keeps it in models/templates/GLM-4.6.jinja (github.com/ggml-org/llama.cpp at commit
# afefa651447358ae477f31a0ea1b97adff04c64f), byte for byte. Calls are `<tool_call>f\n<arg_key>k</arg_key>\n
# <arg_value>v</arg_value>\n</tool_call>`; past calls print `tc.arguments.items()`, a string raw, any other
# value through `tojson`; the prompt ends `<|assistant|>` (the model writes `\n<think>...` itself).
GLM45_TEMPLATE = (Path(__file__).parent / "templates" / "GLM-4.6.jinja").read_text()

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a timezone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}},
]


def tool_tokenizer(template: str, special: tuple[str, ...] = ()):
    """The tiny test tokenizer with `template` as its chat template and `special` added as special tokens."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = template
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def scripted_engine(tokenizer, script: str, tokens_per_step: int = 1, max_context: int = 8192,
                    **kwargs) -> FakeEngine:
    """A FakeEngine that emits `script` tokenized by `tokenizer` (end it with "<|end|>" to stop); the tiny
    vocabulary spends about one token per character of the tool definitions, hence the long context."""
    engine = FakeEngine(tokens_per_step=tokens_per_step, max_context=max_context, **kwargs)
    engine.tokenizer = tokenizer
    engine.eos_token_ids = frozenset({tokenizer.eos_token_id})
    engine.script_ids = tokenizer.encode(script, add_special_tokens=False)
    return engine


def openai_client(srv: Any) -> openai.OpenAI:
    """The openai SDK against a fake server (tests/api/conftest.py's fake_server)."""
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def last_prompt(srv: Any) -> str:
    """The text of the last prompt the fake server's engine was given."""
    return srv.engine.tokenizer.decode(srv.engine.requests[-1].prompt_ids)

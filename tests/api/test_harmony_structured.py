"""Structured output on a harmony model (GPT-OSS; server/harmony_output.py `analysis_first`): the grammar
compiled for the harmony tokenizer takes the analysis message, the final header and then only JSON valid
under the schema, or the JSON alone; through the openai SDK the analysis comes back as reasoning and the
JSON as content; with --reasoning-format none the grammar applies from the first token as before. And a
forced call (`forced_call`, tool_choice required / named): the analysis, then one call of an offered tool
in the commentary channel with arguments valid under its schema."""

from __future__ import annotations

import json

import openai
import xgrammar

from engine.speculation.grammar import GrammarCache
from engine.types import StructuredOutput
from server.harmony_output import analysis_first, forced_call
from tests.helpers.harmony_models import STOP_TOKENS, harmony_engine, harmony_tokenizer
from tests.helpers.tool_models import openai_client

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
SPEC = StructuredOutput("json_schema", json.dumps(SCHEMA))
REPLY = ('<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>'
         '{"answer": 4}<|return|>')
FORMAT = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA, "strict": True}}


def accepts(cache: GrammarCache, spec: StructuredOutput, text: str, end: str = "<|return|>") -> bool:
    """Whether the grammar takes `text` (the harmony markers as their single tokens) and then `end`."""
    tokenizer = cache.tokenizer
    matcher = xgrammar.GrammarMatcher(cache.compile(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.convert_tokens_to_ids(end))


def test_the_analysis_and_final_header_may_come_first_then_only_the_schema() -> None:
    cache = harmony_cache()
    spec = analysis_first(SPEC)
    body = REPLY.removesuffix("<|return|>")
    assert accepts(cache, spec, body) and accepts(cache, spec, '{"answer": 4}')
    for text in ('<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>{"answer": "4"}',
                 "<|channel|>analysis<|message|>x<|end|>",
                 '<|channel|>final<|message|>{"answer": 4}', "The answer is 4."):
        assert not accepts(cache, spec, text), text
    assert not accepts(cache, SPEC, body)  # unwrapped: JSON from the first token, as before


def harmony_cache() -> GrammarCache:
    tokenizer = harmony_tokenizer()
    return GrammarCache(tokenizer, len(tokenizer), tokenizer.convert_tokens_to_ids(list(STOP_TOKENS)))


def test_a_forced_call_is_one_call_of_an_offered_tool_after_the_analysis() -> None:
    cache = harmony_cache()
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    required = forced_call([("get_weather", city), ("get_time", None)])
    header = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>"
    analysis = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant"
    for text in (analysis + header.format("get_weather") + '{"city": "Paris"}', header.format("get_time") + "{}"):
        assert accepts(cache, required, text, "<|call|>"), text
    for text in (header.format("get_weather") + '{"town": "Paris"}', header.format("get_date") + "{}",
                 analysis + "<|channel|>final<|message|>Sunny.", analysis):
        assert not accepts(cache, required, text, "<|call|>"), text
    named = forced_call([("get_weather", city)])
    assert not accepts(cache, named, header.format("get_time") + "{}", "<|call|>")


def serve(fake_server, **fields):
    srv = fake_server(harmony_engine(REPLY, tokens_per_step=4), **fields)
    return srv, openai_client(srv)


def test_openai_sdk_sees_the_analysis_as_reasoning_and_the_json_as_content(fake_server) -> None:
    srv, client = serve(fake_server)
    message = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2 + 2?"}],
                                             response_format=FORMAT, max_tokens=300).choices[0].message
    assert json.loads(message.content) == {"answer": 4}
    assert (message.model_extra or {}).get("reasoning_content") == "2 + 2 is 4."
    sent = srv.engine.requests[-1].params.structured_output
    assert sent is not None and sent.reasoning is not None and "<|channel|>" in sent.special_tokens


def test_reasoning_format_none_keeps_the_grammar_from_the_first_token(fake_server) -> None:
    srv, client = serve(fake_server, reasoning_format="none")
    try:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "2 + 2?"}],
                                       response_format=FORMAT, max_tokens=300)
    except openai.APIError:
        pass  # the scripted reply does not follow the grammar; only what was sent is checked
    assert srv.engine.requests[-1].params.structured_output.reasoning is None

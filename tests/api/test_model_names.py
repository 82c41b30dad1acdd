"""Model ids over HTTP: `--served-model-name` aliases, an omitted `model`, unknown ids, `/v1/models`.

The real app over a FakeEngine (uvicorn in a thread), driven by the official openai SDK.
"""

from __future__ import annotations

import argparse
import time

import httpx
import openai
import pytest

from engine.types import ConfigError
from server.config import ServerConfig
from server.serve import add_server_arguments, server_config_from

MESSAGES = [{"role": "user", "content": "hi"}]
ALIASES = ("specexec-default", "gpt-3.5-turbo", "gpt-4o-mini")


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def parse_flags(*flags: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return server_config_from(parser.parse_args(list(flags)), None)


def test_flag_takes_several_names_space_or_comma_separated() -> None:
    assert parse_flags().served_model_name == ()
    assert parse_flags("--served-model-name", "a").served_model_name == ("a",)
    assert parse_flags("--served-model-name", "a", "b,c").served_model_name == ("a", "b", "c")


def test_toml_accepts_a_string_or_a_list_and_the_flag_overrides_it() -> None:
    assert server_config_from(None, {"served_model_name": "one"}).served_model_name == ("one",)
    assert server_config_from(None, {"served_model_name": ["x", "y"]}).served_model_name == ("x", "y")
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    args = parser.parse_args(["--served-model-name", "flag"])
    assert server_config_from(args, {"served_model_name": ["file"]}).served_model_name == ("flag",)


@pytest.mark.parametrize("names", [("a", "a"), ("",), (" a",), [1]])
def test_bad_names_are_refused_naming_the_field(names) -> None:
    with pytest.raises(ConfigError, match="server.served_model_name"):
        server_config_from(None, {"served_model_name": list(names)})


def test_models_lists_every_alias_first_name_first_with_a_fixed_created(fake_server) -> None:
    client = sdk(fake_server(served_model_name=ALIASES).url)
    first = client.models.list().data
    assert [m.id for m in first] == list(ALIASES)
    assert {m.owned_by for m in first} == {"specexec"} and {m.object for m in first} == {"model"}
    time.sleep(1.1)  # `created` is whole seconds: a per-call timestamp would change
    again = client.models.list().data
    assert [m.created for m in again] == [m.created for m in first] and len({m.created for m in first}) == 1
    for name in ALIASES:
        card = client.models.retrieve(name)
        assert card.id == name and card.created == first[0].created


def test_every_alias_is_accepted_and_echoed(fake_server) -> None:
    client = sdk(fake_server(served_model_name=ALIASES).url)
    for name in ALIASES:
        chat = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4)
        assert chat.model == name and chat.choices[0].message.content
        text = client.completions.create(model=name, prompt="hi", max_tokens=4)
        assert text.model == name and text.choices[0].text
        chunks = list(client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=4, stream=True))
        assert {c.model for c in chunks} == {name}


def test_the_engine_name_is_not_an_alias_once_names_are_given(fake_server) -> None:
    client = sdk(fake_server(served_model_name=("alias",)).url)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4)
    assert info.value.body["code"] == "model_not_found"


def test_without_aliases_the_engine_model_name_is_served(fake_server) -> None:
    client = sdk(fake_server().url)
    assert [m.id for m in client.models.list().data] == ["fake-model"]
    assert client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=4).model == "fake-model"


def test_an_omitted_model_means_the_first_name(fake_server) -> None:
    srv = fake_server(served_model_name=ALIASES)
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "hi"})):
        reply = httpx.post(srv.url + path, json={**body, "max_tokens": 4}, timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == ALIASES[0]
        null = httpx.post(srv.url + path, json={**body, "model": None, "max_tokens": 4}, timeout=30)
        assert null.status_code == 200 and null.json()["model"] == ALIASES[0]


@pytest.mark.parametrize("stream", [False, True])
def test_an_unknown_model_is_a_404_naming_it(fake_server, stream: bool) -> None:
    client = sdk(fake_server(served_model_name=("specexec-default",)).url)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-3.5-turbo", messages=MESSAGES, max_tokens=4, stream=stream)
    error = info.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-3.5-turbo" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-3.5-turbo")


def test_an_empty_model_means_the_first_name_on_every_route(fake_server) -> None:
    """llama.vscode's OpenAI-compatible mode sends `"model": ""`: it counts as omitted."""
    srv = fake_server(served_model_name=ALIASES)
    for path, body in (("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 4})):
        reply = httpx.post(srv.url + path, json={**body, "model": ""}, timeout=30)
        assert reply.status_code == 200, (path, reply.text)
        assert reply.json()["model"] == ALIASES[0]
    chunks = list(sdk(srv.url).chat.completions.create(model="", messages=MESSAGES, max_tokens=4, stream=True))
    assert {c.model for c in chunks} == {ALIASES[0]}

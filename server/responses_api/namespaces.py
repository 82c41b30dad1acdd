"""Namespace tools of the Responses API: `{"type": "namespace", "name", "description", "tools": [...]}`
groups function and custom tools under one name (Codex sends each MCP server's tools this way, as
`mcp__<server>`, and its sub-agent tools as `multi_agent_v1`).

A chat template knows only flat function tools, so each tool of a namespace is offered under its
qualified name, `<namespace>__<name>` (Codex's own flat name for an MCP tool: `mcp__weather__get_forecast`),
and a call of it comes back as OpenAI's do: a `function_call` (or `custom_tool_call`) item with the tool's
own `name` and the `namespace`. Replayed calls carrying a `namespace` get their qualified name back, so
the conversation the template renders names each tool one way.
"""

from __future__ import annotations

import logging
from typing import Any

from server.errors import invalid_request

log = logging.getLogger("specexec.server")

Item = dict[str, Any]
SEPARATOR = "__"
MEMBER_TYPES = ("function", "custom")  # what a namespace may hold (OpenAI's NamespaceTool)


def qualified(namespace: str, name: str) -> str:
    """The flat name a namespace's tool is offered under."""
    return f"{namespace}{SEPARATOR}{name}"


def call_name(name: str, namespace: Any) -> str:
    """A tool's name as the model was offered it: qualified when a (replayed call's, or a named tool_choice's)
    `namespace` is given."""
    return qualified(namespace, name) if isinstance(namespace, str) and namespace else name


def flatten(tools: list[Item]) -> tuple[list[Item], dict[str, tuple[str, str]]]:
    """Tools with every namespace replaced by its function and custom tools under qualified names (other
    tools as they are), and qualified name -> (namespace, name) for the calls the model makes."""
    flat: list[Item] = []
    members: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type") != "namespace":
            flat.append(tool)
            continue
        namespace, inner = tool.get("name"), tool.get("tools")
        if not isinstance(namespace, str) or not namespace:
            raise invalid_request("A namespace tool needs a 'name'.", f"tools[{i}].name", "missing_required_parameter")
        if not isinstance(inner, list):
            raise invalid_request("A namespace tool needs 'tools', a list of function and custom tools.",
                                  f"tools[{i}].tools", "invalid_value")
        for j, member in enumerate(inner):
            if not isinstance(member, dict) or member.get("type") not in MEMBER_TYPES:
                kind = member.get("type") if isinstance(member, dict) else type(member).__name__
                log.info("/v1/responses: a tool of type %r in namespace %r is left out", kind, namespace)
                continue
            name = member.get("name")
            if not isinstance(name, str) or not name:
                raise invalid_request("A namespace's tool needs a 'name'.", f"tools[{i}].tools[{j}].name",
                                      "missing_required_parameter")
            flat.append(member | {"name": qualified(namespace, name)})
            members[qualified(namespace, name)] = (namespace, name)
    return flat, members

r"""JSON-schema keywords the grammar engine does not enforce, and schemas that accept no value: found
before compiling, so a request gets an error naming them instead of output that fails its schema.

xgrammar (0.2.x) compiles a schema to a grammar but accepts keywords it then ignores, and for some
schemas that accept nothing it compiles a grammar anyway: either way the output ends with
finish_reason "stop" and fails the schema. Sampling under compiled grammars and validating with
`jsonschema` (tests/speculation/test_schema_support.py) showed, in strict mode:

- enforced: type (one or a list), enum, const, properties, required, additionalProperties,
  patternProperties, propertyNames, minProperties, maxProperties, items (a schema), prefixItems,
  minItems, maxItems, minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf on integers,
  pattern, minLength, maxLength, $ref (to this document), allOf with one schema, anyOf, oneOf whose
  branches cannot overlap;
- ignored: uniqueItems, contains, minContains, maxContains, dependentRequired, dependentSchemas,
  dependencies, not, if/then/else, allOf with several schemas, multipleOf on numbers, and any
  keyword next to $ref, const, enum, anyOf, oneOf or allOf (xgrammar reads only the first of those
  it finds, in that order); without `type`, the keywords of numbers and strings;
- compiled although empty: anyOf: [], oneOf: [], type: [], `required` naming a property that
  `properties` does not declare (strict mode admits no other), a const or enum value its sibling
  keywords exclude;
- broken: minLength / maxLength on strings let raw control characters into the string (invalid
  JSON), and are ignored next to `pattern`;
- infinite: a schema whose every value must hold another value of a schema that must hold one again
  (`{"properties": {"child": {"$ref": "#"}}, "required": ["child"]}`) compiles, and the output runs to
  max_tokens; it accepts no finite value.

`enforceable(schema)` raises StructuredOutputError for each of these (other keywords, annotations and
extensions alike, pass) and rewrites string lengths as the pattern `^[\s\S]{min,max}$`, which xgrammar
enforces. Errors xgrammar reports itself (enum: [], minimum > maximum, ...) are left to it.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote

from engine.types import StructuredOutputError

DISPATCH = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # xgrammar's order: the first one present wins
NUMBER_KEYWORDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "unevaluatedItems", "additionalItems"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties", "propertyNames",
                             "minProperties", "maxProperties", "unevaluatedProperties"})
IGNORED = ("uniqueItems", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
           "dependencies", "not", "if", "$dynamicRef", "$recursiveRef")
# validation keywords: anything else in a schema object is an annotation or an extension (title, format, ...)
VALIDATION = (frozenset({"type", "then", "else"}) | frozenset(DISPATCH) | NUMBER_KEYWORDS | STRING_KEYWORDS
              | ARRAY_KEYWORDS | OBJECT_KEYWORDS | frozenset(IGNORED))


def enforceable(schema: Any) -> Any:
    """`schema` (a parsed JSON schema, changed in place) as the grammar engine enforces it: string
    lengths as patterns. StructuredOutputError naming the first keyword the grammar would not enforce,
    or the first part of the schema that accepts no value, with where it is (`properties.tags`)."""
    try:
        walk = _Walk(schema)
        walk.visit(schema, "")
        infinite = _infinite_refs(schema, walk.seen_refs)
        if not _finite(schema, infinite):
            raise empty("", "every value it accepts must hold another value of a schema that itself must hold one, "
                        f"without end (through {', '.join(repr(ref) for ref in sorted(infinite))}): no finite JSON "
                        "value is valid")
    except RecursionError:
        raise StructuredOutputError("the JSON schema is nested too deeply") from None
    return schema


def enforceable_tag(tag: Any) -> Any:
    """A parsed xgrammar structural tag (changed in place) with `enforceable` applied to each JSON
    schema it holds (tool arguments, a reply's response_format next to tools)."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            tag["json_schema"] = enforceable(tag["json_schema"])
            return tag
        for value in tag.values():
            enforceable_tag(value)
    elif isinstance(tag, list):
        for value in tag:
            enforceable_tag(value)
    return tag


def unsupported(keyword: str, path: str, why: str) -> StructuredOutputError:
    where = f" (at {path})" if path else ""
    return StructuredOutputError(f"the JSON schema keyword '{keyword}'{where} is not supported: {why}")


def empty(path: str, why: str) -> StructuredOutputError:
    where = f"at {path}" if path else "at its root"
    return StructuredOutputError(f"the JSON schema accepts no value {where}: {why}")


def _join(path: str, key: str | int) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key


class _Walk:
    """Visits every subschema reachable from the root (through $ref too, each target once)."""

    def __init__(self, root: Any):
        self.root = root
        self.seen_refs: set[str] = set()

    def visit(self, node: Any, path: str, implied_type: str | None = None) -> None:
        """`implied_type`: the type of a schema without one (property names are strings)."""
        if isinstance(node, bool):
            return  # true: anything; false: xgrammar refuses it where a value must appear
        if not isinstance(node, dict):
            return  # not a schema: xgrammar reports it
        keywords = [key for key in node if key in VALIDATION]
        self._check_ignored(node, path)
        dispatch = next((key for key in DISPATCH if key in node), None)
        if dispatch is not None:
            self._check_dispatch(node, dispatch, keywords, path)
        else:
            self._check_typed(node, path, node.get("type", implied_type))
        for key, child, child_path in _children(node, path):
            if key == "$ref":
                self._follow(child, child_path)
            else:
                self.visit(child, child_path, "string" if key == "propertyNames" else None)

    def _check_ignored(self, node: dict[str, Any], path: str) -> None:
        for keyword in IGNORED:
            if keyword not in node or _no_op(keyword, node[keyword]):
                continue
            if keyword == "if" and "then" not in node and "else" not in node:
                continue  # `if` alone asserts nothing
            raise unsupported(keyword, path, "the grammar engine does not enforce it")

    def _check_dispatch(self, node: dict[str, Any], dispatch: str, keywords: list[str], path: str) -> None:
        others = [key for key in keywords if key != dispatch and key not in ("then", "else")]
        if dispatch in ("const", "enum"):
            values = [node["const"]] if dispatch == "const" else node["enum"]
            if not isinstance(values, list):
                return  # xgrammar reports it
            others = [key for key in others if key not in ("const", "enum", "type")]
            if others:
                raise unsupported(others[0], path, f"next to '{dispatch}' the grammar engine does not enforce it")
            kept = [value for value in values if _satisfies(value, node)]
            if values and not kept:
                raise empty(path, f"no '{dispatch}' value satisfies the keywords beside it")
            if len(kept) < len(values):
                raise unsupported(dispatch, path, f"it holds values that the keywords beside it exclude "
                                  f"({_short(next(v for v in values if not _satisfies(v, node)))})")
            return
        if others:
            raise unsupported(others[0], path, f"next to '{dispatch}' the grammar engine does not enforce it "
                              f"(move it into the '{dispatch}' schemas)")
        branches = node[dispatch]
        if dispatch in ("anyOf", "oneOf") and isinstance(branches, list) and not branches:
            raise empty(path, f"'{dispatch}' is empty")
        if dispatch == "allOf" and isinstance(branches, list) and len(branches) > 1:
            raise unsupported("allOf", path, "the grammar engine enforces 'allOf' with one schema only")
        if dispatch == "oneOf" and isinstance(branches, list):
            self._check_disjoint(branches, path)

    def _check_typed(self, node: dict[str, Any], path: str, types: Any) -> None:
        if types == []:
            raise empty(path, "'type' is an empty list")
        if types is None:
            for key in node:
                if key in NUMBER_KEYWORDS or key in STRING_KEYWORDS:
                    raise unsupported(key, path, "without 'type' the grammar engine does not enforce it (add 'type')")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if "multipleOf" in node and types is not None and "number" in types:
            raise unsupported("multipleOf", path, "the grammar engine enforces it on integers only")
        if "multipleOf" in node and not _is_integer(node["multipleOf"]):
            raise unsupported("multipleOf", path, "the grammar engine enforces whole-number multiples only")
        if isinstance(node.get("required"), list) and (types is None or "object" in types):
            declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
            missing = [name for name in node["required"] if name not in declared]
            if missing:
                raise empty(path, f"'required' names {missing[0]!r}, which 'properties' does not declare "
                            "(the grammar admits declared properties only)")
        if types == ["integer"] and _no_integer_between(node):
            raise empty(path, "no integer lies within its bounds")
        if types is not None and "string" in types:
            _lengths_as_pattern(node, path)

    def _check_disjoint(self, branches: list[Any], path: str) -> None:
        resolved = [self._resolve(branch) for branch in branches]
        for i, a in enumerate(resolved):
            for j in range(i + 1, len(resolved)):
                if not _disjoint(a, resolved[j]):
                    raise unsupported("oneOf", path, f"its schemas {i} and {j} may both match a value, and the "
                                      "grammar engine does not enforce 'exactly one' (use 'anyOf')")

    def _resolve(self, node: Any) -> Any:
        for _ in range(32):  # a chain of $refs, cut short if it loops
            if not isinstance(node, dict) or not isinstance(node.get("$ref"), str):
                return node
            node = _pointer(self.root, node["$ref"])
        return node

    def _follow(self, ref: Any, path: str) -> None:
        if not isinstance(ref, str) or ref in self.seen_refs:
            return
        self.seen_refs.add(ref)
        target = _pointer(self.root, ref)
        if target is not None:
            self.visit(target, ref.lstrip("#/").replace("/", ".") or path)


SCALAR_TYPES = frozenset({"null", "boolean", "number", "integer", "string"})


def _infinite_refs(root: Any, refs: set[str]) -> set[str]:
    """The references among `refs` whose schemas accept only infinitely deep values: the least fixpoint
    (a reference is finite once its schema is, given the references already found finite)."""
    infinite = set(refs)
    changed = True
    while changed:
        changed = False
        for ref in sorted(infinite):
            target = _pointer(root, ref)
            if target is None or _finite(target, infinite):
                infinite.discard(ref)
                changed = True
    return infinite


def _finite(node: Any, infinite: set[str]) -> bool:
    """Whether `node` accepts some finite value, the references in `infinite` taken to accept none. True
    whenever that cannot be told for sure (what xgrammar refuses, or keywords this does not weigh)."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    dispatch = next((key for key in DISPATCH if key in node), None)
    if dispatch == "$ref":
        return node["$ref"] not in infinite if isinstance(node["$ref"], str) else True
    if dispatch in ("anyOf", "oneOf", "allOf"):
        branches = node[dispatch]
        if not isinstance(branches, list) or not branches:
            return True  # not a list, or empty: reported elsewhere
        results = [_finite(branch, infinite) for branch in branches]
        return all(results) if dispatch == "allOf" else any(results)
    if dispatch is not None:  # const, enum: finite values
        return True
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else _implied_types(node)
    if types is None or SCALAR_TYPES & set(types) or not {"object", "array"} & set(types):
        return True
    return ("object" in types and _finite_object(node, infinite)) or ("array" in types and _finite_array(node, infinite))


def _implied_types(node: dict[str, Any]) -> list[str] | None:
    """The type xgrammar gives a schema without `type` from its keywords (None: any, or not clear)."""
    is_object, is_array = OBJECT_KEYWORDS & node.keys(), ARRAY_KEYWORDS & node.keys()
    if is_object and not is_array:
        return ["object"]
    if is_array and not is_object:
        return ["array"]
    return None


def _finite_object(node: dict[str, Any], infinite: set[str]) -> bool:
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return all(_finite(properties[name], infinite) for name in required if name in properties)


def _finite_array(node: dict[str, Any], infinite: set[str]) -> bool:
    needed = node.get("minItems", 0)
    if not _is_integer(needed) or needed <= 0:
        return True
    prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
    if not all(_finite(item, infinite) for item in prefix[: int(needed)]):
        return False
    return needed <= len(prefix) or _finite(node.get("items", True), infinite)


def _lengths_as_pattern(node: dict[str, Any], path: str) -> None:
    """minLength / maxLength -> the pattern `^[\\s\\S]{min,max}$` (any characters, counted as code points)."""
    lengths = [key for key in ("minLength", "maxLength") if key in node]
    if not lengths:
        return
    if "pattern" in node:
        raise unsupported(lengths[0], path, "next to 'pattern' the grammar engine does not enforce it (put the "
                          "length into the pattern)")
    low, high = node.pop("minLength", 0), node.pop("maxLength", None)
    if not _is_integer(low) or low < 0 or (high is not None and (not _is_integer(high) or high < 0)):
        raise StructuredOutputError(f"minLength and maxLength (at {path or 'the root'}) must be non-negative integers")
    if high is not None and low > high:
        raise empty(path, f"minLength {int(low)} is greater than maxLength {int(high)}")
    node["pattern"] = f"^[\\s\\S]{{{int(low)},{'' if high is None else int(high)}}}$"


def _children(node: dict[str, Any], path: str) -> list[tuple[str, Any, str]]:
    """(keyword, subschema, its path) for each subschema of `node`; $ref gives the reference itself."""
    out: list[tuple[str, Any, str]] = []
    for key in ("properties", "patternProperties"):
        if isinstance(node.get(key), dict):
            out += [(key, child, _join(_join(path, key), name)) for name, child in node[key].items()]
    for key in ("additionalProperties", "propertyNames", "unevaluatedProperties", "items", "unevaluatedItems",
                "additionalItems", "then", "else"):
        if key in node:
            out.append((key, node[key], _join(path, key)))
    for key in ("prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(node.get(key), list):
            out += [(key, child, _join(_join(path, key), i)) for i, child in enumerate(node[key])]
    if "$ref" in node:
        out.append(("$ref", node["$ref"], _join(path, "$ref")))
    return out


def _pointer(root: Any, ref: str) -> Any:
    """The subschema a local reference ("#", "#/$defs/Name") points to; None if it does not resolve."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _no_op(keyword: str, value: Any) -> bool:
    """Keyword values that assert nothing."""
    return (keyword == "uniqueItems" and value is False) or (
        keyword in ("dependentRequired", "dependentSchemas", "dependencies") and value == {})


def _is_integer(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _no_integer_between(node: dict[str, Any]) -> bool:
    low, high = -math.inf, math.inf
    for key, bound in (("minimum", math.ceil), ("exclusiveMinimum", lambda x: math.floor(x) + 1)):
        if (value := _number(node.get(key))) is not None and math.isfinite(value):
            low = max(low, bound(value))
    for key, bound in (("maximum", math.floor), ("exclusiveMaximum", lambda x: math.ceil(x) - 1)):
        if (value := _number(node.get(key))) is not None and math.isfinite(value):
            high = min(high, bound(value))
    return low > high


def json_types(value: Any) -> set[str]:
    """The JSON Schema types a JSON value has ("integer" values are "number"s too)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {"string"} if isinstance(value, str) else {"array"} if isinstance(value, list) else {"object"}


def _satisfies(value: Any, node: dict[str, Any]) -> bool:
    """Whether a const/enum value meets `type` and a sibling `const` / `enum` (all xgrammar would skip)."""
    types = node.get("type")
    if types is not None:
        wanted = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
        if wanted and not wanted & json_types(value):
            return False
    if "const" in node and not _equal(value, node["const"]):
        return False
    return not (isinstance(node.get("enum"), list) and not any(_equal(value, v) for v in node["enum"]))


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _value_set(node: Any) -> list[Any] | None:
    """The values a schema allows when it lists them (const / enum), else None."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    return node["enum"] if isinstance(node.get("enum"), list) else None


def _type_set(node: Any) -> set[str] | None:
    """The JSON types a schema allows when it says (type, or its const / enum values), else None."""
    if not isinstance(node, dict):
        return None
    if (values := _value_set(node)) is not None:
        return set().union(*(json_types(v) for v in values)) if values else set()
    types = node.get("type")
    if isinstance(types, str):
        types = [types]
    if not isinstance(types, list) or any(key in node for key in ("anyOf", "oneOf", "allOf", "$ref")):
        return None
    return set(types) | ({"integer"} if "number" in types else set())


def _disjoint(a: Any, b: Any) -> bool:
    """True only if no value can match both schemas (types, listed values, or a property both require
    with listed values apart: a discriminator); False when that cannot be shown."""
    ta, tb = _type_set(a), _type_set(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    va, vb = _value_set(a), _value_set(b)
    if va is not None and vb is not None:
        return not any(_equal(x, y) for x in va for y in vb)
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    props_a, props_b = a.get("properties"), b.get("properties")
    if not (isinstance(props_a, dict) and isinstance(props_b, dict)):
        return False
    required = set(a.get("required") or ()) & set(b.get("required") or ())
    return any(name in props_a and name in props_b and _value_set(props_a[name]) is not None
               and _value_set(props_b[name]) is not None and _disjoint(props_a[name], props_b[name])
               for name in required)


"""JSON schemas as the grammar enforces them: objects closed unless they say otherwise.

A schema that lists an object's `properties` but says nothing of `additionalProperties` allows any
other key, and a weak model fills that room until max_tokens. As llama.cpp and vLLM do, such an
object is closed here (`additionalProperties: false`); an explicit `additionalProperties` (true or a
schema) is kept, and an object that lists no properties stays a map. Branches that are intersected
with their parent (allOf, or anyOf/oneOf beside the parent's own properties) are not closed one by
one, which would forbid each other's keys: the parent is closed over the keys they all declare. A
`$ref` beside the object's own properties is such a branch too (an allOf of one, as JSON Schema
2019-09 reads it). Local refs are JSON pointers ("#/$defs/Name") or `$anchor` names ("#name").
"""
from __future__ import annotations

from typing import Any, Optional

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "items", "contains", "additionalItems")
_SCHEMA_LISTS = ("prefixItems", "items")
_BRANCHES = ("allOf", "anyOf", "oneOf")
_UNTOUCHED = ("not", "if", "then", "else", "propertyNames", "dependentSchemas", "unevaluatedProperties",
              "unevaluatedItems")  # closing inside these would change what they mean
_OWN_KEYS = ("properties", "patternProperties", "required")


def closed(schema: Any) -> Any:
    """`schema` with every object that lists its properties closed (a new schema; the input is kept)."""
    return _Closer(schema).node(schema, merged=False, inlining=())


def _joined(schema: dict, key: str) -> bool:
    """Whether the branches under `key` are intersected with the rest of `schema`."""
    return key in schema and (key == "allOf" or any(k in schema for k in _OWN_KEYS))


class _Closer:
    def __init__(self, root: Any) -> None:
        self.root = root

    def resolve(self, ref: Any) -> Optional[dict]:
        """The subschema a local `$ref` ("#/$defs/Name", any JSON pointer, or "#name" of an
        `$anchor`) points at, else None."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        if len(ref) > 1 and ref[1] != "/":
            return _anchored(self.root, ref[1:])
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return None
        return node if isinstance(node, dict) else None

    def declared(self, schema: Any, inlining: tuple) -> list[str]:
        """The property names a schema declares, through its allOf/anyOf/oneOf branches and local refs."""
        if not isinstance(schema, dict):
            return []
        ref = schema.get("$ref")
        if ref in inlining:
            return []
        target = self.resolve(ref)
        names = list(schema.get("properties") or {}) if isinstance(schema.get("properties"), dict) else []
        if target is not None:
            names += self.declared(target, inlining + (ref,))
        for key in _BRANCHES:
            for branch in schema.get(key) or ():
                names += self.declared(branch, inlining)
        return list(dict.fromkeys(names))

    def node(self, schema: Any, *, merged: bool, inlining: tuple) -> Any:
        """`schema` closed; `merged`: it is intersected with its parent, which closes it instead."""
        if not isinstance(schema, dict):
            return schema
        if "$ref" in schema and any(k in schema for k in _OWN_KEYS):  # the ref is intersected with them
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**rest, "allOf": [{"$ref": schema["$ref"]}] + list(rest.get("allOf") or [])}
        out: dict = {}
        for key, value in schema.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {k: self.node(v, merged=False, inlining=inlining) for k, v in value.items()}
            elif key in _SCHEMA_ONE and isinstance(value, dict):
                out[key] = self.node(value, merged=False, inlining=inlining)
            elif key in _SCHEMA_LISTS and isinstance(value, list):
                out[key] = [self.node(v, merged=False, inlining=inlining) for v in value]
            elif key in _BRANCHES and isinstance(value, list):
                out[key] = [self.branch(v, _joined(schema, key), inlining) for v in value]
            else:
                out[key] = value  # a value (const, enum, default), a keyword, or a schema left as it is
        if merged or "additionalProperties" in schema:
            return out
        theirs = [n for key in _BRANCHES if _joined(schema, key) and isinstance(schema[key], list)
                  for b in schema[key] for n in self.declared(b, inlining)]
        if "properties" not in schema and "patternProperties" not in schema and not theirs:
            return out  # an object that names none of its keys is a map: closing it would allow only {}
        own = dict(out.get("properties") or {})
        out["properties"] = {**own, **{n: True for n in theirs if n not in own}}
        out["additionalProperties"] = False
        return out

    def branch(self, schema: Any, joined: bool, inlining: tuple) -> Any:
        """An allOf/anyOf/oneOf branch; a joined one that is a local ref is inlined open, since the
        definition it points at is closed on its own."""
        if not joined:
            return self.node(schema, merged=False, inlining=inlining)
        ref = schema.get("$ref") if isinstance(schema, dict) else None
        target = self.resolve(ref)
        if target is not None and ref not in inlining and len(schema) == 1:
            return self.node(target, merged=True, inlining=inlining + (ref,))
        return self.node(schema, merged=True, inlining=inlining)


def _anchored(node: Any, name: str) -> Optional[dict]:
    """The subschema whose `$anchor` is `name`, searched depth first, else None."""
    if isinstance(node, dict):
        if node.get("$anchor") == name:
            return node
        children = node.values()
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = _anchored(child, name)
        if found is not None:
            return found
    return None


def rebased(schema: Any, pointer: str) -> Any:
    """`schema` with its local pointer refs ("#/...") pointing into it where it sits at `pointer` of
    a larger schema (a tool's parameters inside the call object); anchor refs hold wherever it sits."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):  # (anchors stay)
            out[key] = "#" + pointer + value[1:]
        elif key in _SCHEMA_MAPS + ("dependentSchemas",) and isinstance(value, dict):
            out[key] = {k: rebased(v, pointer) for k, v in value.items()}
        elif key in _SCHEMA_ONE + _UNTOUCHED:
            out[key] = rebased(value, pointer)
        elif key in _SCHEMA_LISTS + _BRANCHES and isinstance(value, list):
            out[key] = [rebased(v, pointer) for v in value]
        else:
            out[key] = value
    return out

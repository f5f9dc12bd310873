"""Cut the server's operations out of OpenAI's official OpenAPI spec (3 MB) into a small spec,
openai_subset.json, that the schemathesis test loads in a fraction of a second.

    python tests/server/make_openai_subset.py [path/to/openai-openapi.yaml]

Everything is copied from the official spec (the four operations and every schema they reach),
then a short, listed set of changes states this server's contract where it knowingly differs:
fields it refuses are narrowed to the values it accepts (so valid-by-spec requests that it
rejects on purpose are not generated, while the refusals are still probed by negative tests),
its extension fields are added, and the statuses it answers with are documented.

It also writes openai_wide.json: the generating operations (chat, completions, responses) exactly
as the official spec has them, nothing narrowed (tools, tool messages, response formats,
logit_bias, echo, every Responses input item), for the test that only asks for no 5xx.
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = HERE.parents[2] / "shared" / "reference" / "openai-openapi.yaml"
OUTPUT = HERE / "openai_subset.json"
WIDE_OUTPUT = HERE / "openai_wide.json"
WIDE_OPERATIONS = {"/chat/completions": "post", "/completions": "post", "/responses": "post"}
OPERATIONS = {"/chat/completions": "post", "/completions": "post", "/models": "get", "/models/{model}": "get"}
# the fake engine's vocabulary (tests/server/fake_engine.py): prompt token ids must be below it
VOCAB_SIZE = 268
INT64 = {"minimum": -(2**63), "maximum": 2**63 - 1}

ERROR = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
RETRY_AFTER = {"Retry-After": {"schema": {"type": "integer", "minimum": 1, "maximum": 10}}}
ERRORS = {
    "400": {"description": "Invalid or unsupported request", **ERROR},
    "401": {"description": "Missing or wrong API key", **ERROR},
    "404": {"description": "No such route or model", **ERROR},
    "405": {"description": "Method not allowed", **ERROR},
    "413": {"description": "Request body too large", **ERROR},
    "503": {"description": "Busy (queue full) or loading", "headers": RETRY_AFTER, **ERROR},
}

TEXT_PART = {"$ref": "#/components/schemas/ChatCompletionRequestMessageContentPartText"}
EXTENSIONS = {  # sampling fields beyond OpenAI's, as llama.cpp and vLLM spell them (null: the default)
    "top_k": {"type": "integer", "minimum": -1, "maximum": 2**31 - 1, "nullable": True, "description": "0 or -1: off"},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 10, "nullable": True},
}


def referenced(node, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/"):
            found.add(ref)
        for value in node.values():
            referenced(value, found)
    elif isinstance(node, list):
        for value in node:
            referenced(value, found)


def null_unions(node):
    """The official file says openapi 3.1 but marks nullable fields the 3.0 way (`nullable: true`),
    which 3.1 tools ignore; spell those as 3.1 does, with null in the type."""
    if isinstance(node, list):
        return [null_unions(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: null_unions(v) for k, v in node.items()}
    if node.pop("nullable", False):
        if isinstance(node.get("type"), str) and not any(k in node for k in ("oneOf", "anyOf", "allOf", "$ref")):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            inner = {k: v for k, v in node.items() if k not in ("default",)}
            node = {"anyOf": [inner, {"type": "null"}]}
    return node


def strip_docs(node):
    if isinstance(node, dict):
        return {k: strip_docs(v) for k, v in node.items()
                if k not in ("description", "x-oaiMeta", "examples", "example", "title", "summary")
                or not isinstance(v, (str, dict, list)) or k == "properties"}
    if isinstance(node, list):
        return [strip_docs(v) for v in node]
    return node


def all_properties(schemas: dict, name: str) -> dict:
    """A request schema's properties, its allOf parts merged (later parts win, as in the spec)."""
    schema = schemas[name]
    merged: dict = {}
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            merged.update(all_properties(schemas, part["$ref"].rsplit("/", 1)[1]))
        merged.update(part.get("properties", {}))
    return merged


def only(props: dict, names: list[str]) -> dict:
    return {name: props[name] for name in names if name in props}


# The fields the server reads (validates, uses or refuses). Others are ignored, whatever their
# value, so they are not part of its contract and are left out.
CHAT_FIELDS = ["messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
               "stream", "stream_options", "n", "logprobs", "top_logprobs", "tools", "response_format", "logit_bias",
               "frequency_penalty", "presence_penalty", "user"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "stream",
                     "stream_options", "n", "logprobs", "echo", "best_of", "suffix", "logit_bias",
                     "frequency_penalty", "presence_penalty", "user"]


def null_is_absent(props: dict, required: list[str]) -> dict:
    """The server reads null as "not given" for every optional field."""
    return {name: schema if name in required else {**schema, "nullable": True} for name, schema in props.items()}


def apply_contract(spec: dict) -> None:
    schemas = spec["components"]["schemas"]

    # -- chat requests
    props = only(all_properties(schemas, "CreateChatCompletionRequest"), CHAT_FIELDS)
    props["tools"] = {"type": "array", "maxItems": 0, "items": {}}
    props["response_format"] = {"$ref": "#/components/schemas/ResponseFormatText"}
    props["logit_bias"] = {"type": "object", "maxProperties": 0, "nullable": True}
    props["seed"] = {"type": "integer", "nullable": True, **INT64}  # the spec's bounds are rounded past int64
    props["max_tokens"] = {"type": "integer", "minimum": 0, "nullable": True}
    props["max_completion_tokens"] = {"type": "integer", "minimum": 0, "nullable": True}
    props.update(EXTENSIONS)
    props["messages"]["items"] = {"oneOf": [
        {"$ref": "#/components/schemas/ChatCompletionRequestDeveloperMessage"},
        {"$ref": "#/components/schemas/ChatCompletionRequestSystemMessage"},
        {"$ref": "#/components/schemas/ChatCompletionRequestUserMessage"},
        {"$ref": "#/components/schemas/ChatCompletionRequestAssistantMessage"}],
        "discriminator": {"propertyName": "role"}}  # no tool or function messages
    # model is optional and ignored: the server has one model
    schemas["CreateChatCompletionRequest"] = {"type": "object", "properties": null_is_absent(props, ["messages"]),
                                              "required": ["messages"]}
    # text only: no image, audio or file parts; assistants without tool calls
    schemas["ChatCompletionRequestUserMessageContentPart"] = {"oneOf": [TEXT_PART]}
    schemas["ChatCompletionRequestAssistantMessageContentPart"] = {"oneOf": [TEXT_PART]}
    for role in ("Developer", "System", "User", "Assistant"):
        message = schemas[f"ChatCompletionRequest{role}Message"]
        message["properties"] = null_is_absent(only(message["properties"], ["role", "content", "name"]),
                                               message.get("required", []))
    text = schemas["ChatCompletionRequestMessageContentPartText"]
    text["properties"] = only(text["properties"], ["type", "text"])
    options = schemas["ChatCompletionStreamOptions"]["anyOf"][0]
    options["properties"] = null_is_absent(only(options["properties"], ["include_usage"]), [])
    # 0 to 16 stop strings (the spec says 1 to 4; chat apps send more, and some send [])
    for option in schemas["StopConfiguration"]["oneOf"]:
        if option.get("type") == "array":
            option["minItems"], option["maxItems"] = 0, 16

    # -- completion requests
    props = only(schemas["CreateCompletionRequest"]["properties"], COMPLETION_FIELDS)
    ids = {"type": "integer", "minimum": 0, "maximum": VOCAB_SIZE - 1}
    props["prompt"] = {"nullable": True, "oneOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "string"}},
        {"type": "array", "minItems": 1, "items": ids},
        {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "array", "minItems": 1, "items": ids}}]}
    props["best_of"] = {"type": "integer", "minimum": 0, "maximum": 1, "nullable": True}
    props["echo"] = {"type": "boolean", "nullable": True}
    props["suffix"] = {"type": "string", "maxLength": 0, "nullable": True}  # the test model has no FIM tokens
    props["logit_bias"] = {"type": "object", "maxProperties": 0, "nullable": True}
    props["seed"] = {"type": "integer", "nullable": True, **INT64}
    props.update(EXTENSIONS)
    schemas["CreateCompletionRequest"] = {"type": "object", "properties": null_is_absent(props, ["prompt"]),
                                          "required": ["prompt"]}

    # -- responses: streamed completions are events too, and the errors this server answers with.
    # The official file puts the chunk's schema where OpenAPI < 3.2 describes a whole event
    # ({data, event, id}); say it the 3.2 way: each event's data is "[DONE]" or a JSON chunk (or
    # an error, when the stream fails after it started).
    # The spec has no chunk schema for streamed completions: a chunk is a completion whose
    # finish_reason is null until the last one (as OpenAI sends them).
    # With echo, OpenAI's API gives the prompt's first token no logprob and no alternatives (null),
    # which the official file does not model: allow null items there.
    echo_logprobs = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]
    for option in echo_logprobs.get("anyOf", [echo_logprobs]):
        for name in ("token_logprobs", "top_logprobs"):
            if name in option.get("properties", {}):
                option["properties"][name]["items"]["nullable"] = True
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["nullable"] = True
    reason["enum"] = [*reason["enum"]]
    schemas["CreateCompletionStreamResponse"] = chunk
    for path, chunk in (("/chat/completions", "CreateChatCompletionStreamResponse"),
                        ("/completions", "CreateCompletionStreamResponse")):
        ok = spec["paths"][path]["post"]["responses"]["200"]["content"]
        ok["text/event-stream"] = {"itemSchema": {
            "type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [
                {"const": "[DONE]"},
                {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"},
                                             {"$ref": "#/components/schemas/ErrorResponse"}]}}]}}}}
    for path, method in OPERATIONS.items():
        responses = spec["paths"][path][method]["responses"]
        responses.pop("429", None)  # no rate limits; a full queue is a 503
        wanted = ("401", "404", "405", "503") if method == "get" else tuple(ERRORS)
        responses.update({code: ERRORS[code] for code in wanted})


def build(source: Path) -> dict:
    official = yaml.load(source.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    paths = {p: {m: copy.deepcopy(official["paths"][p][m])} for p, m in OPERATIONS.items()}
    spec = {"openapi": official["openapi"],
            "info": {"title": "OpenAI API, the operations moestream serves",
                     "version": official["info"]["version"]},
            "servers": [{"url": "/v1"}],
            "security": [{"ApiKeyAuth": []}],
            "paths": paths,
            "components": {"securitySchemes": {"ApiKeyAuth": official["components"]["securitySchemes"]["ApiKeyAuth"]},
                           "schemas": {}, "responses": {}}}
    # copy every component reachable from the operations
    pending: set[str] = set()
    referenced(paths, pending)
    referenced(ERRORS, pending)
    done: set[str] = set()
    while pending:
        ref = pending.pop()
        if ref in done:
            continue
        done.add(ref)
        _, _, kind, name = ref.split("/", 3)
        node = copy.deepcopy(official["components"][kind][name])
        spec["components"].setdefault(kind, {})[name] = node
        referenced(node, pending)
    apply_contract(spec)
    # keep exactly the components still reachable (the contract added some and dropped others)
    components = spec["components"]
    kept: dict = {"securitySchemes": components["securitySchemes"]}
    pending = set()
    referenced(spec["paths"], pending)
    while pending:
        ref = pending.pop()
        _, _, kind, name = ref.split("/", 3)
        if name in kept.get(kind, {}):
            continue
        node = components.get(kind, {}).get(name) or copy.deepcopy(official["components"][kind][name])
        kept.setdefault(kind, {})[name] = node
        referenced(node, pending)
    spec["components"] = kept
    return null_unions(strip_docs(spec))


def copy_operations(official: dict, operations: dict[str, str]) -> dict:
    """The operations and every component they reach, copied unchanged."""
    paths = {p: {m: copy.deepcopy(official["paths"][p][m])} for p, m in operations.items()}
    components: dict = {}
    pending: set[str] = set()
    referenced(paths, pending)
    while pending:
        ref = pending.pop()
        _, _, kind, name = ref.split("/", 3)
        if name in components.get(kind, {}):
            continue
        node = copy.deepcopy(official["components"][kind][name])
        components.setdefault(kind, {})[name] = node
        referenced(node, pending)
    return {"paths": paths, "components": components}


def build_wide(source: Path) -> dict:
    official = yaml.load(source.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    copied = copy_operations(official, WIDE_OPERATIONS)
    spec = {"openapi": official["openapi"],
            "info": {"title": "OpenAI API, the generating operations moestream serves, unchanged",
                     "version": official["info"]["version"]},
            "servers": [{"url": "/v1"}], **copied}
    return null_unions(strip_docs(spec))


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else DEFAULT_SOURCE
    for output, spec in ((OUTPUT, build(source)), (WIDE_OUTPUT, build_wide(source))):
        output.write_text(json.dumps(spec, indent=None, sort_keys=True, separators=(",", ":")) + "\n"
                          if output == WIDE_OUTPUT else json.dumps(spec, indent=1, sort_keys=True) + "\n")
        print(f"wrote {output} ({output.stat().st_size // 1024} KiB, {len(spec['components']['schemas'])} schemas)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

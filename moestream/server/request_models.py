"""The OpenAI request bodies the server accepts (chat and text completions), as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not a conversion),
unknown fields are ignored, JSON null means "not given" for every optional field, and ranges
follow OpenAI's published spec. Fields that the spec has but this server cannot honour (images,
audio, best_of > 1) are refused with a 400 that names the field, rather than silently ignored.
:func:`parse_request` turns pydantic's complaint into that 400. Never imports torch.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from moestream.server.api_error import APIError, invalid, unsupported

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_LOGIT_BIAS = 300
MAX_PROMPTS = 64


def _integral(value: Any) -> Any:
    # JSON has one number type: 3.0 is a valid JSON Schema integer, 3.5 and "3" are not
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Int = Annotated[int, BeforeValidator(_integral)]

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # clients (and SDKs) send null for "not given"; a required field keeps its null
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items()
                    if v is not None or (k in fields and fields[k].is_required())}
        return data

    def check(self) -> None:
        """What pydantic's field checks cannot say (an APIError); parse_request calls it."""


class StreamOptions(_Strict):
    include_usage: bool = False


class ChatMessage(_Strict):
    role: str
    # a string or a list of content parts; parts are checked by hand for clearer errors
    content: Union[str, list[Any], None] = None
    name: str = ""
    tool_calls: Optional[list[Any]] = None
    tool_call_id: str = ""


class _CommonRequest(_Strict):
    model: str = ""  # ignored: the server has one model
    max_tokens: Optional[Int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, ge=0, le=1)
    top_k: Optional[Int] = Field(None, ge=-1, le=2**31 - 1)  # 0 or -1: off
    min_p: Optional[float] = Field(None, ge=0, le=1)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    stop: Union[str, list[str], None] = None
    seed: Optional[Int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    n: Optional[Int] = Field(None, ge=1, le=128)
    logit_bias: Optional[dict[str, Union[Int, float]]] = None
    user: str = ""

    def check_common(self) -> None:
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise invalid(f"At most {MAX_STOP_STRINGS} stop strings are supported.", "stop")
        if self.logit_bias and len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise invalid(f"At most {MAX_LOGIT_BIAS} logit_bias entries are supported.", "logit_bias")
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise invalid(f"logit_bias keys are token ids; {key!r} is not an integer.", "logit_bias")
            if not -100 <= value <= 100:
                raise invalid(f"logit_bias values lie in -100..100; token {key} has {value}.", "logit_bias")

    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class FunctionDef(_Strict):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: Optional[bool] = None


class ToolDef(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class JSONSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str = ""
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class ChatCompletionRequest(_CommonRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[Int] = Field(None, ge=0)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDef] = Field(default_factory=list)
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    functions: list[Any] = Field(default_factory=list)
    response_format: ResponseFormat = Field(default_factory=lambda: ResponseFormat(type="text"))

    def check(self) -> None:
        self.check_common()
        if self.functions:
            raise unsupported("The legacy 'functions' field is not supported; use 'tools'.", "functions")
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise invalid("Tool names must be unique.", "tools")
        choice = self.tool_choice
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                              '{"type": "function", "function": {"name": ...}}.', "tool_choice")
            if name not in names:
                raise invalid(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
        elif choice == "required" and not self.tools:
            raise invalid("tool_choice 'required' needs at least one tool.", "tool_choice")
        if self.response_format.type == "json_schema" and self.response_format.json_schema is None:
            raise invalid("response_format of type 'json_schema' needs a 'json_schema' object.",
                          "response_format.json_schema", code="missing_required_parameter")
        if self.forced_tool is not None and self.response_format.type != "text":
            raise invalid("A required tool call and a response_format cannot both constrain the reply.",
                          "response_format")

    @property
    def tool_mode(self) -> str:
        """none | auto | required | named (tool_choice, defaulting to auto when tools are given)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, dict):
            return "named"
        return self.tool_choice or "auto"

    @property
    def forced_tool(self) -> Optional[str]:
        """The tools a call must come from: a name, "*" for any (required), None when not forced."""
        mode = self.tool_mode
        if mode == "named":
            return self.tool_choice["function"]["name"]  # type: ignore[index]
        return "*" if mode == "required" else None

    @property
    def max_new_tokens(self) -> int | None:
        # the newer name wins when both are given
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        # top_logprobs without logprobs: true asks for nothing (it is ignored, not refused)
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat_messages(self) -> list[dict]:
        """The conversation as plain dicts for the chat template: {role, content}, plus
        tool_calls on assistant messages and tool_call_id on tool results."""
        out = []
        for i, message in enumerate(self.messages):
            param = f"messages[{i}]"
            role = message.role
            if role not in ("system", "developer", "user", "assistant", "tool"):
                raise invalid(f"Unsupported message role {role!r}: use system, developer, user, assistant or tool.",
                              f"{param}.role")
            content = message.content
            if content is None:
                if role != "assistant":
                    raise invalid(f"A {role} message needs content.", f"{param}.content")
                text = ""
            elif isinstance(content, str):
                text = content
            else:
                text = _join_text_parts(content, f"{param}.content")
            # templates rarely know "developer"; it is OpenAI's newer name for system
            item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
            if message.tool_calls:
                if role != "assistant":
                    raise invalid("Only assistant messages carry tool_calls.", f"{param}.tool_calls")
                item["tool_calls"] = [_history_call(c, f"{param}.tool_calls[{j}]")
                                      for j, c in enumerate(message.tool_calls)]
            if role == "tool":
                if not message.tool_call_id:
                    raise invalid("A tool message needs the tool_call_id it answers.", f"{param}.tool_call_id",
                                  code="missing_required_parameter")
                item["tool_call_id"] = message.tool_call_id
                if message.name:
                    item["name"] = message.name
            out.append(item)
        return out


def _history_call(call: Any, param: str) -> dict:
    """An earlier assistant tool call, for the template: arguments as an object (what chat
    templates expect), the id and name as given."""
    import json

    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise invalid("A tool call needs a function with a name.", param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise invalid("A tool call's arguments must be a JSON string.", f"{param}.function.arguments") from None
    return {"id": str(call.get("id") or ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def text_parts(content: Any, param: str, *, kinds: tuple[str, ...], noun: str, refusal: str) -> str:
    """A string, or the texts of a list of parts of `kinds` joined by newlines (Anthropic's blocks,
    the Responses API's parts); `refusal` is the 400's message for any other part."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"content must be a string or a list of {noun}.", param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            raise invalid(refusal, f"{param}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _join_text_parts(parts: list[Any], param: str) -> str:
    if not parts:
        raise invalid("Message content must not be an empty list.", param)
    texts = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise invalid("Each content part must be an object with a type.", where, code="invalid_type")
        kind = part["type"]
        if kind in ("image_url", "image", "input_image", "input_audio", "file", "audio"):
            raise APIError(400, f"Content parts of type {kind!r} are not supported: this server takes text only.",
                           param=where, code="unsupported_content_type")
        if kind != "text":
            raise invalid(f"Unknown content part type {kind!r}.", where)
        if not isinstance(part.get("text"), str):
            raise invalid("A text part needs a string 'text'.", f"{where}.text", code="invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


class CompletionRequest(_CommonRequest):
    prompt: Union[str, list[str], list[Int], list[list[Int]], None] = Field(...)  # required; null: empty
    logprobs: Optional[Int] = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: Optional[bool] = None
    best_of: Optional[Int] = Field(None, ge=0, le=20)
    suffix: Optional[str] = None

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, 0, 1):
            raise unsupported("Only best_of=1 is supported.", "best_of")
        prompts = self.prompts()
        if not prompts:
            raise invalid("The prompt list is empty.", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise invalid(f"At most {MAX_PROMPTS} prompts per request.", "prompt")

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids, in order (one choice each, times n)."""
        p = self.prompt
        if p is None:
            return [""]
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return [q if isinstance(q, str) else list(q) for q in p]  # type: ignore[union-attr]


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "is-instance"}


def _param_from_loc(loc: tuple) -> str | None:
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_NAMES:
            param += ("." if param else "") + part
        # union member tags such as 'list[str]' or 'function-after[...]' are not fields
    return param or None


def parse_request(cls: type[_Strict], data: dict) -> Any:
    """Validate a decoded JSON object, turning pydantic's complaint into a 400 APIError."""
    try:
        request = cls.model_validate(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _param_from_loc(tuple(first.get("loc", ())))
        kind = first.get("type", "")
        code = "missing_required_parameter" if kind == "missing" else (
            "invalid_type" if kind.endswith("_type") or kind in ("union_tag_invalid", "model_type") else "invalid_value")
        where = f" for '{param}'" if param else ""
        raise invalid(f"Invalid value{where}: {first.get('msg', 'invalid')}.", param, code=code) from None
    request.check()
    return request


class TokenizeRequest(_Strict):
    """llama.cpp's POST /tokenize."""

    content: str
    add_special: bool = False  # the tokenizer's special tokens (BOS) around the text
    with_pieces: bool = False  # each id with its piece: text, or its bytes where they are not UTF-8


class DetokenizeRequest(_Strict):
    """llama.cpp's POST /detokenize."""

    tokens: list[Int]

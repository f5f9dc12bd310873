"""The OpenAI response bodies the server sends (completions, stream chunks, usage, timings, models).

Plain pydantic models with no checks of their own: the server builds them, so they are trusted.
:func:`timings_from_receipt` turns the engine's per-request receipt into llama.cpp-style timings.
Never imports torch.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    """The tokens of the replies' reasoning; speculative decoding's drafted tokens that the model
    kept and that it rejected (OpenAI's names for a prediction's tokens), 0 without speculation."""

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)


class Timings(BaseModel):
    """llama.cpp's timing names, plus where the prompt's tokens and the experts came from."""

    prompt_n: int  # prompt tokens computed in this request (the rest came from the KV cache)
    prompt_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    cache_n: int  # prompt tokens reused from the previous request's KV cache
    prefill_tokens: int
    reused_tokens: int
    expert_hit_rate: Optional[float] = None
    expert_misses: Optional[int] = None
    bytes_read_disk: Optional[int] = None
    bytes_read_host: Optional[int] = None
    read_wait_ms: Optional[float] = None
    queue_ms: float = 0.0
    # speculative decoding (llama.cpp's draft_n, draft_n_accepted): the drafter, or why the server's
    # speculation did not run for this request
    speculative: Optional[str] = None
    speculative_off: Optional[str] = None
    draft_n: Optional[int] = None
    draft_n_accepted: Optional[int] = None
    tokens_per_step: Optional[float] = None


def timings_from_receipt(receipt: dict, *, queue_s: float = 0.0) -> Timings:
    def num(key: str, default: float = 0.0) -> float:
        value = receipt.get(key)
        return float(value) if isinstance(value, (int, float)) else default

    def opt_int(key: str) -> int | None:
        value = receipt.get(key)
        return int(value) if isinstance(value, (int, float)) else None

    prefill = int(num("prefill_tokens"))
    reused = int(num("reused_tokens"))
    wait = receipt.get("read_wait_s")
    hit = receipt.get("hit_rate")
    spec = receipt.get("speculative") if isinstance(receipt.get("speculative"), dict) else {}
    off = receipt.get("speculative_off")
    return Timings(
        prompt_n=prefill,
        prompt_ms=num("prefill_s") * 1000.0,
        prompt_per_second=num("prefill_tok_s"),
        predicted_n=int(num("generated_tokens")),
        predicted_ms=num("decode_s") * 1000.0,
        predicted_per_second=num("decode_tok_s"),
        cache_n=reused,
        prefill_tokens=prefill,
        reused_tokens=reused,
        expert_hit_rate=float(hit) if isinstance(hit, (int, float)) else None,
        expert_misses=opt_int("misses"),
        bytes_read_disk=opt_int("bytes_read_disk"),
        bytes_read_host=opt_int("bytes_read_host"),
        read_wait_ms=float(wait) * 1000.0 if isinstance(wait, (int, float)) else None,
        queue_ms=queue_s * 1000.0,
        speculative=spec.get("drafter") if isinstance(spec.get("drafter"), str) else None,
        speculative_off=off if isinstance(off, str) else None,
        draft_n=spec.get("drafted") if isinstance(spec.get("drafted"), int) else None,
        draft_n_accepted=spec.get("accepted") if isinstance(spec.get("accepted"), int) else None,
        tokens_per_step=float(spec["tokens_per_step"]) if isinstance(spec.get("tokens_per_step"), (int, float)) else None,
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprob]] = None
    refusal: Optional[list[TokenLogprob]] = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # the model's reasoning, apart from the content
    refusal: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: dict[str, Any]  # {"role": "assistant", "content": ""} first, then {"content": ...} or
    # {"tool_calls": [...]}, {} at the end
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[FinishReason] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    timings: Optional[Timings] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[Literal["stop", "length"]] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: Optional[str] = None
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    timings: Optional[Timings] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "moestream"
    max_context: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

"""The OpenAI request and response shapes the server speaks, in one place to import them from.

The shapes live in three small modules, one concern each: :mod:`~moestream.server.api_error`
(the error every refusal becomes), :mod:`~moestream.server.request_models` (request bodies and
their strict validation) and :mod:`~moestream.server.response_models` (what the server sends
back). The API handlers import them from here. This module never imports torch: it is plain data
and checks.
"""
from __future__ import annotations

from moestream.server.api_error import APIError, invalid, unsupported
from moestream.server.request_models import (INT64_MAX, INT64_MIN, MAX_COMPLETION_LOGPROBS, MAX_LOGIT_BIAS,
                                             MAX_PROMPTS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, ChatCompletionRequest,
                                             ChatMessage, CompletionRequest, FunctionDef, Int, JSONSchemaFormat,
                                             ResponseFormat, StreamOptions, ToolDef, parse_request)
from moestream.server.response_models import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                              ChoiceLogprobs, Completion, CompletionChoice, CompletionLogprobs,
                                              CompletionTokensDetails, FinishReason, FunctionCall, ModelCard,
                                              ModelList, PromptTokensDetails, ResponseMessage, Timings, TokenLogprob,
                                              ToolCall, TopLogprob, Usage, timings_from_receipt)

__all__ = [
    "APIError", "invalid", "unsupported",
    "INT64_MAX", "INT64_MIN", "MAX_COMPLETION_LOGPROBS", "MAX_LOGIT_BIAS", "MAX_PROMPTS", "MAX_STOP_STRINGS",
    "MAX_TOP_LOGPROBS", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "FunctionDef", "Int",
    "JSONSchemaFormat", "ResponseFormat", "StreamOptions", "ToolDef", "parse_request",
    "ChatChoice", "ChatChunkChoice", "ChatCompletion", "ChatCompletionChunk", "ChoiceLogprobs", "Completion",
    "CompletionChoice", "CompletionLogprobs", "CompletionTokensDetails", "FinishReason", "FunctionCall", "ModelCard",
    "ModelList", "PromptTokensDetails", "ResponseMessage", "Timings", "TokenLogprob", "ToolCall", "TopLogprob",
    "Usage", "timings_from_receipt",
]

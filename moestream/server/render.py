"""Pieces of the answers every API shares: server-sent events, usage, logprobs. Plain data."""
from __future__ import annotations

import json
from typing import Any

from moestream.server.jobs import Failed, Finished, TokenLogprobInfo
from moestream.server.protocol import (ChoiceLogprobs, CompletionLogprobs, CompletionTokensDetails, PromptTokensDetails,
                                       TokenLogprob, TopLogprob, Usage)


def sse(payload: Any) -> str:
    if hasattr(payload, "model_dump_json"):
        return f"data: {payload.model_dump_json(exclude_none=False)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def without_nulls(body: dict, *keys: str) -> dict:
    for key in keys:
        if body.get(key) is None:
            body.pop(key, None)
    return body


def usage(ends: list[Finished], n: int = 1, *, reasoning_tokens: int = 0) -> Usage:
    """One usage for all of a request's choices: each prompt counted once (choice p*n is prompt
    p's first), every completion (`reasoning_tokens` of them the replies' reasoning)."""
    firsts = [end for end in ends if end.index % n == 0]
    prompt_tokens = sum(end.prompt_tokens for end in firsts)
    completion = sum(end.completion_tokens for end in ends)
    reused = sum(int(end.receipt.get("reused_tokens", 0) or 0) for end in firsts)
    drafted = accepted = 0
    for end in ends:
        spec = end.receipt.get("speculative")
        if isinstance(spec, dict):
            drafted, accepted = drafted + int(spec.get("drafted") or 0), accepted + int(spec.get("accepted") or 0)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=reused),
                 completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens,
                                                                   accepted_prediction_tokens=accepted,
                                                                   rejected_prediction_tokens=drafted - accepted))


def chat_logprobs(infos: list[TokenLogprobInfo]) -> ChoiceLogprobs:
    return ChoiceLogprobs(content=[
        TokenLogprob(token=i.token, logprob=i.logprob, bytes=list(i.token.encode("utf-8")),
                     top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8"))) for t, lp in i.top])
        for i in infos])


def completion_logprobs(infos: list[TokenLogprobInfo], offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for info in infos:
        out.tokens.append(info.token)
        out.token_logprobs.append(info.logprob)
        top: dict[str, float] = {}
        for text, lp in info.top:
            top.setdefault(text, lp)
        # the prompt's first token has nothing before it: null, as OpenAI gives it
        out.top_logprobs.append(None if info.logprob is None else top)
        out.text_offset.append(offset)
        offset += len(info.token)
    return out


def error_event(event: Failed) -> str:
    return sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": event.code}})


def named_sse(name: str, payload: dict) -> str:
    """An event with a name (Anthropic's and the Responses API's streams)."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"

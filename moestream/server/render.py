"""Pieces of the answers every API shares, as the JSON they are sent as: server-sent events, OpenAI's
answer head, usage and logprobs, and llama.cpp-style timings from a choice's receipt. Plain data."""
from __future__ import annotations

import json
from typing import Any, Optional

from moestream.server.jobs import Failed, Finished, TokenLogprobInfo

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def named_sse(name: str, payload: dict) -> str:
    """An event with a name (Anthropic's and the Responses API's streams)."""
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


def error_event(event: Failed) -> str:
    return sse({"error": {"message": event.message, "type": "server_error", "param": None, "code": event.code}})


def openai_answer(meta: dict, kind: str, choices: list[dict], **rest: Any) -> dict:
    """An OpenAI answer (`kind`: its object name): id, object, created, model, system_fingerprint,
    then its choices and the rest."""
    return {"id": meta["id"], "object": kind, "created": meta["created"], "model": meta["model"],
            "system_fingerprint": meta["system_fingerprint"], "choices": choices, **rest}


def usage(ends: list[Finished], n: int = 1, *, reasoning_tokens: int = 0) -> dict:
    """One usage for all of a request's choices: each prompt counted once (choice p*n is prompt
    p's first), every completion (`reasoning_tokens` of them the replies' reasoning); speculative
    decoding's drafted tokens that the model kept and that it rejected (OpenAI's names for a
    prediction's tokens), 0 without speculation."""
    firsts = [end for end in ends if end.index % n == 0]
    prompt_tokens = sum(end.prompt_tokens for end in firsts)
    completion = sum(end.completion_tokens for end in ends)
    reused = sum(int(end.receipt.get("reused_tokens", 0) or 0) for end in firsts)
    drafted = accepted = 0
    for end in ends:
        spec = end.receipt.get("speculative")
        if isinstance(spec, dict):
            drafted, accepted = drafted + int(spec.get("drafted") or 0), accepted + int(spec.get("accepted") or 0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": reused},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens, "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted}}


def timings(end: Finished) -> dict:
    """llama.cpp's timing names for a choice's receipt (prompt_n: the prompt tokens computed, cache_n:
    those reused from the KV cache), plus where the experts came from, the queue wait, and speculative
    decoding (llama.cpp's draft_n, draft_n_accepted): the drafter, or why it did not run."""
    receipt = end.receipt
    spec = receipt.get("speculative") if isinstance(receipt.get("speculative"), dict) else {}

    def number(key: str, kind: type = float, source: dict = receipt) -> Any:  # None where there is none
        value = source.get(key)
        return kind(value) if isinstance(value, (int, float)) else None

    def text(value: Any) -> Optional[str]:
        return value if isinstance(value, str) else None

    prefill, reused, wait = number("prefill_tokens", int) or 0, number("reused_tokens", int) or 0, number("read_wait_s")
    return {"prompt_n": prefill, "prompt_ms": (number("prefill_s") or 0.0) * 1000.0,
            "prompt_per_second": number("prefill_tok_s") or 0.0, "predicted_n": number("generated_tokens", int) or 0,
            "predicted_ms": (number("decode_s") or 0.0) * 1000.0, "predicted_per_second": number("decode_tok_s") or 0.0,
            "cache_n": reused, "prefill_tokens": prefill, "reused_tokens": reused, "expert_hit_rate": number("hit_rate"),
            "expert_misses": number("misses", int), "bytes_read_disk": number("bytes_read_disk", int),
            "bytes_read_host": number("bytes_read_host", int), "read_wait_ms": None if wait is None else wait * 1000.0,
            "queue_ms": end.queue_s * 1000.0, "speculative": text(spec.get("drafter")),
            "speculative_off": text(receipt.get("speculative_off")),
            "draft_n": spec.get("drafted") if isinstance(spec.get("drafted"), int) else None,
            "draft_n_accepted": spec.get("accepted") if isinstance(spec.get("accepted"), int) else None,
            "tokens_per_step": number("tokens_per_step", source=spec)}


def _scored(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(infos: list[TokenLogprobInfo]) -> dict:
    return {"content": [{**_scored(i.token, i.logprob), "top_logprobs": [_scored(t, lp) for t, lp in i.top]}
                        for i in infos], "refusal": None}


def completion_logprobs(infos: list[TokenLogprobInfo], offset: int) -> dict:
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for info in infos:
        out["tokens"].append(info.token)
        out["token_logprobs"].append(info.logprob)
        top: dict[str, float] = {}
        for text, lp in info.top:
            top.setdefault(text, lp)
        # the prompt's first token has nothing before it: null, as OpenAI gives it
        out["top_logprobs"].append(None if info.logprob is None else top)
        out["text_offset"].append(offset)
        offset += len(info.token)
    return out

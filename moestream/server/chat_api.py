"""OpenAI's /chat/completions and /completions: requests to Jobs, events to answers (whole or
streamed), with n choices, tool calls, constrained output and echo."""
from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from moestream.server.generation import (JobStream, Runtime, Submitted, events, finish_reason, make_choices,
                                         wait_whole)
from moestream.server.jobs import Failed, Finished, PromptLogprobs, Started, TextDelta
from moestream.server.api_error import invalid
from moestream.server.request_models import ChatCompletionRequest, CompletionRequest, parse_request
from moestream.server.reasoning import Reasoning, ReplyReader, reasoning_mode, split_reply
from moestream.server.render import (DONE, chat_logprobs, completion_logprobs, error_event, openai_answer, sse,
                                     timings, usage)
from moestream.server.tools import tool_schemas

FIM_TOKENS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


async def constraint(rt: Runtime, req: ChatCompletionRequest, tools: Optional[list[dict]]):
    """(A factory of fresh grammar masks, given a choice's token budget, for a forced tool call or a
    response_format, or None; the format a forced call is written in, or None)."""
    from moestream.server import grammar as g

    forced = None
    try:
        if req.forced_tool is not None:
            text, forced = g.tool_call_grammar(tools or [], req.forced_tool, parallel=req.parallel_tool_calls,
                                               fmt=rt.tool_format(), token_id=rt.tokenizer().token_id)
            param = "tool_choice"
        elif req.response_format.type == "json_object":
            text, param = g.json_object_grammar(), "response_format"
        elif req.response_format.type == "json_schema":
            text, param = g.json_schema_grammar(req.response_format.json_schema.schema_), "response_format"
        else:
            return None, None
    except g.GrammarError as exc:
        raise invalid(f"The response_format cannot be enforced: {exc}.", "response_format") from None
    return await rt.grammar_masks(text, param, closing=forced is not None), forced


async def chat_prompt(rt: Runtime, req: ChatCompletionRequest) -> tuple[list[int], Optional[list[dict]]]:
    """(The prompt's token ids as the chat template renders the request, the tools it was given)."""
    rt.tokenizer()
    messages = req.chat_messages()
    tools = tool_schemas(req.tools) if req.tool_mode != "none" else None
    return await rt.chat_ids(messages, tools), tools


async def start_chat(rt: Runtime, request: Request, req: ChatCompletionRequest) -> Submitted:
    """Validate, render and queue a chat request (also what the other APIs translate into)."""
    prompt_ids, tools = await chat_prompt(rt, req)
    masks, forced_format = await constraint(rt, req, tools)
    max_new, base = rt.plan(req, prompt_ids, "messages")
    reasoning = await reasoning_mode(rt, prompt_ids, constrained=masks is not None)
    choices = make_choices([prompt_ids], req.n or 1, [max_new], [base],
                           processor=(lambda: masks(max_new)) if masks is not None else None)
    sub = rt.submit(request, choices, stream=bool(req.stream), stops=req.stop_list(), logprobs=req.logprobs_k,
                    prefix="chatcmpl-")
    sub.reasoning = reasoning
    # the format's name; a forced call is written in the form its grammar spells out. Harmony
    # replies are always read: their channels are markup, and only the final one is the answer
    fmt = forced_format if req.forced_tool is not None else rt.tool_format()
    sub.parse_tools = fmt if req.tool_mode != "none" or fmt == "harmony" else ""
    return sub


def chat_message(deltas: list[tuple[str, int]], reader: Optional[ReplyReader], reason: str) -> tuple[dict, str, int]:
    """(the message, its finish reason, its reasoning tokens) from a choice's deltas. The spec has
    tool_calls (and our reasoning_content) absent, not null, when there are none."""
    if reader is None:
        thought, content, calls, tokens = "", "".join(text for text, _ in deltas), [], 0
    else:
        (thought, content, calls), tokens = split_reply(reader.read(deltas)), reader.reasoning_tokens
    message: dict[str, Any] = {"role": "assistant", "content": (content or None) if calls else content}
    if thought:
        message["reasoning_content"] = thought
    message["refusal"] = None
    if calls:  # without calls: the text, less any markup and reasoning
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
    return message, "tool_calls" if calls else reason, tokens


async def completion_prompts(rt: Runtime, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    """(each prompt's token ids, its text for echo): text is tokenized, token ids checked against the
    vocabulary; with a suffix, the prompt is framed for fill-in-the-middle."""
    tokenizer = rt.tokenizer()
    texts, prompts = [], []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            ids = await run_in_threadpool(tokenizer.encode, prompt, True)
            texts.append(prompt)
        else:
            vocab = tokenizer.vocab_size
            bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise invalid(f"Token id {bad[0]} is outside the vocabulary (0..{(vocab or 0) - 1}).", "prompt")
            ids = prompt
            # its text only for echo: a decode per request takes the tokenizer's lock from the engine thread
            texts.append(await run_in_threadpool(tokenizer.decode, ids) if req.echo else "")
        if req.suffix:  # an empty suffix is no suffix
            fim = [tokenizer.token_id(t) for t in FIM_TOKENS]
            if None in fim:
                raise invalid("suffix needs fill-in-the-middle tokens (<|fim_prefix|>, <|fim_suffix|>, "
                              "<|fim_middle|>), and this model has none.", "suffix", code="unsupported_parameter")
            middle = await run_in_threadpool(tokenizer.encode, req.suffix, False)
            body = ids if not isinstance(prompt, str) else await run_in_threadpool(tokenizer.encode, prompt, False)
            ids = [fim[0], *body, fim[1], *middle, fim[2]]
        prompts.append(ids)
    return prompts, texts


def register(router: APIRouter, rt: Runtime) -> None:
    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await rt.read_object(request))
        sub = await start_chat(rt, request, req)
        if req.stream:
            return JobStream(sub.job, chat_stream(sub, req.include_usage))
        end = await wait_whole(request, sub, "messages")
        if end is None:  # the client left; nobody reads this
            return Response(status_code=499)
        ends = sub.sink.choice_ends()
        choices, thinking = [], 0
        for i, e in enumerate(ends):
            message, reason, tokens = chat_message(sub.sink.deltas(i), sub.reply_reader(), finish_reason(e))
            thinking += tokens
            logprobs = chat_logprobs(sub.sink.logprobs.get(i, [])) if req.logprobs_k is not None else None
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        return JSONResponse(openai_answer(sub.meta, "chat.completion", choices,
                                          usage=usage(ends, len(ends), reasoning_tokens=thinking), timings=timings(end)))

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await rt.read_object(request))
        prompts, texts = await completion_prompts(rt, req)
        plans = [rt.plan(req, ids, "prompt") for ids in prompts]
        n = req.n or 1
        echo_scores = bool(req.echo) and req.logprobs_k is not None
        choices = make_choices(prompts, n, [m for m, _ in plans], [s for _, s in plans], echo=echo_scores)
        sub = rt.submit(request, choices, stream=bool(req.stream), stops=req.stop_list(), logprobs=req.logprobs_k,
                        prefix="cmpl-")
        echoes = [texts[i // n] if req.echo else "" for i in range(len(choices))]
        if req.stream:
            return JobStream(sub.job, completion_stream(sub, req.include_usage, echoes, n))
        end = await wait_whole(request, sub, "prompt")
        if end is None:
            return Response(status_code=499)
        ends = sub.sink.choice_ends()
        out = []
        for i, e in enumerate(ends):
            logprobs = None
            if req.logprobs_k is not None:
                scored = sub.sink.prompts.get(i)
                logprobs = completion_logprobs((scored.logprobs if scored else []) + sub.sink.logprobs.get(i, []), 0)
            out.append({"index": i, "text": echoes[i] + sub.sink.text(i), "logprobs": logprobs,
                        "finish_reason": finish_reason(e)})
        return JSONResponse(openai_answer(sub.meta, "text_completion", out, usage=usage(ends, n), timings=timings(end)))


def last_chunks(end: Finished, chunk: Callable[..., str], head: dict, total: dict, include_usage: bool) -> list[str]:
    """A choice's last chunk (its finish_reason: `chunk()`); after the job's last choice, its usage and
    timings, in a chunk with no choices (include_usage) or in that last chunk, then the end of the stream."""
    out = [chunk()] if not end.last or include_usage else []
    if end.last:
        out.append(sse({**head, "choices": [], "usage": total, "timings": timings(end)}) if include_usage else
                   chunk(usage=total, timings=timings(end)))
        out.append(DONE)
    return out


async def chat_stream(sub: Submitted, include_usage: bool) -> AsyncIterator[str]:
    wants_logprobs = sub.job.logprobs is not None
    readers = {i: reader for i in range(sub.choices) if (reader := sub.reply_reader()) is not None}
    calls: dict[int, int] = {}
    ends: list[Finished] = []

    def chunk(index: int, delta: dict, *, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse(openai_answer(sub.meta, "chat.completion.chunk", [choice], **{"usage": None, "timings": None, **extra}))

    def pieces(index: int, parts: list) -> list[str]:
        out = []
        for part in parts:
            if isinstance(part, Reasoning):
                out.append(chunk(index, {"reasoning_content": part.text}))
            elif isinstance(part, str):
                out += [chunk(index, {"content": part})] if part else []
            else:
                k = calls[index] = calls.get(index, 0) + 1
                # like OpenAI: the call's id and name first, then its arguments
                out.append(chunk(index, {"tool_calls": [{"index": k - 1, "id": part.id, "type": "function",
                                                         "function": {"name": part.name, "arguments": ""}}]}))
                out.append(chunk(index, {"tool_calls": [{"index": k - 1, "function": {"arguments": part.arguments}}]}))
        return out

    async for event in events(sub):
        if isinstance(event, Started):
            for i in range(sub.choices):
                yield chunk(i, {"role": "assistant", "content": ""})
        elif isinstance(event, TextDelta):
            logprobs = chat_logprobs(event.logprobs) if wants_logprobs else None
            if event.index in readers:
                for text in pieces(event.index, readers[event.index].feed(event.text, event.tokens)):
                    yield text
                if logprobs is not None and event.logprobs:
                    yield chunk(event.index, {}, logprobs=logprobs)
            else:
                yield chunk(event.index, {"content": event.text}, logprobs=logprobs)
        elif isinstance(event, Finished):
            ends.append(event)
            for text in pieces(event.index, readers[event.index].finish()) if event.index in readers else []:
                yield text
            reason = "tool_calls" if calls.get(event.index) else finish_reason(event)
            logprobs = chat_logprobs(event.logprobs) if wants_logprobs and event.logprobs else None
            total = usage(ends, len(ends), reasoning_tokens=sum(reader.reasoning_tokens for reader in readers.values()))
            head = openai_answer(sub.meta, "chat.completion.chunk", [])
            for text in last_chunks(event, lambda **extra: chunk(event.index, {}, finish=reason, logprobs=logprobs,
                                                                 **extra), head, total, include_usage):
                yield text
        elif isinstance(event, Failed):
            yield error_event(event)
            yield DONE


async def completion_stream(sub: Submitted, include_usage: bool, echoes: list[str], n: int) -> AsyncIterator[str]:
    wants_logprobs = sub.job.logprobs is not None
    offsets = {i: 0 for i in range(sub.choices)}
    ends: list[Finished] = []

    def chunk(index: int, text: str, *, finish: str | None = None, logprobs: Any = None, **extra: Any) -> str:
        # a completion's usage is an object when present (no nulls, unlike chat chunks)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse(openai_answer(sub.meta, "text_completion", [choice], **extra))

    def logged(index: int, infos) -> Any:
        if not wants_logprobs:
            return None
        out = completion_logprobs(infos, offsets[index])
        offsets[index] += sum(len(i.token) for i in infos)
        return out

    async for event in events(sub):
        if isinstance(event, Started):
            for i, echo in enumerate(echoes):
                if echo and not wants_logprobs:
                    yield chunk(i, echo)
        elif isinstance(event, PromptLogprobs):
            yield chunk(event.index, echoes[event.index], logprobs=logged(event.index, event.logprobs))
        elif isinstance(event, TextDelta):
            yield chunk(event.index, event.text, logprobs=logged(event.index, event.logprobs))
        elif isinstance(event, Finished):
            ends.append(event)
            logprobs = logged(event.index, event.logprobs) if event.logprobs else None
            head = openai_answer(sub.meta, "text_completion", [])
            for text in last_chunks(event, lambda **extra: chunk(event.index, "", finish=finish_reason(event),
                                                                 logprobs=logprobs, **extra),
                                    head, usage(ends, n), include_usage):
                yield text
        elif isinstance(event, Failed):
            yield error_event(event)
            yield DONE

"""llama.cpp's POST /tokenize and POST /detokenize: the model's tokenizer over HTTP, in llama.cpp's
shapes, for clients that count or inspect tokens before they send a prompt."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from moestream.errors import NoTokenizerError
from moestream.server.api_error import invalid
from moestream.server.generation import Runtime
from moestream.server.request_models import DetokenizeRequest, TokenizeRequest, parse_request


def _pieces(rt: Runtime, ids: list[int]) -> list[dict]:
    """[{"id", "piece"}]: the piece is the token's text, or its bytes (a list of integers) where they
    are not whole UTF-8 (a character split over tokens), as llama.cpp gives them."""
    from moestream.server.grammar import GrammarError

    try:
        vocabulary = rt.grammar_tokenizer().ll  # each token's exact bytes
    except GrammarError:  # a tokenizer without a byte view: each token decoded alone
        vocabulary = None
    tokenizer = rt.tokenizer()
    out = []
    for tid in ids:
        if vocabulary is None:
            piece: Any = tokenizer.decode([tid])
        else:
            raw = vocabulary.decode_bytes([tid])
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
        out.append({"id": tid, "piece": piece})
    return out


def register(router: APIRouter, rt: Runtime) -> None:
    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req: TokenizeRequest = parse_request(TokenizeRequest, await rt.read_object(request))
        ids = await run_in_threadpool(rt.tokenizer().encode, req.content, req.add_special)
        tokens: list[Any] = await run_in_threadpool(_pieces, rt, ids) if req.with_pieces else ids
        return JSONResponse({"tokens": tokens})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await rt.read_object(request))
        tokenizer = rt.tokenizer()
        vocab = tokenizer.vocab_size
        if vocab is None:
            raise NoTokenizerError("this model has no tokenizer files")
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"Token id {req.tokens[bad]} is outside the vocabulary (0..{vocab - 1}).", f"tokens[{bad}]")
        return JSONResponse({"content": await run_in_threadpool(tokenizer.decode, req.tokens)})

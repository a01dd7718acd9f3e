"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes
(docs/operations.md#api-surface).

- ``/tokenize``: a ``prompt`` (``add_special_tokens``, default true) or chat ``messages``
  rendered by the chat template as ``/v1/chat/completions`` renders them
  (``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
  ``chat_template_kwargs``; ``add_special_tokens`` default false, as the template writes
  them) -> ``{count, max_model_len, tokens, token_strs}`` (``token_strs`` only with
  ``return_token_strs``).
- ``/detokenize``: ``tokens`` -> ``{prompt}``; an id outside the vocabulary is a 400
  naming ``tokens``.

Tokenizing and decoding run off the event loop, like the generation routes'.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictInt, model_validator

from tidal.frontend.processor import ProcessedPrompt
from tidal.launch import openai_models as P
from tidal.launch.errors import APIError, classify_error
from tidal.launch.http_limits import read_json

if TYPE_CHECKING:
    from tidal.launch.serving import OpenAIServing


class TokenizeRequest(BaseModel):
    """vLLM's two tokenize requests in one: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[P.ChatMessage] | None = None
    # Default: true for a prompt, false for messages (the template writes them).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Refused unless empty, as on /v1/chat/completions: a count without them would be wrong.
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages must be given")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> TokenizeResponse:
    if req.tools:
        raise APIError(400, "tools is not supported by this server", param="tools")
    tokenizer = serving.tokenizer
    if req.messages is not None:
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        prompt: ProcessedPrompt = await serving.render_chat(req)
        ids = prompt.prompt_token_ids
        if req.add_special_tokens and prompt.prompt is not None:
            text = prompt.prompt
            ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=True)
    else:
        assert req.prompt is not None  # the model's validator
        special = req.add_special_tokens is not False
        ids = await asyncio.to_thread(tokenizer.encode, req.prompt, add_special_tokens=special)
    strs = None
    if req.return_token_strs:
        strs = await asyncio.to_thread(tokenizer.convert_ids_to_tokens, ids)
    return TokenizeResponse(
        count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs
    )


async def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    vocab = serving.engine.input_processor.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(
            400, f"tokens: token id {bad} is out of range for vocab size {vocab}", param="tokens"
        )
    try:
        text = await asyncio.to_thread(serving.tokenizer.decode, req.tokens)
    except Exception as e:  # noqa: BLE001 - an id the tokenizer has no piece for
        raise APIError(400, f"tokens: cannot decode: {e}", param="tokens") from None
    return DetokenizeResponse(prompt=text)


def add_tokenize_routes(app: FastAPI, serving: OpenAIServing) -> None:
    async def handle(request: Request, model: type[BaseModel], run: Any) -> Response:
        try:
            req = await read_json(request, model)
            serving.check_model(req.model)
            return JSONResponse((await run(serving, req)).model_dump())
        except Exception as e:  # noqa: BLE001 - every failure becomes OpenAI's error JSON
            return classify_error(e, serving.engine).response()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await handle(request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await handle(request, DetokenizeRequest, detokenize)

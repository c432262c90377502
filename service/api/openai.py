"""vLLM's encoder-instance protocol, an adapter over the same encode path as /encode: what vLLM's EPD proxy
(examples/online_serving/disaggregated_encoder/disagg_epd_proxy.py in vLLM's repository) calls an encoder
(`vllm serve --mm-encoder-only`) with, so that this service can stand in its place.

    POST /v1/chat/completions   the user's chat request, sent by the proxy with max_tokens=1 and stream false:
                                every image_url and video_url part of every message is encoded and stored
                                (under vLLM's own key for it with --vllm-model-id: the LM that reads the
                                store computes that key itself), text parts are ignored; the answer is a
                                chat.completion with no text, finished by its length, its prompt tokens the
                                items' tokens
    GET  /v1/models             the model the LM serves (--vllm-model-id), or this encoder's

Errors answer in the OpenAI API's shape (errors.openai_body), with the same statuses as /encode's.
Per-request hash factors (vLLM's mm_processor_kwargs, media_io_kwargs) change vLLM's keys and this
encoder's preprocessing would ignore them: they are refused (422 unsupported_parameter).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.api.encode import Answer, Input
from service.api.parse import inputs_from_parts, read_json_body
from service.api.runtime import Runtime
from service.api.schemas import ImagePart, Urgent, VideoPart, describe_invalid
from service.errors import RequestError

# The content-part types of vLLM's chat API that carry media this encoder does not take.
_OTHER_MEDIA = frozenset({"input_audio", "audio_url", "image_embeds", "image_pil", "input_image", "file"})


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(Urgent):
    """What of a chat request this encoder reads; the rest (sampling, tools, ...) is the LM's and is ignored."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None


def served_model(rt: Runtime) -> str:
    """The model id /v1/models lists and a chat request may name: the LM's (--vllm-model-id), else this
    encoder's --model."""
    return rt.settings.vllm_model_id or rt.settings.model


async def parse_chat(rt: Runtime, request: Request) -> tuple[ChatRequest, list[Input] | None, Urgent]:
    """The chat request, its media parts as encode Inputs, in order (None: the client left while a URL
    was fetched), and its priority and deadline (the request's own fields). RequestError for a body that is not a chat request, a model this encoder does not serve,
    hash factors, or media it does not take."""
    body = await read_json_body(request, rt.settings)
    try:
        chat = ChatRequest.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(describe_invalid(e)) from None
    model = served_model(rt)
    if rt.settings.vllm_model_id is not None and chat.model is not None and chat.model != model:
        raise RequestError(f"the model {chat.model!r} is not served here: this encoder serves {model!r} "
                           "(--vllm-model-id)", code="not_found")
    factors = [name for name in ("mm_processor_kwargs", "media_io_kwargs") if getattr(chat, name)]
    if factors:
        raise RequestError(f"{' and '.join(factors)} change how vLLM keys and processes the items, and this encoder "
                           "does not apply them; send the request without them", code="unsupported_parameter")
    parts: list[ImagePart | VideoPart] = []
    for m, message in enumerate(chat.messages):
        if not isinstance(message.content, list):
            continue
        for p, part in enumerate(message.content):
            kind = part.get("type")
            where = f"messages[{m}].content[{p}]"
            try:
                if kind == "image_url":
                    parts.append(ImagePart.model_validate(part))
                elif kind == "video_url":
                    parts.append(VideoPart.model_validate(part))
                elif kind in _OTHER_MEDIA:
                    raise RequestError(f"{where} is a {kind!r} part, which this encoder does not take (it encodes "
                                       "image_url and video_url parts)")
            except ValidationError as e:
                raise RequestError(describe_invalid(e, at=("messages", m, "content", p))) from None
    if len(parts) > rt.settings.max_images_per_request:
        raise RequestError(f"{len(parts)} images and videos in one request; the limit is "
                           f"{rt.settings.max_images_per_request}")
    return chat, await inputs_from_parts(rt, parts, len(body), request.is_disconnected), chat


def completion(rt: Runtime, chat: ChatRequest, answers: list[Answer], request_id: str | None) -> dict:
    """The chat.completion an encoder instance answers: no text, finished by its length (the proxy asked for one
    token), the items' tokens as its prompt tokens."""
    tokens = sum(a.stored.num_tokens for a in answers)
    return {
        "id": f"chatcmpl-{request_id or uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model or served_model(rt),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
    }


def models(rt: Runtime) -> dict:
    return {"object": "list", "data": [{"id": served_model(rt), "object": "model", "created": int(rt.started),
                                        "owned_by": "qwen3vl-encoder", "root": rt.settings.model}]}

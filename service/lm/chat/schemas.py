"""The chat request's shapes: a subset of OpenAI's chat completions (text, `image_url` and `video_url`
content parts, `max_tokens`, greedy decoding only). The image and video parts are the encoder's own
(api/schemas.py): they go to its /encode as they came."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictBool

from service.api.schemas import ImagePart, VideoPart


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]]


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = None
    # NOTE: strict, as vLLM's `bool | None`: pydantic's lax bool took "yes" and 1 for true, and refused null.
    return_token_ids: StrictBool | None = Field(None, description="true: also answer the token ids, generated "
                                                "(choices[].token_ids) and the prompt's (prompt_token_ids), as vLLM "
                                                "does; false or null: not")

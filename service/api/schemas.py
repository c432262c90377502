"""The HTTP API's request and response shapes (OpenAI content-part shape), shared with the LM side
(lm/chat/schemas.py takes these image and video parts; lm/router.py takes the same shapes)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, Field, ValidationError

from service.priority import PRIORITY_MAX, PRIORITY_MIN


class ImageURL(BaseModel):
    url: str = Field(description="data:image/...;base64,... or an http(s) URL on the allow-list")


class ImagePart(BaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL
    uuid: str | None = Field(None, description="optional store key; default: content hash")


class VideoURL(BaseModel):
    url: str = Field(description="data:video/...;base64,... (mp4, webm, mkv, ...: H.264, HEVC, VP8, VP9, AV1, MPEG-4, "
                     "MJPEG) or an http(s) URL on the allow-list")


class VideoPart(BaseModel):
    type: Literal["video_url"] = "video_url"
    video_url: VideoURL
    uuid: str | None = Field(None, description="optional store key; default: content hash (of the bytes and the "
                             "video settings)")


class Urgent(BaseModel):
    """A request's place among waiting work (service/priority.py): the same fields on /encode, on
    /v1/chat/completions (vLLM's proxy forwards the user's own `priority`) and as multipart form fields."""

    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True, description="lower runs first (vLLM's "
                          "convention); first come, first served within a level, aged by --priority-aging-s")
    deadline_ms: int | None = Field(None, ge=0, strict=True, description="the request's budget from its arrival: "
                                    "work not decoded, or whose step has not started, by then is dropped and the "
                                    "request answered 504 deadline_exceeded (a cached image is still answered); "
                                    "default --default-deadline-ms")


class EncodeRequest(Urgent):
    images: list[Annotated[ImagePart | VideoPart, Field(discriminator="type")]] = Field(
        min_length=1, description="image_url and video_url parts (the OpenAI / vLLM content-part shapes), answered "
        "in order")


# A request that works as it is (the /docs page prefills it): one 32x32 gradient PNG as a data URL, which
# the service upscales to Qwen3-VL's smallest size.
EXAMPLE_PNG = ("iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAAAOElEQVR42u3NwQkAQAgDwRMC0f7L9WMVgXvsNDAl6SXJdjaYmWzQ3QQEB"
               "AQEBAQEBAQ/BLW70eAAP6MGSFF7+P4AAAAASUVORK5CYII=")
EXAMPLE_REQUEST = {"images": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + EXAMPLE_PNG}}]}


class EncodedItem(BaseModel):
    key: str
    num_tokens: int
    grid_thw: list[int]
    shape: list[int]
    dtype: str
    cached: bool
    path: str | None = Field(None, description="a directory store: the entry's file, relative to the store root "
                             "(<key>/encoder_cache.safetensors)")
    store_key: str | None = Field(None, description="Mooncake Store: the entry's whole key "
                                  "(<namespace>@id:<key>), what a reader of the pool gets")
    modality: Literal["image", "video"] = "image"
    frames_indices: list[int] | None = Field(None, description="a video: the source frames sampled (before an odd "
                                             "count's padding with the last)")
    fps: float | None = Field(None, description="a video: the source's average frame rate")
    timestamps: list[float] | None = Field(None, description="a video: seconds of each temporal group (grid_thw's t "
                                           "of them), what Qwen3-VL's prompt writes before each group's tokens")


class EncodeResponse(BaseModel):
    items: list[EncodedItem]


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable, e.g. not_an_image, key_conflict, overloaded")
    message: str = Field(description="what was wrong, for a person")
    index: int | None = Field(None, description="the image's position in the request, for per-image errors")


class ErrorResponse(BaseModel):
    """The shape of every error answer (errors.error_body)."""

    error: ErrorDetail


# What pydantic puts in an error's path for a union's member: `str`, `list[...]`, `tagged-union[...]`, ...
_MEMBER = re.compile(r"^(str|int|float|bool|none|dict|list|tagged-union)(\[.*\])?$")


def body_path(loc: tuple) -> str:
    """An error's place in a request body as a client writes it: `images[0].image_url`, not pydantic's
    `images.0.image_url.image_url` (a tagged union's tag, then the field it names) or `content.str`."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif (i + 1 < len(loc) and loc[i + 1] == part) or _MEMBER.match(part):
            continue  # a union's tag or member, not a field
        else:
            out += f".{part}" if out else part
    return out


def describe_invalid(e: ValidationError, at: tuple = ()) -> str:
    """The one line a 400 says about a body that does not validate: its deepest error (a union's other members
    report a less useful one each: `content` is not a string either), at its body_path; `at`: where in the
    body the validated part is, for a part validated on its own."""
    errors = e.errors()
    worst = max(errors, key=lambda err: len(err["loc"]))
    more = f" ({len(errors)} errors)" if len(errors) > 1 else ""
    return f"invalid request body at '{body_path((*at, *worst['loc']))}': {worst['msg']}{more}"

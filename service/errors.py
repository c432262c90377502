"""The service's errors: a few families, each with its table of codes and their HTTP status, and the one
place their answers are built.

    QveError
     ├─ ServiceError          what a request is answered with: {"error": {"code", "message", "index"?}}
     │   ├─ RequestError      the request itself is malformed or not allowed (400, 401, 404, 405, 408, 413, 422, 431)
     │   ├─ KeyConflict       a client uuid already bound to other bytes (409)
     │   ├─ MediaError        one image or video of the request cannot be used (413, 415, 422), answered by its index
     │   │   ├─ ImageError
     │   │   └─ VideoError
     │   ├─ Overloaded        the queue or an arena is full: 429 + Retry-After
     │   ├─ Unavailable       starting, the store full or unreachable, the engines disagree: 503
     │   ├─ BackendError      an encoding step or a store write failed: 500
     │   ├─ GatewayError      the LM side: a service it needs failed (502, 424)
     │   ├─ DeadlineExceeded  a request's time ran out (its deadline_ms, the LM side's timeout): 504
     │   └─ Relayed           another service's error answer, passed on with its own status
     └─ StartupError          a start-up check failed: one line, exit status 2 (never an HTTP answer)
         ├─ ModelLoadError
         └─ StoreOwnershipError

A code is data: `ImageError("the image is empty ...", code="empty_image")`. Each family's CODES say what
each code means and its status; `CODES` joins them (the OpenAPI document's error responses and
docs/api.md are written from it). Bad input and overload carry a machine-readable code and a message that
says how to fix the request; anything else that escapes a handler is a bug and becomes a 500. Invariants
are asserts; user input never reaches an assert.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Code:
    status: int
    means: str  # what the code says, for the OpenAPI document and the docs
    closes: bool = False  # the answer closes its connection (`connection: close`)
    retry_after_s: int | None = None  # the Retry-After of a transient refusal, unless the raiser says


class QveError(Exception):
    """The root of every error this service raises on purpose."""


class ServiceError(QveError):
    """An answer to a request. `code` is stable (clients switch on it) and one of the family's CODES (the
    first is the default); the message is for humans. `retry_after_s`: a transient refusal says when to
    retry (Retry-After). `index`: the image's position in the request, for per-image errors (at_index)."""

    CODES: ClassVar[dict[str, Code]] = {}
    index: int | None = None

    def __init__(self, message: str, *, code: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        codes = type(self).CODES
        self.code = code if code is not None else next(iter(codes))
        assert self.code in codes, f"{type(self).__name__} has no code {self.code!r}: this is a bug"
        self.message = message
        self.retry_after_s = retry_after_s if retry_after_s is not None else codes[self.code].retry_after_s

    @property
    def status(self) -> int:
        return type(self).CODES[self.code].status

    @property
    def closes_connection(self) -> bool:
        return type(self).CODES[self.code].closes

    def __reduce__(self):
        # Decode workers are processes: an error crosses back pickled, with its code (Exception's own pickling
        # would make it again from its message alone, with the family's default code).
        return _rebuilt, (type(self), self.message, self.code, self.retry_after_s, self.index)


def _rebuilt(cls: type[ServiceError], message: str, code: str, retry_after_s: int | None,
             index: int | None) -> ServiceError:
    err = cls(message, code=code, retry_after_s=retry_after_s)
    err.index = index
    return err


class RequestError(ServiceError):
    CODES = {
        "bad_request": Code(400, "a malformed request: its body, a field, a header"),
        "unauthorized": Code(401, "--api-key is set and the request has no `Authorization: Bearer <key>` with "
                                  "one of the keys"),
        "forbidden": Code(403, "SGLang's protocol: a caller or a push destination outside --sglang-allowed-hosts"),
        "not_found": Code(404, "no such endpoint"),
        "method_not_allowed": Code(405, "the endpoint does not take this method"),
        # NOTE: a request cut off mid-body leaves the connection in the middle of a message: it cannot carry
        # another (kept open, it waited for the rest of a body that never came).
        "request_timeout": Code(408, "the request head or body came too slowly (--header-timeout-s, "
                                     "--body-timeout-s)", closes=True),
        "request_too_large": Code(413, "the body, or the body and what its URLs fetched together, is over "
                                       "--max-request-bytes (refused before or while it is read)", closes=True),
        "invalid_key": Code(422, "a `uuid` that is not a safe store key (it could name a path outside the store)"),
        "unsupported_parameter": Code(422, "a request parameter this encoder does not apply (vLLM's per-request "
                                           "mm_processor_kwargs, media_io_kwargs)"),
        "header_too_large": Code(431, "the request head is over the HTTP layer's cap", closes=True),
    }


class KeyConflict(ServiceError):
    CODES = {"key_conflict": Code(409, "a client `uuid` already bound to other bytes (in the store, in flight, "
                                       "or in the request)")}


class MediaError(ServiceError):
    """One image or video of the request cannot be used: the request is answered with it, by its index."""


class ImageError(MediaError):
    CODES = {
        "invalid_image": Code(422, "an image that cannot be used"),
        "empty_image": Code(422, "an image of 0 bytes"),
        "not_an_image": Code(422, "bytes that are no image format"),
        "unsupported_format": Code(415, "an image format that is not supported"),
        "corrupt_image": Code(422, "an image whose data does not decode"),
        "truncated_image": Code(422, "an image cut short"),
        "image_too_large": Code(413, "encoded bytes or declared pixels over --max-image-bytes / --max-input-pixels "
                                     "(decompression bombs land here)"),
        "aspect_ratio_too_extreme": Code(422, "an image more than 200 times longer than wide (the model's limit)"),
        # A JPEG of more scans than --max-jpeg-scans (each scan is a pass over the whole image: a few KB of
        # repeated scans took minutes), or a decode that ran past --decode-timeout-s. 422: the same bytes are
        # refused again; re-encoding fixes it.
        "image_too_complex": Code(422, "an image whose decode would cost more than its size explains (too many "
                                       "JPEG scans, or past --decode-timeout-s)"),
        "image_fetch_failed": Code(422, "an http(s) image URL that is not allowed, failed, timed out or was too large"),
    }


class VideoError(MediaError):
    CODES = {
        "invalid_video": Code(422, "a video that cannot be used (a display matrix that is not a quarter turn)"),
        "not_a_video": Code(422, "not a container PyAV opens, or one without a video stream"),
        "unsupported_codec": Code(415, "a video codec that is not supported"),
        "corrupt_video": Code(422, "a video whose frames do not decode"),
        "truncated_video": Code(422, "a file cut short (its container's sizes run past its end), or fewer frames "
                                     "decode than its header promised for the sampled ones"),
        "video_too_large": Code(413, "encoded bytes, a frame's size, or the sampled clip's pixels or resized bytes (a "
                                     "request's, a process's) over a limit"),
        "video_too_long": Code(413, "duration, frame count, or decode time (wall or CPU) over a limit"),
    }


class Overloaded(ServiceError):
    CODES = {"overloaded": Code(429, "the queue (or this process's pixel arena) is full: retry after Retry-After",
                                retry_after_s=1)}


class Unavailable(ServiceError):
    CODES = {
        "unavailable": Code(503, "starting, shutting down, or the engine is not running: retry after Retry-After"),
        # Transient: the entries answered in the last --store-min-residency-s may still be read by consumers,
        # and nothing may be evicted yet.
        "store_full": Code(503, "the store is full of entries still in their minimum residency"),
        "store_unavailable": Code(503, "the store cannot be reached now (Mooncake's master or a peer host)",
                                  retry_after_s=1),
        # A key would depend on which engine hashed it: the service never becomes ready.
        "engine_mismatch": Code(503, "the engines report different models or preprocessing"),
    }


class BackendError(ServiceError):
    CODES = {
        "backend_error": Code(500, "an encoding step or a store write failed; only its requests fail"),
        "internal_error": Code(500, "a bug: the server's log has it"),
    }


class GatewayError(ServiceError):
    """The LM side: a service it needs (the encoder, vLLM) could not be reached or answered nonsense."""

    CODES = {
        "bad_gateway": Code(502, "a service behind this one answered nonsense"),
        "encoder_unavailable": Code(502, "the encoder could not be reached"),
        "encoder_unauthorized": Code(502, "the encoder refused this service's key"),
        "lm_unavailable": Code(502, "vLLM could not be reached"),
        "lm_unauthorized": Code(502, "vLLM refused this router's key"),
        "embeddings_mismatch": Code(502, "a store entry does not fit this language model"),
        "embeddings_missing": Code(424, "the encoder answered a key its store does not hold"),
    }


class DeadlineExceeded(ServiceError):
    """A request's time ran out: the encoder's `deadline_ms` (its work dropped before decode or before its step,
    never done late), or the LM side's --request-timeout-s (its generation stopped, so the LM goes on to the
    next request). No Retry-After: the request itself (its budget, its max_tokens) may be what was too short."""

    CODES = {"deadline_exceeded": Code(504, "a request was not answered within its deadline (the encoder: "
                                            "`deadline_ms` or --default-deadline-ms; the LM side: --request-timeout-s)")}


class Relayed(ServiceError):
    """Another service's error answer, passed on as it came (its status, code and retry hint)."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None):
        QveError.__init__(self, message)
        self.message, self.code, self.retry_after_s, self._status = message, code, retry_after_s, status

    @property
    def status(self) -> int:
        return self._status

    @property
    def closes_connection(self) -> bool:
        return False

    def __reduce__(self):
        return Relayed, (self._status, self.code, self.message, self.retry_after_s)


FAMILIES: tuple[type[ServiceError], ...] = (RequestError, KeyConflict, ImageError, VideoError, Overloaded, Unavailable,
                                           DeadlineExceeded,
                                            BackendError, GatewayError)
# Every code, with the family that raises it (each code is one family's).
CODES: dict[str, tuple[type[ServiceError], Code]] = {c: (f, code) for f in FAMILIES for c, code in f.CODES.items()}
assert len(CODES) == sum(len(f.CODES) for f in FAMILIES), "a code in two families: this is a bug"


# ---- start-up (not HTTP) ---------------------------------------------------------------------------
class StartupError(QveError):
    """A start-up check failed (port in use, store root not the service's own, no CUDA, ...). The CLI
    prints the message as one line and exits with status 2."""


class ModelLoadError(StartupError):
    """The --model argument cannot be turned into a vision tower (or, on the LM side, a language model)."""


class StoreOwnershipError(StartupError):
    """The store root cannot be this service's: another user's, writable by others, or locked by another
    service."""


# ---- answers -----------------------------------------------------------------------------------------
def http_status(err: ServiceError) -> int:
    return err.status


def statuses(families: tuple[type[ServiceError], ...] = FAMILIES) -> dict[int, list[tuple[str, str]]]:
    """Each HTTP status the families answer, with its codes and what they mean, in status order: the
    OpenAPI document's error responses (api/app.py) and docs/api.md's table."""
    out: dict[int, list[tuple[str, str]]] = {}
    for family in families:
        for name, code in family.CODES.items():
            out.setdefault(code.status, []).append((name, code.means))
    return dict(sorted(out.items()))


def at_index(err: ServiceError, index: int) -> ServiceError:
    """Tag a per-image error (MediaError, KeyConflict) with the image's position in the request."""
    err.index = index
    return err


def error_body(code: str, message: str, index: int | None = None) -> dict:
    """The one JSON shape of every error answer (encoder, LM consumer, router): {"error": {"code",
    "message", "index"?}}; `index` is the image's position in the request, for per-image errors."""
    err = {"code": code, "message": message}
    if index is not None:
        err["index"] = index
    return {"error": err}


def clip(text: str, limit: int = 64) -> str:
    """Client input quoted in an error message, cut to `limit` characters: an answer never echoes more
    of what a client sent than it takes to recognise it (a 10 KB path came back whole)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# OpenAI's error types, by status (its error object's `type`; anything else 4xx is an invalid request).
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}


def openai_body(err: ServiceError) -> dict:
    """The error shape of the OpenAI API (vLLM's /v1 routes answer it): {"error": {"message", "type", "param",
    "code"}}, with this service's code and, for a per-item error, its `index` beside them."""
    body = error_body(err.code, err.message, err.index)
    kind = _OPENAI_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    body["error"].update(type=kind, param=None if err.index is None else f"items[{err.index}]")
    return body


def response(err: ServiceError, openai: bool = False) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, JSON body) of the answer to `err`: what every server of this project sends for
    an error, through starlette (`json_response`) or as raw bytes (api/protocol.py's early answers).
    `openai`: the OpenAI API's shape (openai_body), for the /v1 routes."""
    headers = {"content-type": "application/json"}
    if err.retry_after_s is not None:  # overload, a full store, starting: transient, say when to retry
        headers["retry-after"] = str(err.retry_after_s)
    if err.code == "unauthorized":
        headers["www-authenticate"] = "Bearer"
    if err.closes_connection:  # (uvicorn closes a connection after an answer that says so)
        headers["connection"] = "close"
    body = openai_body(err) if openai else error_body(err.code, err.message, err.index)
    return err.status, headers, json.dumps(body).encode()


def from_code(code: str, message: str, retry_after_s: int | None = None) -> ServiceError:
    """The ServiceError of `code`, made again from its parts (an engine's answer, raised in the API process,
    answers the engine's status). An unknown code is a BackendError."""
    if code not in CODES:
        return BackendError(message)
    return CODES[code][0](message, code=code, retry_after_s=retry_after_s)

"""The service's errors: one tree, the one table that maps them to HTTP status, and the one place their
answers are built.

    QveError
     ├─ ServiceError          what a request is answered with (status: HTTP_STATUS; body: response())
     │   ├─ Unauthorized, BadRequest, NotFound, MethodNotAllowed, InvalidKey, KeyConflict,
     │   │  RequestTooLarge, RequestTimeout, HeaderTooLarge
     │   ├─ ImageError: EmptyImage, NotAnImage, UnsupportedFormat, CorruptImage, TruncatedImage,
     │   │  ImageTooLarge, BadAspectRatio, ImageTooComplex, ImageFetchError
     │   ├─ VideoError: NotAVideo, UnsupportedCodec, CorruptVideo, TruncatedVideo, VideoTooLarge, VideoTooLong
     │   ├─ Overloaded (429): ArenaFull;  Unavailable (503): StoreFull, StoreUnavailable, EngineMismatch
     │   ├─ BackendError (500);  BadGateway (502), EmbeddingsMissing (424), DeadlineExceeded (504): the LM side's
     │   └─ Relayed: another service's answer passed on with its own status
     └─ StartupError          a start-up check failed: one line, exit status 2 (never an HTTP answer)
         ├─ ModelLoadError
         └─ StoreOwnershipError

Bad input and overload are ServiceErrors with a machine-readable `code` and a message that says how to
fix the request. Anything else that escapes a handler is a bug and becomes a 500. Invariants are
asserts; user input never reaches an assert.
"""

from __future__ import annotations

import json


class QveError(Exception):
    """The root of every error this service raises on purpose."""


class ServiceError(QveError):
    """An answer to a request. `code` is stable (clients switch on it); the message is for humans.
    `retry_after_s`: a transient refusal says when to retry (Retry-After). `index`: the image's position
    in the request, for per-image errors (set by `at_index`)."""

    code = "internal_error"
    retry_after_s: int | None = None
    index: int | None = None
    closes_connection = False  # the answer closes its connection (`connection: close`)

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class Unauthorized(ServiceError):
    """--api-key is set and the request has no `Authorization: Bearer <key>` with one of the keys."""

    code = "unauthorized"


# ---- the request itself is malformed (400 and the like) -------------------------------------------
class BadRequest(ServiceError):
    code = "bad_request"


class NotFound(ServiceError):
    code = "not_found"


class MethodNotAllowed(ServiceError):
    code = "method_not_allowed"


class InvalidKey(ServiceError):
    """A client `uuid` that is not a safe store key (it could name a path outside the store)."""

    code = "invalid_key"


class KeyConflict(ServiceError):
    """A client `uuid` already bound to other image bytes (in the store, in flight, or in the request)."""

    code = "key_conflict"


class RequestTooLarge(ServiceError):
    """The whole request body is over --max-request-bytes (refused before or while it is read)."""

    code = "request_too_large"
    closes_connection = True  # the body it did not read is still coming


class HeaderTooLarge(ServiceError):
    """The request head (request line and headers) is over the HTTP layer's cap (api/protocol.py)."""

    code = "header_too_large"
    closes_connection = True


class RequestTimeout(ServiceError):
    """The client sent the request head or body too slowly (--header-timeout-s, --body-timeout-s)."""

    code = "request_timeout"
    # NOTE: a request cut off mid-body leaves the connection in the middle of a message: it cannot carry
    # another (kept open, it waited for the rest of a body that never came).
    closes_connection = True


# ---- an image could not be used (422 / 413 / 415) -------------------------------------------------
class ImageError(ServiceError):
    """Base for every per-image problem."""

    code = "invalid_image"


class EmptyImage(ImageError):
    code = "empty_image"


class NotAnImage(ImageError):
    code = "not_an_image"


class UnsupportedFormat(ImageError):
    code = "unsupported_format"


class CorruptImage(ImageError):
    code = "corrupt_image"


class TruncatedImage(ImageError):
    code = "truncated_image"


class ImageTooLarge(ImageError):
    """Encoded bytes or decoded pixel count over the configured limit (decompression bombs land here)."""

    code = "image_too_large"


class BadAspectRatio(ImageError):
    code = "aspect_ratio_too_extreme"


class ImageTooComplex(ImageError):
    """An image whose decode would cost more than its size explains: a JPEG of more scans than
    --max-jpeg-scans (each scan is a pass over the whole image: a few KB of repeated scans took minutes), or
    a decode that ran past --decode-timeout-s. 422: the same bytes are refused again; re-encoding fixes it."""

    code = "image_too_complex"


class ImageFetchError(ImageError):
    """An http(s) image URL that is not allowed, failed, timed out or was too large."""

    code = "image_fetch_failed"


# ---- a video could not be used (422 / 413 / 415) ---------------------------------------------------
class VideoError(ServiceError):
    """Base for every per-video problem."""

    code = "invalid_video"


class NotAVideo(VideoError):
    """Not a container PyAV opens, or one without a video stream."""

    code = "not_a_video"


class UnsupportedCodec(VideoError):
    code = "unsupported_codec"


class CorruptVideo(VideoError):
    code = "corrupt_video"


class TruncatedVideo(VideoError):
    """Fewer frames decode than the container's header promised for the sampled ones."""

    code = "truncated_video"


class VideoTooLarge(VideoError):
    """Encoded bytes, frame size or the sampled clip's pixels over the configured limit."""

    code = "video_too_large"


class VideoTooLong(VideoError):
    """Duration, frame count or decode time over the configured limit."""

    code = "video_too_long"


# ---- the service cannot take the work now (429 / 503) ---------------------------------------------
class Overloaded(ServiceError):
    code = "overloaded"
    retry_after_s = 1


class ArenaFull(Overloaded):
    """No free cell large enough in an API process's pixel arena right now (the engine still holds the
    others): the images being decoded or queued from this process fill it."""


class Unavailable(ServiceError):
    code = "unavailable"


class StoreFull(Unavailable):
    """Every byte of the store is held by entries still in their minimum residency (consumers may be
    about to read them); nothing may be evicted yet. Transient: 503 + Retry-After."""

    code = "store_full"


class StoreUnavailable(Unavailable):
    """The store cannot be reached now (Mooncake Store's master or a peer host): transient, 503 +
    Retry-After; /health and /ready say so until it answers again."""

    code = "store_unavailable"
    retry_after_s = 1


class EngineMismatch(Unavailable):
    """The engines report different models or preprocessing: a key would depend on which engine hashed
    it. The service never becomes ready."""

    code = "engine_mismatch"


# ---- something behind the request failed (5xx, 424) ------------------------------------------------
class BackendError(ServiceError):
    """An encoding step or a store write failed."""

    code = "backend_error"


class BadGateway(ServiceError):
    """The LM side: a service it needs (the encoder, vLLM) could not be reached or answered nonsense.
    `code` names which (encoder_unavailable, lm_unavailable, embeddings_mismatch, ...)."""

    code = "bad_gateway"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class EmbeddingsMissing(ServiceError):
    """The LM side: the encoder answered a key its store does not hold (424: the encoder's answer failed)."""

    code = "embeddings_missing"


class DeadlineExceeded(ServiceError):
    """The LM side: a request was not answered within its deadline (the consumer's --request-timeout-s);
    its generation was stopped, so the LM goes on to the next request. No Retry-After: the request itself
    (its max_tokens, its prompt) may be what took too long, not the queue."""

    code = "deadline_exceeded"


class Relayed(ServiceError):
    """Another service's error answer, passed on as it came (its status, code and retry hint)."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int | None = None):
        super().__init__(message, retry_after_s)
        self.status, self.code = status, code


# ---- start-up (not HTTP) ---------------------------------------------------------------------------
class StartupError(QveError):
    """A start-up check failed (port in use, store root not the service's own, no CUDA, ...). The CLI
    prints the message as one line and exits with status 2."""


class ModelLoadError(StartupError):
    """The --model argument cannot be turned into a vision tower (or, on the LM side, a language model)."""


class StoreOwnershipError(StartupError):
    """The store root cannot be this service's: another user's, writable by others, or locked by another
    service."""


# NOTE: the one place where errors become HTTP status codes. Order matters: first match wins, so
# subclasses come before their bases.
HTTP_STATUS: list[tuple[type[ServiceError], int]] = [
    (ImageTooLarge, 413),
    (VideoTooLarge, 413),
    (VideoTooLong, 413),
    (UnsupportedCodec, 415),
    (VideoError, 422),
    (RequestTooLarge, 413),
    (RequestTimeout, 408),
    (HeaderTooLarge, 431),
    (UnsupportedFormat, 415),
    (ImageError, 422),
    (InvalidKey, 422),
    (KeyConflict, 409),
    (Unauthorized, 401),
    (NotFound, 404),
    (MethodNotAllowed, 405),
    (BadRequest, 400),
    (Overloaded, 429),
    (Unavailable, 503),
    (EmbeddingsMissing, 424),
    (DeadlineExceeded, 504),
    (BadGateway, 502),
    (BackendError, 500),
    (ServiceError, 500),
]


def http_status(err: ServiceError) -> int:
    if isinstance(err, Relayed):
        return err.status
    for cls, status in HTTP_STATUS:
        if isinstance(err, cls):
            return status
    raise AssertionError(f"unmapped error type {type(err).__name__}: this is a bug")


def at_index(err: ServiceError, index: int) -> ServiceError:
    """Tag a per-image error (ImageError, KeyConflict) with the image's position in the request."""
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


def response(err: ServiceError) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, JSON body) of the answer to `err`: what every server of this project sends for
    an error, through starlette (`json_response`) or as raw bytes (api/protocol.py's early answers)."""
    headers = {"content-type": "application/json"}
    if err.retry_after_s is not None:  # overload, a full store, starting: transient, say when to retry
        headers["retry-after"] = str(err.retry_after_s)
    if isinstance(err, Unauthorized):
        headers["www-authenticate"] = "Bearer"
    if err.closes_connection:  # (uvicorn closes a connection after an answer that says so)
        headers["connection"] = "close"
    return http_status(err), headers, json.dumps(error_body(err.code, err.message, err.index)).encode()


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def from_code(code: str, message: str, retry_after_s: int | None = None) -> ServiceError:
    """The ServiceError whose class has `code`, made again from its parts (an engine's answer, raised in
    the API process, answers the engine's status). An unknown code is a BackendError."""
    for cls in [ServiceError, *_subclasses(ServiceError)]:
        if "code" in cls.__dict__ and cls.code == code and cls not in (BadGateway, Relayed):
            err = cls.__new__(cls)
            ServiceError.__init__(err, message)
            err.retry_after_s = retry_after_s
            return err
    return BackendError(message)

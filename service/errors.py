"""The service's errors, and the one table that maps them to HTTP status.

Bad input and overload are `ServiceError`s with a machine-readable `code` and a message that says
how to fix the request. Anything else that escapes is a bug and becomes a 500 in `app.py`.
Invariants are asserts; user input never reaches an assert.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class. `code` is stable (clients switch on it); the message is for humans."""

    code = "internal_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Unauthorized(ServiceError):
    """--api-key is set and the request has no `Authorization: Bearer <key>` with one of the keys."""

    code = "unauthorized"


# ---- the request itself is malformed (400) --------------------------------------------------------
class BadRequest(ServiceError):
    code = "bad_request"


class InvalidKey(ServiceError):
    """A client `uuid` that is not a safe store key (it could name a path outside the store)."""

    code = "invalid_key"


class KeyConflict(ServiceError):
    """A client `uuid` already bound to other image bytes (in the store, in flight, or in the request)."""

    code = "key_conflict"
    index: int | None = None


# ---- an image could not be used (422 / 413 / 415) -------------------------------------------------
class ImageError(ServiceError):
    """Base for every per-image problem. `index` is set by the front end to the image's position."""

    code = "invalid_image"
    index: int | None = None


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


class RequestTooLarge(ServiceError):
    """The whole request body is over --max-request-bytes (refused before or while it is read)."""

    code = "request_too_large"


class RequestTimeout(ServiceError):
    """The client sent the request body too slowly (--body-timeout-s between two parts of it)."""

    code = "request_timeout"


class BadAspectRatio(ImageError):
    code = "aspect_ratio_too_extreme"


class ImageFetchError(ImageError):
    """An http(s) image URL that is not allowed, failed, timed out or was too large."""

    code = "image_fetch_failed"


# ---- the service cannot take the work (429 / 503) -------------------------------------------------
class Overloaded(ServiceError):
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    code = "unavailable"

    def __init__(self, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StoreFull(Unavailable):
    """Every byte of the store is held by entries still in their minimum residency (consumers may be
    about to read them); nothing may be evicted yet. Transient: 503 + Retry-After."""

    code = "store_full"


# ---- a step failed on the backend (500) -----------------------------------------------------------
class BackendError(ServiceError):
    code = "backend_error"


class StartupError(Exception):
    """A start-up check failed (port in use, store root not the service's own, no CUDA, ...). Not an HTTP
    error: the CLI prints the message as one line and exits with status 2."""


class ModelLoadError(StartupError):
    """Start-up failure: the --model argument cannot be turned into a vision tower. Not an HTTP error."""


# NOTE: the one place where errors become HTTP status codes. Order matters: first match wins, so
# subclasses come before their bases.
HTTP_STATUS: list[tuple[type[ServiceError], int]] = [
    (ImageTooLarge, 413),
    (RequestTooLarge, 413),
    (RequestTimeout, 408),
    (UnsupportedFormat, 415),
    (ImageError, 422),
    (InvalidKey, 422),
    (KeyConflict, 409),
    (Unauthorized, 401),
    (BadRequest, 400),
    (Overloaded, 429),
    (Unavailable, 503),
    (BackendError, 500),
    (ServiceError, 500),
]


def at_index(err, index: int):
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


def http_status(err: ServiceError) -> int:
    for cls, status in HTTP_STATUS:
        if isinstance(err, cls):
            return status
    raise AssertionError(f"unmapped error type {type(err).__name__}: this is a bug")


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def from_code(code: str, message: str, retry_after_s: int | None = None) -> ServiceError:
    """The ServiceError whose class has `code`, made again from its parts (an engine's answer, raised in
    the API process, answers the engine's status). An unknown code is a BackendError."""
    for cls in _subclasses(ServiceError):
        if "code" in cls.__dict__ and cls.code == code:
            err = cls.__new__(cls)
            ServiceError.__init__(err, message)
            if retry_after_s is not None or hasattr(cls, "retry_after_s"):
                err.retry_after_s = retry_after_s
            return err
    return BackendError(message)

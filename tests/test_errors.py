"""The error tree (service/errors.py): every request error has one status from the one table, a code of
its own that survives the trip between processes, and its answer is built in one place."""

import json
import re
from pathlib import Path

import pytest

from service import errors

ROOT = Path(__file__).resolve().parents[1]


def _service_errors() -> list[type[errors.ServiceError]]:
    return [errors.ServiceError, *errors._subclasses(errors.ServiceError)]


def test_every_request_error_has_a_status_and_a_code_of_its_own():
    seen: dict[str, type] = {}
    for cls in _service_errors():
        if cls is errors.Relayed:
            continue  # its status and code are the other service's
        err = cls("x") if cls is not errors.BadGateway else cls("x", code="encoder_unavailable")
        status = errors.http_status(err)
        assert 400 <= status < 600, (cls, status)
        if "code" in cls.__dict__:
            assert cls.code not in seen, f"{cls.__name__} and {seen[cls.code].__name__} share the code {cls.code!r}"
            seen[cls.code] = cls
    expected = {errors.ImageTooLarge: 413, errors.RequestTooLarge: 413, errors.RequestTimeout: 408,
                errors.UnsupportedFormat: 415, errors.NotAnImage: 422, errors.InvalidKey: 422, errors.KeyConflict: 409,
                errors.Unauthorized: 401, errors.NotFound: 404, errors.MethodNotAllowed: 405, errors.BadRequest: 400,
                errors.Overloaded: 429, errors.ArenaFull: 429, errors.Unavailable: 503, errors.StoreFull: 503,
                errors.EngineMismatch: 503, errors.EmbeddingsMissing: 424, errors.BackendError: 500,
                errors.DeadlineExceeded: 504}
    for cls, status in expected.items():
        assert errors.http_status(cls("x")) == status, cls
    assert errors.http_status(errors.BadGateway("x", code="lm_unavailable")) == 502
    assert errors.http_status(errors.Relayed(418, "teapot", "x")) == 418


def test_start_up_errors_are_in_the_tree_but_never_an_http_answer():
    for cls in (errors.StartupError, errors.ModelLoadError, errors.StoreOwnershipError):
        assert issubclass(cls, errors.QveError) and not issubclass(cls, errors.ServiceError)
    with pytest.raises(AssertionError, match="unmapped error type ModelLoadError"):
        errors.http_status(errors.ModelLoadError("x"))  # not a request error: no status at all


def test_every_code_comes_back_as_its_class_with_its_retry_hint():
    for cls in _service_errors():
        if "code" not in cls.__dict__ or cls in (errors.BadGateway, errors.Relayed):
            continue
        back = errors.from_code(cls.code, "msg", 7)
        assert type(back) is cls and back.message == "msg" and back.retry_after_s == 7
    assert type(errors.from_code("no_such_code", "m")) is errors.BackendError


def test_the_answer_carries_status_headers_and_the_one_body_shape():
    status, headers, body = errors.response(errors.at_index(errors.TruncatedImage("cut off"), 2))
    assert status == 422 and headers == {"content-type": "application/json"}
    assert json.loads(body) == {"error": {"code": "truncated_image", "message": "cut off", "index": 2}}
    status, headers, body = errors.response(errors.Overloaded("full"))
    assert status == 429 and headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == "overloaded"
    status, headers, _ = errors.response(errors.StoreFull("full", retry_after_s=5))
    assert status == 503 and headers["retry-after"] == "5"
    status, headers, _ = errors.response(errors.Unauthorized("key"))
    assert status == 401 and headers["www-authenticate"] == "Bearer" and "retry-after" not in headers


def test_no_module_builds_an_error_answer_of_its_own():
    """Every error answer goes through errors.response (api/server.py's error_response, api/protocol.py's
    raw answers): no error body written by hand anywhere else."""
    offenders = []
    for path in sorted((ROOT / "service").rglob("*.py")):
        if path.name == "errors.py":
            continue
        text = path.read_text()
        for n, line in enumerate(text.splitlines(), 1):
            code = re.sub(r"`[^`]*`", "", line.split("#")[0])  # (docstrings quote the shape)
            if "error_body(" in code or re.search(r"""\{\s*["']error["']\s*:""", code):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert offenders == []

"""The error tree (service/errors.py): every request error has one status from the one table, a code of
its own that survives the trip between processes, and its answer is built in one place."""

import json
import re
from pathlib import Path

import pytest

from service import errors

ROOT = Path(__file__).resolve().parents[2]


def test_every_code_is_one_familys_with_a_status_and_what_it_means():
    seen: dict[str, type] = {}
    for family in errors.FAMILIES:
        assert family.CODES, family
        for code, c in family.CODES.items():
            assert code not in seen, f"{family.__name__} and {seen[code].__name__} share the code {code!r}"
            seen[code] = family
            assert 400 <= c.status < 600 and c.means, (family, code)
            err = family("x", code=code)
            assert err.code == code and errors.http_status(err) == c.status
        assert family("x").code == next(iter(family.CODES))  # the first code is the family's default
    assert set(seen) == set(errors.CODES)
    expected = {"image_too_large": 413, "request_too_large": 413, "request_timeout": 408, "unsupported_format": 415,
                "unsupported_codec": 415, "not_an_image": 422, "invalid_key": 422, "key_conflict": 409,
                "unauthorized": 401, "not_found": 404, "method_not_allowed": 405, "bad_request": 400,
                "header_too_large": 431, "overloaded": 429, "unavailable": 503, "store_full": 503,
                "engine_mismatch": 503, "embeddings_missing": 424, "backend_error": 500, "deadline_exceeded": 504,
                "lm_unavailable": 502, "video_too_long": 413}
    assert {code: errors.CODES[code][1].status for code in expected} == expected
    assert errors.http_status(errors.Relayed(418, "teapot", "x")) == 418
    with pytest.raises(AssertionError, match="ImageError has no code 'store_full'"):
        errors.ImageError("x", code="store_full")  # a code is its family's: another is a bug


def test_the_status_table_lists_each_status_with_its_codes():
    table = errors.statuses()
    assert list(table) == sorted(table) and ("key_conflict", errors.KeyConflict.CODES["key_conflict"].means) in table[409]
    assert {code for codes in table.values() for code, _ in codes} == set(errors.CODES)
    only_images = errors.statuses((errors.ImageError,))
    assert sorted(only_images) == [413, 415, 422] and [c for c, _ in only_images[415]] == ["unsupported_format"]


def test_start_up_errors_are_in_the_tree_but_never_an_http_answer():
    for cls in (errors.StartupError, errors.ModelLoadError, errors.StoreOwnershipError):
        assert issubclass(cls, errors.QveError) and not issubclass(cls, errors.ServiceError)
        assert not hasattr(cls("x"), "status")  # not a request error: no status at all


def test_every_code_comes_back_as_its_family_with_its_retry_hint_across_processes():
    import pickle

    for code, (family, _) in errors.CODES.items():
        back = errors.from_code(code, "msg", 7)
        assert type(back) is family and (back.code, back.message, back.retry_after_s) == (code, "msg", 7)
        again = pickle.loads(pickle.dumps(errors.at_index(back, 3)))
        assert type(again) is family and (again.code, again.message, again.retry_after_s, again.index) == (code, "msg", 7, 3)
    assert type(errors.from_code("no_such_code", "m")) is errors.BackendError
    relayed = pickle.loads(pickle.dumps(errors.Relayed(418, "teapot", "x", 2)))
    assert (relayed.status, relayed.code, relayed.message, relayed.retry_after_s) == (418, "teapot", "x", 2)
    assert errors.Overloaded("x").retry_after_s == 1 and errors.Unavailable("x", code="store_unavailable").retry_after_s == 1


def test_the_answer_carries_status_headers_and_the_one_body_shape():
    status, headers, body = errors.response(errors.at_index(errors.ImageError("cut off", code="truncated_image"), 2))
    assert status == 422 and headers == {"content-type": "application/json"}
    assert json.loads(body) == {"error": {"code": "truncated_image", "message": "cut off", "index": 2}}
    status, headers, body = errors.response(errors.Overloaded("full"))
    assert status == 429 and headers["retry-after"] == "1" and json.loads(body)["error"]["code"] == "overloaded"
    status, headers, _ = errors.response(errors.Unavailable("full", retry_after_s=5, code="store_full"))
    assert status == 503 and headers["retry-after"] == "5"
    status, headers, _ = errors.response(errors.RequestError("key", code="unauthorized"))
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


def test_docs_api_md_lists_every_code_under_its_status():
    """docs/api.md's error tables (the encoder's, then the LM side's): each code of service/errors.py in a row
    of its own status, and no code the service does not have."""
    rows: dict[str, set[int]] = {}
    for line in (ROOT / "docs" / "api.md").read_text().splitlines():
        if (m := re.fullmatch(r"\| (\d{3}) \| (`[a-z_]+`(?:, `[a-z_]+`)*) \|.*", line)) is not None:
            for code in re.findall(r"`([a-z_]+)`", m.group(2)):
                rows.setdefault(code, set()).add(int(m.group(1)))
    assert {code: {c.status} for code, (_, c) in errors.CODES.items()} == rows

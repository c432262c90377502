"""/docs is served by the service itself (no CDN), and says so clearly where the UI package is missing."""

import json
import re
import sys

import httpx
import pytest

from service.config import Settings
from service.api.docs import openapi_30


def _app(tmp_path):
    from service.procs.local import local_app

    # No lifespan (no model loaded): /docs, its assets and the documents need none.
    return local_app(Settings(model="tiny", device="cpu", store=tmp_path / "store"))


def _get(app, path: str) -> httpx.Response:
    from fastapi.testclient import TestClient

    return TestClient(app).get(path)  # outside `with`: no lifespan


def test_docs_load_everything_from_the_service_itself(tmp_path):
    app = _app(tmp_path)
    page = _get(app, "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']|url:\s*["']([^"']+)["']""", html)
    urls = [a or b for a, b in urls]
    assert len(urls) >= 4, html  # script, stylesheet, favicon, the OpenAPI document
    # Nothing from elsewhere: every URL is the service's own (root-relative), none absolute.
    assert not re.search(r"https?://", html), re.findall(r"https?://\S+", html)
    assert all(u.startswith("/") and not u.startswith("//") for u in urls), urls
    want = {".js": "javascript", ".css": "text/css", ".png": "image/png", ".json": "application/json"}
    for url in urls:
        r = _get(app, url)
        assert r.status_code == 200, url
        kind = next(v for k, v in want.items() if url.endswith(k))
        assert kind in r.headers["content-type"], (url, r.headers["content-type"])
        assert len(r.content) > 100, url
    js = (_get(app, "/docs-assets/swagger-ui-bundle.js")).text
    assert "SwaggerUIBundle" in js
    assert (_get(app, "/docs-assets/nope.js")).json()["error"]["code"] == "not_found"
    redoc = _get(app, "/redoc")  # not offered: no offline ReDoc
    assert redoc.status_code == 404 and redoc.json()["error"]["code"] == "not_found"


def test_the_ui_gets_an_openapi_30_document_it_can_render(tmp_path):
    app = _app(tmp_path)
    doc31 = (_get(app, "/openapi.json")).json()
    doc30 = (_get(app, "/docs/openapi-3.0.json")).json()
    assert doc31["openapi"].startswith("3.1.") and doc30["openapi"] == "3.0.3"
    text = json.dumps(doc30)
    assert '"type": "null"' not in text and '"const"' not in text  # 3.1-only spellings
    assert doc30["paths"].keys() == doc31["paths"].keys() and doc30["components"].keys() == doc31["components"].keys()
    part = doc30["components"]["schemas"]["ImagePart"]["properties"]
    assert part["uuid"]["type"] == "string" and part["uuid"]["nullable"] is True
    assert part["type"]["enum"] == ["image_url"]
    assert "/docs" not in doc31["paths"] and "/docs/openapi-3.0.json" not in doc31["paths"]


def test_openapi_30_keeps_a_union_with_null_as_a_nullable_union():
    schema = {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}], "title": "X"}
    assert openapi_30({"openapi": "3.1.0", "s": schema})["s"] == {
        "anyOf": [{"type": "integer"}, {"type": "string"}], "title": "X", "nullable": True}


def test_without_the_ui_package_docs_says_so_and_the_service_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "swagger_ui_bundle", None)  # as if not installed: the import fails
    app = _app(tmp_path)
    r = _get(app, "/docs")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "swagger-ui-bundle" in r.json()["error"]["message"] and "/openapi.json" in r.json()["error"]["message"]
    assert (_get(app, "/openapi.json")).status_code == 200


def test_the_encode_error_responses_are_the_error_families_codes(tmp_path):
    """/encode's error responses in the OpenAPI document come from service/errors.py's code tables: every
    code the encoder can answer, under its status, and the LM side's codes not at all."""
    from service import errors

    doc = _get(_app(tmp_path), "/openapi.json").json()
    responses = {int(s): r["description"] for s, r in doc["paths"]["/encode"]["post"]["responses"].items() if s != "200"}
    encoder = [f for f in errors.FAMILIES if f is not errors.GatewayError]
    assert set(responses) == {c.status for f in encoder for c in f.CODES.values()}
    for family in encoder:
        for code, c in family.CODES.items():
            assert f"`{code}`: {c.means}" in responses[c.status], code
    assert not any(f"`{code}`" in text for code in errors.GatewayError.CODES for text in responses.values())

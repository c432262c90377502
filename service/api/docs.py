"""/docs: Swagger UI served by the service itself, from the swagger-ui-bundle package (no CDN: it
works offline and behind firewalls). ReDoc is not offered: no package ships it for offline use.

swagger-ui-bundle is optional at run time: where it is not installed (a slim GPU image, say) /docs
answers a JSON error that says so; the OpenAPI document at /openapi.json is there either way.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html

from service.api.server import error_response
from service.errors import RequestError

ASSETS = "/docs-assets"  # the bundle's files (swagger-ui-bundle.js, swagger-ui.css, favicons)
UI_OPENAPI = "/docs/openapi-3.0.json"  # the document as the bundled Swagger UI can read it


def mount_docs(app: FastAPI) -> None:
    """Serve /docs (and its assets) on `app`; create `app` with docs_url=None and redoc_url=None."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        @app.get("/docs", include_in_schema=False)
        async def no_docs():
            return error_response(RequestError("the docs UI needs the swagger-ui-bundle package, which is not installed "
                                           "here (pip install swagger-ui-bundle); the OpenAPI document is at "
                                           "/openapi.json", code="not_found"))
        return

    from fastapi.staticfiles import StaticFiles

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url=UI_OPENAPI, title=f"{app.title} - docs",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")

    @app.get(UI_OPENAPI, include_in_schema=False)
    async def ui_openapi():
        return openapi_30(app.openapi())


def openapi_30(doc: dict) -> dict:
    """`doc` (OpenAPI 3.1, what FastAPI writes) as OpenAPI 3.0.3.

    Why: swagger-ui-bundle 1.1 ships Swagger UI 4.15, which refuses to render any document whose
    version is not 3.0.x ("Unable to render this definition"). The JSON Schema constructs of 3.1 that
    FastAPI and pydantic use here have 3.0 spellings: `anyOf [X, {"type": "null"}]` is X with
    `nullable: true`, and `const: v` is `enum: [v]`. /openapi.json stays 3.1."""
    def convert(node):
        if isinstance(node, list):
            return [convert(v) for v in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        any_of = node.get("anyOf")
        if isinstance(any_of, list) and {"type": "null"} in any_of:
            rest = [s for s in any_of if s != {"type": "null"}]
            del node["anyOf"]
            node.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
            node["nullable"] = True
        if "const" in node:
            node["enum"] = [node.pop("const")]
        return {k: convert(v) for k, v in node.items()}

    return {**convert(doc), "openapi": "3.0.3"}

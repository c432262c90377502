"""What every server of the project shares (service/api/server.py): an error nobody raised on purpose is
answered in the one JSON error shape (500 `internal_error`), by the encoder, the LM consumer and the router
alike, each a real uvicorn on a loopback port; the encoder counts it in /metrics with the status it got."""

from __future__ import annotations

import types
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.engine.loader import load_model
from tests.support import imagedata as data
from tests.support.live import app_server, json_body, live_server, metric


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _internal_error(r: httpx.Response) -> dict:
    assert r.status_code == 500, r.text
    assert r.headers["content-type"] == "application/json", r.headers
    err = r.json()["error"]
    assert err["code"] == "internal_error" and "log" in err["message"], err
    return err


def test_an_unexpected_error_in_the_encoder_is_a_json_500_counted_as_500(tmp_path, tiny_model, monkeypatch):
    """A video on an install without PyAV answered a plain-text 500 (`ModuleNotFoundError: av` raised while
    its header was read); and an answer that failed while it was built was counted as a 200."""
    import service.api.app as app_module
    from service.media import video as media_video

    def no_pyav(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'av'")

    settings = Settings(model="tiny", device="cpu", store=tmp_path / "store", decode_workers=1, max_wait_ms=20)
    with live_server(settings, tiny_model) as (url, app):
        monkeypatch.setattr(media_video, "read_header", no_pyav)
        r = httpx.post(url + "/encode", files=[("video", ("clip.mp4", b"\0\0\0\x18ftypmp42" + bytes(64), "video/mp4"))],
                       timeout=30)
        err = _internal_error(r)
        assert "av" not in err["message"]  # what failed is the log's, not the client's
        monkeypatch.undo()

        def broken(answer):
            raise KeyError("grid_thw")

        monkeypatch.setattr(app_module, "_item", broken)
        _internal_error(httpx.post(url + "/encode", json=json_body(data.encode(data.textured_rgb(64, 64, seed=1), "PNG")),
                                   timeout=30))
        m = httpx.get(url + "/metrics").text
        assert metric(m, "qve_requests_total", 'status="500"') == 2
        assert metric(m, "qve_requests_total", 'status="200"') == 0
        monkeypatch.undo()
        assert httpx.get(url + "/health").status_code == 200  # the service goes on


def test_an_unexpected_error_in_the_consumer_is_a_json_500(tmp_path, monkeypatch):
    from service.lm.chat.app import Chat, create_chat_app
    from service.lm.chat.config import ChatConfig

    async def broken(self, req, client_gone):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Chat, "answer", broken)
    cfg = ChatConfig(model=Path("."), encoder_url="http://127.0.0.1:9", store=tmp_path)
    app = create_chat_app(cfg, types.SimpleNamespace(name="stub"))
    with app_server(app, log_level="critical") as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        _internal_error(r)
        assert httpx.get(url + "/health").status_code == 200


def test_an_unexpected_error_in_the_router_is_a_json_500(monkeypatch):
    import service.lm.router as router

    def broken(chat, cfg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(router, "check_request", broken)
    app = router.create_router_app(router.RouterConfig(encoder_url="http://127.0.0.1:9", vllm_url="http://127.0.0.1:9"))
    with app_server(app, log_level="critical") as url:
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        _internal_error(r)

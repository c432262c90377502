"""A single-process service from its bound socket to ready (service/procs/single.py), in this process: /ready
answers 503 with the phase while the model loads, then the real app takes over."""

import threading
import time

import httpx
import pytest
import uvicorn

from service.api.server import Server, server_options
from service.procs.single import Booting, serve_single
from service.config import Settings
from service.errors import ModelLoadError
from service.engine.loader import load_model
from service.procs.preflight import bind
from tests.support import imagedata as data
from tests.support.live import json_body


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _settings(tmp_path) -> Settings:
    return Settings(model="tiny", device="cpu", store=tmp_path / "store", decode_workers=1, max_pixels=256 * 256)


def test_ready_says_the_phase_until_the_model_is_loaded_then_the_app_answers(tmp_path, tiny_model):
    settings = _settings(tmp_path)
    release = threading.Event()

    def slow_load(s):  # the model load, held until the test has looked at the "loading" answers
        assert s is settings
        release.wait(60)
        return tiny_model

    sock = bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server: Server | None = None
    booting = Booting(settings, stop=lambda: setattr(server, "should_exit", True), load=slow_load,
                      settle=False)  # (a freeze would be this test process's: test_server.py checks it)
    server = Server(uvicorn.Config(booting, log_level="warning", **server_options(settings)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        r = httpx.get(url + "/ready", timeout=30)  # answered while the model "loads"
        assert r.status_code == 503
        body = r.json()
        assert body["ready"] is False and body["phase"] == "loading" and body["elapsed_s"] >= 0
        h = httpx.get(url + "/health", timeout=5)
        assert (h.status_code, h.json()) == (200, {"status": "starting", "phase": "loading"})
        e = httpx.post(url + "/encode", json=json_body(data.encode(data.textured_rgb(64, 64, seed=1), "PNG")), timeout=5)
        assert e.status_code == 503 and e.headers["retry-after"] == "2"
        assert e.json()["error"]["code"] == "unavailable" and "loading the model" in e.json()["error"]["message"]
        assert httpx.get(url + "/metrics", timeout=5).status_code == 503

        release.set()
        phases, deadline = [], time.monotonic() + 120
        while (r := httpx.get(url + "/ready", timeout=30)).status_code != 200:
            phases.append(r.json()["phase"])
            assert time.monotonic() < deadline, phases
            time.sleep(0.02)
        assert set(phases) <= {"loading", "warming"}  # CPU: nothing to compile
        info = r.json()
        assert info["ready"] is True and info["model"] == "preset:tiny:seed0"
        assert info["store"] == str((tmp_path / "store").absolute())
        assert (info["min_pixels"], info["max_pixels"]) == (tiny_model.params.min_pixels, tiny_model.params.max_pixels)
        # The real app now answers everything.
        e = httpx.post(url + "/encode", json=json_body(data.encode(data.textured_rgb(64, 64, seed=1), "PNG")),
                       timeout=60)
        assert e.status_code == 200, e.text
        item = e.json()["items"][0]
        t, h, w = item["grid_thw"]
        assert item["shape"] == [t * h * w // 4, 48 * 3]  # tiny: out_hidden 48, main + 2 deepstack levels
        assert httpx.get(url + "/health", timeout=5).json() == {"status": "ok"}
    finally:
        release.set()
        server.should_exit = True
        thread.join(60)
    assert not thread.is_alive()
    assert booting.exit_code == 0 and not booting.stopped_early


def test_a_model_the_loader_refuses_ends_the_server_with_one_line(tmp_path, capsys):
    def refuse(s):
        raise ModelLoadError(f"{s.model}/config.json has model_type 'llama'; this service runs Qwen3-VL vision towers")

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    settings = _settings(tmp_path).model_copy(update={"log_level": "warning"})  # no uvicorn INFO lines
    assert serve_single(settings, sock, load=refuse) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["cannot start: tiny/config.json has model_type 'llama'; this service runs Qwen3-VL "
                                "vision towers"]
    bind("127.0.0.1", port).close()  # the server closed its socket: the port is free again

"""vLLM's encoder-instance protocol (service/api/openai.py) in process, under a real uvicorn on loopback: the
chat request vLLM's EPD proxy sends (max_tokens=1, stream false, its x-request-id header) answered 200 with a
chat.completion once every image is stored under vLLM's own key, the same key /encode gives, the OpenAI
error shape for what is refused, and /v1/models."""

import httpx
import pytest

from service.config import Settings
from service.engine.loader import load_model
from service.media.images import read_header
from service.media.params import ImageLimits
from service.store.format import read_embeddings
from service.store.keys import VllmKeys
from tests.support import imagedata as data
from tests.support import videodata as vd
from tests.support import live
from tests.support.live import data_url, image_part, json_body, live_server, metric

MODEL = "Qwen/Qwen3-VL-2B-Instruct"


@pytest.fixture(scope="module")
def tiny_model():
    return load_model(Settings(model="tiny", device="cpu"))


def _settings(tmp_path, **kw):
    base = dict(model="tiny", device="cpu", store=tmp_path / "store", max_pixels=256 * 256, decode_workers=1,
                max_wait_ms=20, vllm_model_id=MODEL)
    base.update(kw)
    return Settings(**base)


def proxy_request(*parts: dict) -> dict:
    return live.proxy_request(MODEL, *parts)


def _vllm_key(blob: bytes) -> str:
    return VllmKeys(MODEL).image(blob, converted=not read_header(blob, ImageLimits()).plain_rgb)


def test_the_proxys_request_stores_every_image_under_vllms_key_and_answers_a_chat_completion(tmp_path, tiny_model):
    photo, alpha = data.photo("rocket.jpg", 200), data.rgba_png()
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=proxy_request(image_part(photo), image_part(alpha)),
                       headers={"x-request-id": "req-42"}, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["object"] == "chat.completion" and answer["id"] == "chatcmpl-req-42"
        assert answer["model"] == MODEL and isinstance(answer["created"], int)
        (choice,) = answer["choices"]
        assert choice == {"index": 0, "message": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": "length"}
        tokens = []
        for blob in (photo, alpha):
            stored = read_embeddings(tmp_path / "store", _vllm_key(blob))  # vLLM's LM finds it by its own key
            tokens.append(stored.main.shape[0])
        assert answer["usage"] == {"prompt_tokens": sum(tokens), "completion_tokens": 0, "total_tokens": sum(tokens)}
        # /encode keys a uuid-less image the same way: a hit, nothing encoded again.
        r = httpx.post(url + "/encode", json=json_body(photo), timeout=60)
        (item,) = r.json()["items"]
        assert item["key"] == _vllm_key(photo) and item["cached"] is True
        assert metric(httpx.get(url + "/metrics").text, "qve_images_total", 'outcome="encoded"') == 2


def test_a_uuid_is_the_key_and_text_only_requests_store_nothing(tmp_path, tiny_model):
    photo = data.photo("rocket.jpg", 160)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json=proxy_request(image_part(photo, uuid="my-photo")), timeout=60)
        assert r.status_code == 200, r.text
        assert read_embeddings(tmp_path / "store", "my-photo").main.shape[0] == r.json()["usage"]["prompt_tokens"]
        text = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hello"}]}
        r = httpx.post(url + "/v1/chat/completions", json=text, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 0
        assert sorted(p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")) == ["my-photo"]


def test_without_the_flag_keys_stay_content_keys_and_any_model_is_taken(tmp_path, tiny_model):
    photo = data.photo("rocket.jpg", 160)
    with live_server(_settings(tmp_path, vllm_model_id=None), tiny_model) as (url, _):
        request = proxy_request(image_part(photo))
        request["model"] = "whatever"
        r = httpx.post(url + "/v1/chat/completions", json=request, timeout=60)
        assert r.status_code == 200, r.text
        (key,) = [p.name for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")]
        assert key.startswith("sha256+")
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["code"] == code, err  # OpenAI's shape
    assert err["type"] == ("invalid_request_error" if status not in (401, 404, 429) else err["type"])
    return err


def test_bad_input_is_answered_in_the_openai_error_shape_with_the_encode_statuses(tmp_path, tiny_model):
    photo = data.photo("rocket.jpg", 160)
    with live_server(_settings(tmp_path, api_key=["k"]), tiny_model) as (url, _):
        post = lambda body, **kw: httpx.post(url + "/v1/chat/completions", json=body, timeout=60,  # noqa: E731
                                             headers={"authorization": "Bearer k", **kw.pop("headers", {})}, **kw)
        err = _error(httpx.post(url + "/v1/chat/completions", json=proxy_request(image_part(photo)), timeout=60),
                     401, "unauthorized")
        assert err["type"] == "authentication_error"
        err = _error(post(proxy_request(image_part(b"this is not an image"))), 422, "not_an_image")
        assert err["index"] == 0 and err["param"] == "items[0]"
        _error(post({"model": MODEL, "messages": []}), 400, "bad_request")
        _error(post({"model": MODEL, "messages": "hi"}), 400, "bad_request")
        audio = proxy_request({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
        assert "input_audio" in _error(post(audio), 400, "bad_request")["message"]
        broken = proxy_request({"type": "image_url", "image_url": {"detail": "high"}})
        assert "'messages[1].content[1].image_url.url'" in _error(post(broken), 400, "bad_request")["message"]
        other = proxy_request(image_part(photo))
        other["model"] = "another/model"
        assert _error(post(other), 404, "not_found")["type"] == "not_found_error"
        for factors in ({"mm_processor_kwargs": {"max_pixels": 1000}}, {"media_io_kwargs": {"image": {"x": 1}}}):
            _error(post({**proxy_request(image_part(photo)), **factors}), 422, "unsupported_parameter")
        video = proxy_request({"type": "video_url", "video_url": {"url": data_url(vd.clip(frames=4), "video/mp4")}})
        assert "uuid" in _error(post(video), 422, "invalid_video")["message"]
        big = proxy_request(image_part(b"x" * (70 << 20)))
        _error(post(big), 413, "request_too_large")
        # Nothing of the refused requests is stored, and the service goes on.
        assert [p for p in (tmp_path / "store").iterdir() if not p.name.startswith(".")] == []
        assert post(proxy_request(image_part(photo))).status_code == 200


def test_models_lists_the_lms_model(tmp_path, tiny_model):
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.get(url + "/v1/models", timeout=30)
        assert r.status_code == 200
        (model,) = r.json()["data"]
        assert r.json()["object"] == "list" and model["id"] == MODEL and model["object"] == "model"


def test_the_chat_requests_priority_and_deadline_ms_are_vllms_fields_checked_and_applied(tmp_path, tiny_model):
    photo = data.photo("rocket.jpg", 120)
    with live_server(_settings(tmp_path), tiny_model) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", json={**proxy_request(image_part(photo)), "priority": "urgent"},
                       timeout=60)
        assert r.status_code == 400 and "priority" in r.json()["error"]["message"], r.text
        r = httpx.post(url + "/v1/chat/completions", json={**proxy_request(image_part(photo)), "deadline_ms": 0},
                       timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
        r = httpx.post(url + "/v1/chat/completions", json={**proxy_request(image_part(photo)), "priority": -1,
                                                          "deadline_ms": 60_000}, timeout=60)
        assert r.status_code == 200, r.text

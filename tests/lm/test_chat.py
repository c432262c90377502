"""The LM consumer (service/lm/chat.py): real encoder + consumer processes answer chat requests with the
same tokens as transformers' monolithic Qwen3-VL (pixels in, one model); and, in process against a
fake encoder, the miss path (re-request once, then 424) and request errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from service.lm.chat import ChatConfig, LanguageModel, create_chat_app
from service.store.directory import EmbeddingStore
from tests import imagedata as data
from tests.checkpoints import SPECIAL_TOKENS
from tests.live import ServiceProcess
from tests.lm_reference import MAX_TOKENS
from tests.lm_reference import chat_messages as _messages
from tests.lm_reference import monolithic as _monolithic


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_checkpoint):
    """The encoder and the LM consumer as their own processes, sharing one store. Both load their models at
    once: the consumer needs only the encoder's URL to start (it calls the encoder per request)."""
    tmp = tmp_path_factory.mktemp("stack")
    store = tmp / "store"
    encoder = ServiceProcess(["serve", "--model", str(tiny_checkpoint), "--device", "cpu", "--dtype", "float32",
                              "--store", str(store), "--decode-workers", "1"], tmp / "enc.log", wait=False)
    try:
        encoder.wait_ready(bound_only=True)  # bound before its model loads
        consumer = ServiceProcess(["consume", "--model", str(tiny_checkpoint), "--encoder-url", encoder.url,
                                   "--store", str(store)], tmp / "lm.log", wait=False)
        try:
            encoder.wait_ready()
            consumer.wait_ready()
            yield encoder, consumer
        finally:
            assert consumer.stop()
    finally:
        assert encoder.stop()


@pytest.mark.slow  # the stack: a real encoder and a real LM consumer process
@pytest.mark.parametrize("names", [["astronaut.png"], ["chelsea.png", "coffee.png"]], ids=["one image", "two images"])
def test_chat_through_the_store_equals_monolithic_generation(stack, tiny_checkpoint, names):
    encoder, consumer = stack
    blobs = [data.photo(n, max_side=400) for n in names]
    text = "compare the two images" if len(blobs) > 1 else "describe the image"
    prompt_ids, expected = _monolithic(tiny_checkpoint, blobs, text)
    r = httpx.post(consumer.url + "/v1/chat/completions", timeout=120,
                   json={"messages": _messages(blobs, text), "max_tokens": MAX_TOKENS, "temperature": 0,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    print(f"{len(blobs)} image(s): {len(prompt_ids)} prompt tokens, generated {choice['token_ids']}")
    assert choice["token_ids"] == expected and len(expected) >= 2
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected),
                             "total_tokens": len(prompt_ids) + len(expected)}
    assert choice["finish_reason"] == ("stop" if expected[-1] == SPECIAL_TOKENS["<|im_end|>"] else "length")
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert body["object"] == "chat.completion"


@pytest.mark.slow  # the stack, as above
def test_encoder_errors_and_bad_requests_come_back_as_clear_4xx(stack):
    _, consumer = stack
    post = lambda body: httpx.post(consumer.url + "/v1/chat/completions", json=body, timeout=60)  # noqa: E731
    r = post({"messages": _messages([b"not an image"], "describe the image")})
    assert r.status_code == 422 and r.json()["error"]["code"] == "not_an_image"  # the encoder's verdict, passed on
    r = post({"messages": _messages([data.photo("astronaut.png", max_side=200)], "hi"), "temperature": 0.7})
    assert r.status_code == 400 and "greedy" in r.json()["error"]["message"]
    assert post({"messages": []}).status_code == 400
    assert post({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}).status_code == 400
    r = post({"messages": [{"role": "user", "content": "describe"}], "max_tokens": 100_000})
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]
    # text only still works
    r = post({"messages": [{"role": "user", "content": "what is this"}], "max_tokens": 3})
    assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 3


# ---- in process, against a fake encoder --------------------------------------------------------------
@pytest.fixture(scope="module")
def lm(tiny_checkpoint):
    return LanguageModel(ChatConfig(model=tiny_checkpoint, encoder_url="http://encoder.test", store=Path("/nonexistent")))


def _run(app, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lm.test") as c:
            return await c.post("/v1/chat/completions", json=body)

    return asyncio.run(go())


def _fake_encoder(app, answers: list[str], calls: list[dict]):
    """The app's encoder client answers key `answers[i]` on the i-th /encode call (grid 1x8x8: 16 tokens)."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.read())
        key = answers[min(len(calls) - 1, len(answers) - 1)]
        item = {"key": key, "num_tokens": 16, "grid_thw": [1, 8, 8], "shape": [16, 144], "dtype": "float32",
                "cached": False, "path": f"{key}/encoder_cache.safetensors"}
        return httpx.Response(200, json={"items": [item]})

    app.state.chat.http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://encoder.test")


def test_a_key_missing_from_the_store_is_re_requested_once_then_424(tmp_path, lm):
    store = EmbeddingStore(tmp_path / "store", 1 << 30, "m", out_hidden_size=48, deepstack_levels=2)
    store.put("present", torch.randn(16, 144), (1, 8, 8))
    body = {"messages": _messages([b"png"], "describe the image"), "max_tokens": 2}
    cfg = ChatConfig(model=Path("."), encoder_url="http://encoder.test", store=tmp_path / "store")

    app, calls = create_chat_app(cfg, lm), []
    _fake_encoder(app, ["evicted", "present"], calls)  # evicted before the read; the second answer is there
    r = _run(app, body)
    assert r.status_code == 200, r.text
    assert len(calls) == 2

    app, calls = create_chat_app(cfg, lm), []
    _fake_encoder(app, ["evicted", "evicted-again"], calls)
    r = _run(app, body)
    assert r.status_code == 424 and r.json()["error"]["code"] == "embeddings_missing"
    assert "evicted-again" in r.json()["error"]["message"] and len(calls) == 2


def test_an_entry_of_another_model_is_refused_not_truncated(tmp_path, lm):
    store = EmbeddingStore(tmp_path / "store", 1 << 30, "m", out_hidden_size=64, deepstack_levels=2)
    store.put("wide", torch.randn(16, 192), (1, 8, 8))  # out_hidden 64: not this LM's width (48)
    cfg = ChatConfig(model=Path("."), encoder_url="http://encoder.test", store=tmp_path / "store")
    app, calls = create_chat_app(cfg, lm), []
    _fake_encoder(app, ["wide"], calls)
    r = _run(app, {"messages": _messages([b"png"], "describe"), "max_tokens": 2})
    assert r.status_code == 502 and r.json()["error"]["code"] == "embeddings_mismatch"
    assert "(16, 48)" in r.json()["error"]["message"]


def test_models_lists_the_one_model_in_openais_shape_and_unknown_paths_answer_json(tmp_path, lm):
    """OpenAI clients ask /v1/models first (and a 404 must still be the service's error shape)."""
    app = create_chat_app(ChatConfig(model=Path("."), encoder_url="http://encoder.test", store=tmp_path), lm)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://lm.test") as c:
            return await c.get("/v1/models"), await c.get("/v1/nope")

    models, missing = asyncio.run(go())
    assert models.status_code == 200
    body = models.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [lm.name]
    assert body["data"][0]["object"] == "model" and isinstance(body["data"][0]["created"], int)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

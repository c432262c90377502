"""The LM consumer (service/lm/chat.py): real encoder + consumer processes answer chat requests with the
same tokens as transformers' monolithic Qwen3-VL (pixels in, one model); and, in process against a
fake encoder, the miss path (re-request once, then 424) and request errors."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image

from service.lm.chat import ChatConfig, LanguageModel, create_chat_app
from service.media.preprocess import to_rgb
from service.errors import BadRequest
from service.store.directory import EmbeddingStore
from service.store.format import read_embeddings
from tests import imagedata as data
from tests import videodata as vd
from tests.checkpoints import SPECIAL_TOKENS, PilProcessor
from tests.live import ServiceProcess, data_url
from tests.lm_reference import MAX_TOKENS, VideoInputs, monolithic_media, processor_text, video_inputs, visual_ec_cache
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


# ---- video (issue 22), in process: the store entry written here, the encoder a fake that answers the contract
CLIPS = [("libx264", "mp4"), ("libvpx-vp9", "webm"), ("mpeg4", "avi")]


def _write_video_entry(root: Path, key: str, ec_cache: torch.Tensor, v: VideoInputs) -> dict:
    """A video's entry as the encoder writes it (issue 22's metadata: modality, frames_indices, fps,
    timestamps), with safetensors' own writer; the /encode item the encoder answers for it."""
    from safetensors.torch import save_file

    n = ec_cache.shape[0]
    (root / key).mkdir(parents=True)
    save_file({"ec_cache": ec_cache}, str(root / key / "encoder_cache.safetensors"), metadata={
        "format_version": "1", "model": "tiny", "out_hidden_size": "48", "deepstack_levels": "2",
        "grid_thw": json.dumps(list(v.grid_thw)), "num_tokens": str(n), "modality": "video",
        "frames_indices": json.dumps(v.frames_indices), "fps": json.dumps(v.fps), "timestamps": json.dumps(v.timestamps)})
    return {"key": key, "modality": "video", "num_tokens": n, "grid_thw": list(v.grid_thw), "shape": list(ec_cache.shape),
            "dtype": "float32", "cached": False, "path": f"{key}/encoder_cache.safetensors",
            "frames_indices": v.frames_indices, "fps": v.fps, "timestamps": v.timestamps}


def _encoder_answering(app, items: dict[str, dict]) -> list[dict]:
    """The app's encoder answers each part by its URL from `items`; returns the bodies it was sent."""
    calls: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.read())
        calls.append(body)
        urls = [(p.get("image_url") or p.get("video_url"))["url"] for p in body["images"]]
        return httpx.Response(200, json={"items": [items[u] for u in urls]})

    app.state.chat.http = httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://encoder.test")
    return calls


@pytest.mark.parametrize("codec,container,with_image", [(*c, False) for c in CLIPS] + [(*CLIPS[0], True)],
                         ids=[f"one {c[0]} video" for c in CLIPS] + ["an image and a video"])
def test_chat_with_a_video_from_the_store_equals_monolithic_generation(tmp_path, tiny_checkpoint, lm, codec,
                                                                        container, with_image):
    """Greedy tokens through the consumer, from stored video (and image) embeddings, equal transformers'
    monolithic Qwen3-VL fed the same pixel_values_videos (ours, equal to its processor's bit for bit) and
    video_grid_thw, its prompt expanded by Qwen3VLProcessor's own code: so the prompt (timestamps, one
    vision block per temporal group), the rotary positions (get_rope_index's video split) and the deepstack
    rows at the video positions all agree."""
    pytest.importorskip("av", reason="PyAV is the video decoder (the `video` extra)")
    blob = vd.clip(codec, container)
    video = video_inputs(blob)
    images = [data.photo("chelsea.png", max_side=400)] if with_image else []
    text = "describe the image and this" if with_image else "what is in this"
    prompt_ids, expected, prompt_text = monolithic_media(tiny_checkpoint, images, [video], text)

    root = tmp_path / "store"
    store = EmbeddingStore(root, 1 << 30, "tiny", out_hidden_size=48, deepstack_levels=2)
    items = {data_url(blob, "video/mp4"): _write_video_entry(
        root, "vid", visual_ec_cache(tiny_checkpoint, video.pixel_values_videos, video.grid_thw), video)}
    for b in images:
        inputs = PilProcessor.from_pretrained(tiny_checkpoint)(images=[to_rgb(Image.open(io.BytesIO(b)))], return_tensors="pt")
        grid = tuple(inputs["image_grid_thw"][0].tolist())
        stored = store.put("img", visual_ec_cache(tiny_checkpoint, inputs["pixel_values"], grid), grid)
        items[data_url(b)] = {"key": "img", "modality": "image", "num_tokens": stored.num_tokens, "grid_thw": list(grid),
                              "shape": list(stored.shape), "dtype": "float32", "cached": False, "path": stored.path}

    app = create_chat_app(ChatConfig(model=tiny_checkpoint, encoder_url="http://encoder.test", store=root), lm)
    calls = _encoder_answering(app, items)
    parts = [*({"type": "image_url", "image_url": {"url": data_url(b)}} for b in images),
             {"type": "video_url", "video_url": {"url": data_url(blob, "video/mp4")}}]
    r = _run(app, {"messages": [{"role": "system", "content": "you are helpful"},
                                {"role": "user", "content": [*parts, {"type": "text", "text": text}]}],
                   "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert calls == [{"images": parts}]  # one /encode call, the parts as sent, videos among them
    body = r.json()
    print(f"{codec}: grid {video.grid_thw}, {len(prompt_ids)} prompt tokens, generated {body['choices'][0]['token_ids']}")
    assert body["choices"][0]["token_ids"] == expected and len(expected) >= 2
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    # and the text itself (the tiny tokenizer reads every `<t seconds>` as [UNK]: the ids alone cannot tell)
    emb = read_embeddings(root, "vid")
    media = [read_embeddings(root, "img") for _ in images] + [emb]
    content = [*({"type": "image"} for _ in images), {"type": "video"}, {"type": "text", "text": text}]
    assert lm.prompt_text([{"role": "system", "content": "you are helpful"}, {"role": "user", "content": content}],
                          media) == prompt_text


def test_the_video_prompt_is_qwen3vl_processors(tmp_path, tiny_checkpoint, lm):
    """The consumer's video text, against transformers' processor code and written out by hand from
    processing_qwen3_vl.py (replace_video_token; transformers 5.x replaces the bare `<|video_pad|>`, so
    the template's vision markers stay around the whole video)."""
    pytest.importorskip("av", reason="PyAV is the video decoder (the `video` extra)")
    video = video_inputs(vd.clip())  # 24 frames at 8 fps: indices [0, 5, 9, 14, 18, 23], 3 temporal groups
    assert video.frames_indices == [0, 5, 9, 14, 18, 23] and video.grid_thw == (3, 8, 12)
    root = tmp_path / "store"
    _write_video_entry(root, "vid", torch.zeros(3 * 8 * 12 // 4, 144), video)
    emb = read_embeddings(root, "vid")
    assert (emb.modality, emb.frames_indices, emb.fps, emb.timestamps) == ("video", video.frames_indices, 8.0,
                                                                           [0.3125, 1.4375, 2.5625])
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what is in this"}]}]
    group = "<|vision_start|>" + "<|video_pad|>" * 24 + "<|vision_end|>"
    by_hand = ("<|im_start|>user\n<|vision_start|>" + "".join(f"<{t} seconds>" + group for t in ("0.3", "1.4", "2.6"))
               + "<|vision_end|>what is in this<|im_end|>\n<|im_start|>assistant\n")
    template = lm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert lm.prompt_text(msgs, [emb]) == by_hand == processor_text(lm.tokenizer, template, [], [video])
    with pytest.raises(BadRequest, match="placeholders"):  # a video part the template did not place
        lm.prompt_text([{"role": "user", "content": "no media"}], [emb])


def test_a_video_entry_that_does_not_fit_is_a_502_not_a_wrong_prompt(tmp_path, tiny_checkpoint, lm):
    """An encoder that answers a video part as an image (no video support yet), and a video entry whose
    timestamps do not match its temporal groups, are refused before any prompt is built."""
    pytest.importorskip("av", reason="PyAV is the video decoder (the `video` extra)")
    blob = vd.clip()
    video = video_inputs(blob)
    root = tmp_path / "store"
    good = _write_video_entry(root, "vid", torch.zeros(72, 144), video)
    bad = _write_video_entry(root, "short", torch.zeros(72, 144), VideoInputs(
        video.pixel_values_videos, video.grid_thw, video.frames_indices, video.fps, video.timestamps[:2]))
    body = {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": data_url(blob, "video/mp4")}},
                                                      {"type": "text", "text": "what is in this"}]}], "max_tokens": 2}
    for item, says in [({**good, "modality": "image"}, "as an image for a video part"),
                       (bad, "video timestamps [0.3125, 1.4375] for 3 temporal groups")]:
        app = create_chat_app(ChatConfig(model=tiny_checkpoint, encoder_url="http://encoder.test", store=root), lm)
        _encoder_answering(app, {data_url(blob, "video/mp4"): item})
        r = _run(app, body)
        assert r.status_code == 502 and r.json()["error"]["code"] == "embeddings_mismatch", r.text
        assert says in r.json()["error"]["message"]

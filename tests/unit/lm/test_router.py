"""The vLLM router (service/lm/router.py), in process against fake encoder and vLLM servers: the request it
forwards is checked against vLLM's chat content-part schema, and its grid decodes as vLLM decodes it."""

from __future__ import annotations

import asyncio
import copy
import base64
import io
import json
from typing import Literal

import httpx
import pytest
import torch
from pydantic import BaseModel, ConfigDict

from service.lm.router import RouterConfig, create_router_app, vllm_request
from tests.support.live import ServiceProcess, data_url


# ---- vLLM's content parts, as vllm/entrypoints/chat_utils.py declares them (TypedDicts there) ---------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a key vLLM does not declare is a mistake


class _ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VllmImageURLPart(_Strict):
    """OpenAI's image part plus vLLM's optional media `uuid` (used verbatim as the mm_hash)."""

    type: Literal["image_url"]
    image_url: _ImageURL
    uuid: str | None = None


class VllmImageEmbedsPart(_Strict):
    """ChatCompletionContentPartImageEmbedsParam: `image_embeds` is one base64 string or a dict whose
    values are base64 strings (serialized tensors), or None; `uuid` identifies the media."""

    type: Literal["image_embeds"]
    image_embeds: str | dict[str, str] | None = None
    uuid: str | None = None


class VllmTextPart(_Strict):
    type: Literal["text"]
    text: str


class _VideoURL(_Strict):
    url: str


class VllmVideoURLPart(_Strict):
    """CustomChatCompletionContentSimpleVideoParam's typed form: `video_url: {url}` plus the media `uuid`."""

    type: Literal["video_url"]
    video_url: _VideoURL
    uuid: str | None = None


PART = {"image_url": VllmImageURLPart, "image_embeds": VllmImageEmbedsPart, "text": VllmTextPart,
        "video_url": VllmVideoURLPart}


def _check_vllm_schema(request: dict) -> list[BaseModel]:
    parts = []
    for m in request["messages"]:
        if isinstance(m["content"], list):
            parts += [PART[p["type"]].model_validate(p) for p in m["content"]]
    return parts


def _vllm_tensor(b64: str) -> torch.Tensor:
    """How vLLM reads a base64 embeds value: torch.load of the bytes, weights only."""
    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)


CHAT = {"model": "Qwen3-VL-4B", "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [
                         {"type": "image_url", "image_url": {"url": data_url(b"png-a")}},
                         {"type": "text", "text": "compare"},
                         {"type": "image_url", "image_url": {"url": data_url(b"png-b")}, "uuid": "client-id"}]}]}
ITEMS = [{"key": "k" * 64, "num_tokens": 196, "grid_thw": [1, 28, 28]},
         {"key": "client-id", "num_tokens": 64, "grid_thw": [1, 16, 16]}]


def test_raw_image_parts_keep_the_image_and_gain_the_key_as_uuid():
    req = vllm_request(CHAT, ITEMS, "raw")
    parts = _check_vllm_schema(req)
    images = [p for p in parts if isinstance(p, VllmImageURLPart)]
    assert [p.uuid for p in images] == ["k" * 64, "client-id"]
    assert [p.image_url.url for p in images] == [data_url(b"png-a"), data_url(b"png-b")]
    assert req["messages"][0] == CHAT["messages"][0] and req["max_tokens"] == 32 and req["model"] == "Qwen3-VL-4B"
    assert "uuid" not in CHAT["messages"][1]["content"][0]  # the caller's request is not modified


def test_embeds_parts_carry_only_the_grid_and_the_key():
    req = vllm_request(CHAT, ITEMS, "embeds")
    parts = _check_vllm_schema(req)
    embeds = [p for p in parts if isinstance(p, VllmImageEmbedsPart)]
    assert [p.uuid for p in embeds] == ["k" * 64, "client-id"]
    assert all(set(p.image_embeds) == {"image_grid_thw"} for p in embeds)  # metadata only: no pixels, no tensor
    grids = [_vllm_tensor(p.image_embeds["image_grid_thw"]) for p in embeds]
    assert [g.tolist() for g in grids] == [[1, 28, 28], [1, 16, 16]] and grids[0].dtype == torch.int64
    assert [p.text for p in parts if isinstance(p, VllmTextPart)] == ["compare"]  # order and text kept
    assert [p["type"] for p in req["messages"][1]["content"]] == ["image_embeds", "text", "image_embeds"]


def _route(mode: str, body, encoder_status: int = 200, items: list[dict] | None = None, headers: dict | None = None,
           encoder_error: str = "not_an_image", vllm_status: int = 200, **limits):
    """`body` (an object as JSON, bytes as they are) through a router whose encoder answers `items`
    (default: ITEMS, one per part) or an error, and whose vLLM answers `vllm_status`; `seen`: what each was
    sent, and the Authorization each call carried."""
    seen = {"encode": [], "vllm": [], "auth": []}

    def backend(request: httpx.Request) -> httpx.Response:
        seen["auth"].append((request.url.host, request.headers.get("authorization")))
        if request.url.host == "vllm.test":
            seen["vllm"].append(json.loads(request.read()))
            if vllm_status != 200:
                return httpx.Response(vllm_status, json={"error": {"message": "vLLM says no"}})
            return httpx.Response(200, json={"object": "chat.completion", "choices": [{"message": {"content": "ok"}}]})
        seen["encode"].append(json.loads(request.read()))
        if encoder_status != 200:
            return httpx.Response(encoder_status, json={"error": {"code": encoder_error, "message": "images[0]: no"}})
        return httpx.Response(200, json={"items": ITEMS[: len(seen["encode"][-1]["images"])] if items is None else items})

    app = create_router_app(RouterConfig("http://encoder.test", "http://vllm.test", mode, **limits),
                            transport=httpx.MockTransport(backend))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test",
                                     headers=headers) as c:
            return await c.post("/v1/chat/completions", **({"json": body} if isinstance(body, (dict, list)) else
                                                          {"content": body}))

    return asyncio.run(go()), seen


@pytest.mark.parametrize("mode", ["raw", "embeds"])
def test_router_encodes_then_forwards_and_returns_vllms_answer(mode):
    r, seen = _route(mode, CHAT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    (encoded,) = seen["encode"]  # one /encode for all images, in order, client uuids kept
    assert [p["image_url"]["url"] for p in encoded["images"]] == [data_url(b"png-a"), data_url(b"png-b")]
    assert [p.get("uuid") for p in encoded["images"]] == [None, "client-id"]
    (forwarded,) = seen["vllm"]
    assert forwarded == vllm_request(CHAT, ITEMS, mode)
    _check_vllm_schema(forwarded)


def test_router_passes_encoder_errors_and_text_only_requests_through():
    r, seen = _route("raw", CHAT, encoder_status=422)
    assert r.status_code == 422 and r.json()["error"]["code"] == "not_an_image" and seen["vllm"] == []
    text_only = {"messages": [{"role": "user", "content": "hello"}]}
    r, seen = _route("raw", text_only)  # (with the router's max_tokens bound: the request gave none)
    assert r.status_code == 200 and seen["encode"] == [] and seen["vllm"] == [{**text_only, "max_tokens": 4096}]
    r, _ = _route("raw", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request"


def test_with_several_encoder_hosts_each_image_goes_to_the_host_its_hash_picks():
    """Identical images (the same uuid, or the same bytes) go to one host, wherever they are in a request
    or in which request, so that host encodes them once; the items come back in the request's order,
    and a host's per-image error names the image's position in the whole request."""
    from service.lm.router import encoder_for

    hosts = [f"http://enc{i}.test" for i in range(3)]
    parts = [{"type": "image_url", "image_url": {"url": data_url(b"img-%d" % i)}} for i in range(12)]
    parts += [{"type": "image_url", "image_url": {"url": data_url(b"same bytes")}, "uuid": f"u-{i}"} for i in range(4)]
    picks = [encoder_for(p, 3) for p in parts]
    assert len(set(picks)) == 3  # spread over the hosts
    assert picks == [encoder_for(p, 3) for p in parts]  # the same answer every time (no salted hash)
    assert encoder_for({"image_url": {"url": "x"}, "uuid": "k"}, 3) == encoder_for({"image_url": {"url": "y"}, "uuid": "k"}, 3)
    seen: dict[str, list] = {h: [] for h in hosts}

    def host(name: str, fail_second: bool = False):
        def handler(request: httpx.Request) -> httpx.Response:
            images = json.loads(request.read())["images"]
            seen[name].append(images)
            if fail_second and len(images) > 1:
                return httpx.Response(422, json={"error": {"code": "not_an_image", "index": 1,
                                                           "message": "images[1]: not an image"}})
            return httpx.Response(200, json={"items": [{"key": p["image_url"]["url"][-12:], "num_tokens": 4,
                                                        "grid_thw": [1, 4, 4]} for p in images]})
        return handler

    def run(fail_host: int | None = None):
        app = create_router_app(RouterConfig(",".join(hosts), "http://vllm.test"))
        app.state.encoders = [httpx.AsyncClient(transport=httpx.MockTransport(host(h, i == fail_host)), base_url=h)
                              for i, h in enumerate(hosts)]
        app.state.vllm = httpx.AsyncClient(transport=httpx.MockTransport(
            lambda req: httpx.Response(200, json=json.loads(req.read()))), base_url="http://vllm.test")
        chat = {"messages": [{"role": "user", "content": copy.deepcopy(parts)}]}

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r.test") as c:
                return await c.post("/v1/chat/completions", json=chat)
        return asyncio.run(go())

    r = run()
    assert r.status_code == 200
    for i, h in enumerate(hosts):  # each host got exactly the images its hash picks, in their order
        (sent,) = seen[h]
        assert sent == [parts[j] for j in range(len(parts)) if picks[j] == i]
    forwarded = r.json()["messages"][0]["content"]
    assert [p["uuid"] for p in forwarded] == [p["image_url"]["url"][-12:] for p in parts]  # request order kept
    failing = picks[0]  # a host with several images whose second is refused
    r = run(fail_host=failing)
    mine = [j for j in range(len(parts)) if picks[j] == failing]
    assert r.status_code == 422 and r.json()["error"]["index"] == mine[1]
    assert r.json()["error"]["message"] == f"images[{mine[1]}]: not an image"


def test_route_started_on_port_0_logs_the_port_it_was_given_and_answers_there(tmp_path):
    # `route --port 0`: the kernel picks the port when the router binds it, and the router's log names it
    # (what tests/support/live.py reads to reach it), so nothing can take the port between a pick and the bind.
    router = ServiceProcess(["route", "--encoder-url", "http://127.0.0.1:9", "--vllm-url", "http://127.0.0.1:9"],
                            tmp_path / "route.log", ready_path="/health")
    try:
        assert router.port > 0 and router.url == f"http://127.0.0.1:{router.port}"
        assert httpx.get(router.url + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        assert router.stop()


# ---- video (issue 22) -----------------------------------------------------------------------------------
VIDEO_CHAT = {"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(b"png-a")}},
    {"type": "video_url", "video_url": {"url": data_url(b"mp4-v", "video/mp4")}},
    {"type": "text", "text": "what happens"}]}]}
VIDEO_ITEMS = [{"key": "k" * 64, "modality": "image", "num_tokens": 196, "grid_thw": [1, 28, 28]},
               {"key": "v" * 64, "modality": "video", "num_tokens": 72, "grid_thw": [3, 8, 12],
                "frames_indices": [0, 5, 9, 14, 18, 23], "fps": 8.0, "timestamps": [0.3125, 1.4375, 2.5625]}]


@pytest.mark.parametrize("mode", ["raw", "embeds"])
def test_a_video_is_encoded_then_forwarded_as_sent_with_the_key_as_uuid(mode):
    r, seen = _route(mode, VIDEO_CHAT, items=VIDEO_ITEMS)
    assert r.status_code == 200, r.text
    (encoded,) = seen["encode"]  # images and videos in one /encode call, in request order
    assert encoded == {"images": [p for p in VIDEO_CHAT["messages"][0]["content"] if p["type"] != "text"]}
    (forwarded,) = seen["vllm"]
    parts = _check_vllm_schema(forwarded)
    (video,) = [p for p in parts if isinstance(p, VllmVideoURLPart)]
    # vLLM uses the uuid verbatim as the video's mm_hash (no per-request kwargs): the encoder's key
    assert video.uuid == "v" * 64 and video.video_url.url == data_url(b"mp4-v", "video/mp4")
    assert type(parts[0]) is (VllmImageURLPart if mode == "raw" else VllmImageEmbedsPart) and parts[0].uuid == "k" * 64


@pytest.mark.parametrize("part,why", [
    ({"video_url": {"url": "http://elsewhere.test/v.mp4"}}, "no type"),  # vLLM infers video_url from the key
    ({"type": "input_image", "image_url": "http://elsewhere.test/a.png"}, "'input_image'"),
    ({"type": "audio_url", "audio_url": {"url": "http://elsewhere.test/a.wav"}}, "'audio_url'"),
    ({"type": "video_embeds", "video_embeds": None, "uuid": "v"}, "'video_embeds'"),
])
def test_media_the_router_cannot_route_is_refused_not_passed_to_vllm(part, why):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    r, seen = _route("raw", body, items=[])
    assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
    assert "messages[0].content[1]" in r.json()["error"]["message"]
    assert seen["encode"] == seen["vllm"] == []


@pytest.mark.parametrize("field,value", [("mm_processor_kwargs", {"fps": 4}),
                                         ("media_io_kwargs", {"video": {"num_frames": 8}})])
def test_per_request_processor_options_beside_media_are_refused(field, value):
    """vLLM hashes them into every item's mm_hash: the uuid would no longer name the encoder's entry."""
    r, seen = _route("raw", {**VIDEO_CHAT, field: value}, items=VIDEO_ITEMS)
    assert r.status_code == 400 and field in r.json()["error"]["message"] and seen["encode"] == seen["vllm"] == []
    text_only = {"messages": [{"role": "user", "content": "hello"}], field: value, "max_tokens": 8}  # no media
    r, seen = _route("raw", text_only, items=[])  # (nothing to miss)
    assert r.status_code == 200 and seen["vllm"] == [text_only]


def test_an_encoder_that_answers_a_video_as_an_image_is_a_502():
    r, seen = _route("raw", VIDEO_CHAT, items=[VIDEO_ITEMS[0], {**VIDEO_ITEMS[1], "modality": "image"}])
    assert r.status_code == 502 and r.json()["error"]["code"] == "embeddings_mismatch" and seen["vllm"] == []


# ---- what is forwarded, bounds, body limit and keys (issue 23) ------------------------------------------
TEXT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


@pytest.mark.parametrize("field,value,says", [
    ("n", 1000, "'n' must be 1"),
    ("max_tokens", 1_000_000_000, "'max_tokens' must be an integer from 1 to 4096"),
    ("max_tokens", 1e9, "'max_tokens' must be an integer"),
    ("max_completion_tokens", 4097, "--max-tokens-limit"),
    ("min_tokens", 5000, "'min_tokens' must be"),
    ("top_logprobs", 1000, "'top_logprobs' must be an integer from 0 to 20"),
    ("stop", ["x"] * 100, "'stop' must be a string or a list of at most 16"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "'tools' is not a field this router forwards"),
    ("best_of", 5, "'best_of' is not a field"),
    ("chat_template", "{{ messages }}", "'chat_template' is not a field"),
    ("response_format", {"type": "json_object"}, "'response_format' is not a field"),
    ("x" * 500, 1, "... (500 characters)"),  # quoted, not echoed whole
])
def test_fields_the_router_does_not_know_or_over_their_bounds_are_refused(field, value, says):
    r, seen = _route("raw", {**TEXT, field: value})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    assert says in r.json()["error"]["message"]
    assert seen["encode"] == seen["vllm"] == []


def test_the_fields_it_knows_are_forwarded_as_sent_and_max_tokens_is_always_bounded():
    chat = {**CHAT, "n": 1, "max_completion_tokens": 4096, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 7,
            "stop": ["\n\n", "END"], "stream": False, "stream_options": {"include_usage": True}, "logprobs": True,
            "top_logprobs": 5, "user": "u-1", "presence_penalty": 0.5, "return_token_ids": True}
    del chat["max_tokens"]
    r, seen = _route("raw", chat)
    assert r.status_code == 200, r.text
    assert seen["vllm"] == [vllm_request(chat, ITEMS, "raw")]  # as sent, no max_tokens added beside the other bound
    r, seen = _route("raw", {"messages": TEXT["messages"]}, max_tokens_limit=64)
    assert seen["vllm"][0]["max_tokens"] == 64  # vLLM's own default would be the whole context left


def test_booleans_are_true_false_or_null_as_vllm_takes_them():
    """`return_token_ids: null` (vLLM: a bool or null) was a 400."""
    for value in (None, True, False):
        r, seen = _route("raw", {**TEXT, "return_token_ids": value, "stream": None, "logprobs": value})
        assert r.status_code == 200, (value, r.text)
        assert seen["vllm"][0]["return_token_ids"] is value
    for value in ("yes", 1, 0):
        r, seen = _route("raw", {**TEXT, "return_token_ids": value})
        assert r.status_code == 400 and "'return_token_ids' must be true, false or null" in r.json()["error"]["message"]
        assert seen["vllm"] == []


@pytest.mark.parametrize("messages,says", [
    ("hello", "'messages' must be a non-empty list"),
    ({"role": "user", "content": "hello"}, "'messages' must be a non-empty list"),
    (None, "'messages' must be a non-empty list"),
    (5, "'messages' must be a non-empty list"),
    ([], "'messages' must be a non-empty list"),
    (["hello"], "messages[0] must be an object"),
    ([{"role": "tool", "content": "x"}], "messages[0].role must be one of"),
    ([{"role": "user"}], "messages[0].content must be a string or a list"),
    ([{"role": "user", "content": {"type": "text"}}], "messages[0].content must be a string or a list"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0] has 'tool_calls'"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0] must be an object"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text must be a string"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}],
     "messages[0].content[0] (text) has 'cache'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "http://elsewhere.test/a.png"}]}],
     "messages[0].content[0].image_url must be an object with a string 'url'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x", "fetch": "y"}}]}],
     "image_url must be an object"),
    ([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:x"}, "uuid": 5}]}],
     "messages[0].content[0].uuid must be a string"),
    ([{"role": "user", "content": [{"type": ["text"], "text": "x"}]}], "messages[0].content[0].type must be a string"),
    ([{"role": "user", "content": [{"type": {"a": 1}}]}], "messages[0].content[0].type must be a string"),
    ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "closed": "yes"}]}],
     "messages[0].content[0].closed must be true or false"),
])
def test_messages_that_are_not_a_list_of_message_objects_are_a_json_400_never_a_500(messages, says):
    r, seen = _route("raw", {"messages": messages})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["error"]["code"] == "bad_request" and says in r.json()["error"]["message"], r.text
    assert seen["encode"] == seen["vllm"] == []


@pytest.mark.parametrize("body", [b"[1, 2]", b'"chat"', b"\xff\xfe", b"{not json"])
def test_a_body_that_is_not_a_json_object_is_a_400(body):
    r, seen = _route("raw", body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request" and seen["vllm"] == []


def test_a_media_url_the_encoder_refuses_never_reaches_vllm():
    """Every image and video URL goes through the encoder first, which fetches it through its allow-list: a
    refused fetch is the client's 4xx, and vLLM, which would fetch the URL itself, is never asked."""
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]}
    r, seen = _route("raw", body, encoder_status=422, encoder_error="image_fetch_failed")
    assert r.status_code == 422 and r.json()["error"]["code"] == "image_fetch_failed"
    assert seen["encode"] == [{"images": body["messages"][0]["content"]}] and seen["vllm"] == []


def test_a_body_over_the_limit_is_413_before_it_is_read():
    big = json.dumps({**TEXT, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    r, seen = _route("raw", big, max_request_bytes=4096)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large" and seen["vllm"] == []
    assert "--max-request-bytes" in r.json()["error"]["message"]


def test_keys_guard_the_router_and_go_to_the_encoder_and_vllm():
    keys = {"api_key": ("r-1", "r-2"), "encoder_api_key": "enc", "vllm_api_key": "vl"}
    for headers in (None, {"authorization": "Bearer nope"}, {"authorization": "r-1"}):
        r, seen = _route("raw", CHAT, headers=headers, **keys)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer" and seen["auth"] == []
    r, seen = _route("raw", CHAT, headers={"authorization": "Bearer r-2"}, **keys)
    assert r.status_code == 200, r.text
    assert seen["auth"] == [("encoder.test", "Bearer enc"), ("vllm.test", "Bearer vl")]
    app = create_router_app(RouterConfig("http://encoder.test", "http://vllm.test", api_key=("r-1",)))

    async def health():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router.test") as c:
            return await c.get("/health")

    assert asyncio.run(health()).status_code == 200  # open: a load balancer's probe
    # a refused key of the router's own (encoder or vLLM) is a 502 that names the flag, not a 401 for the client
    r, _ = _route("raw", CHAT, encoder_status=401, encoder_error="unauthorized")
    assert r.status_code == 502 and r.json()["error"]["code"] == "encoder_unauthorized"
    assert "--encoder-api-key" in r.json()["error"]["message"]
    r, _ = _route("raw", TEXT, vllm_status=401)
    assert r.status_code == 502 and r.json()["error"]["code"] == "lm_unauthorized"
    assert "--vllm-api-key" in r.json()["error"]["message"]

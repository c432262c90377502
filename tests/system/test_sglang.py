"""SGLang's encoder protocol served by the real service (`serve --sglang-version`), with SGLang's own language-side
code as the client where it matters: its MMReceiverHTTP sends the parts and its receivers and Qwen-VL processor
take what comes back (tests/support/sglang_side.py, on SGLang installed beside the venv: sglang_env.py).
The endpoint's own behaviour in process, with plain ZMQ sockets: tests/unit/api/sglang/test_serve.py."""

import asyncio
import base64
import io
import pickle

import httpx
import numpy as np
import pytest
import torch
import zmq

from service.api.sglang import wire
from service.store.format import read_ec_cache
from tests.support import imagedata as data
from tests.support import videodata as vd
from tests.support.checkpoints import make_byte_level_checkpoint
from tests.support.live import ServiceProcess, data_url, metric
from tests.support.sglang_env import VERSIONS, sglang_env
from tests.support.sglang_side import SglangSide

pytestmark = pytest.mark.system
IMAGE, VIDEO = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"


def _prompt(images: int = 0, videos: int = 0) -> str:
    return "<|im_start|>user\n" + IMAGE * images + VIDEO * videos + "What is this?<|im_end|>\n<|im_start|>assistant\n"


def _data_urls(names: list[str]) -> list[str]:
    return [data_url(data.valid_images()[n], "image/jpeg" if n.endswith(".jpg") else "image/png") for n in names]


@pytest.fixture(scope="module", params=VERSIONS)
def sglang(request, tiny_checkpoint, tmp_path_factory):
    """(SGLang's side, two encoder services on the tiny checkpoint, the version): each release against a pair
    of services started for it (`--sglang-version`)."""
    version = request.param
    env = sglang_env(version)
    tmp = tmp_path_factory.mktemp(f"sglang-{version}")
    servers = [ServiceProcess(["serve", "--model", str(tiny_checkpoint), "--device", "cpu", "--store",
                               str(tmp / f"store{i}"), "--decode-workers", "1", "--sglang-version", version],
                              tmp / f"server{i}.log", wait=False) for i in range(2)]
    side = SglangSide(env, tmp / "sglang.log")
    try:
        for server in servers:
            server.wait_ready()
        assert side.call("version") == {"version": version}
        yield side, servers, version
    finally:
        side.stop()
        for server in servers:
            assert server.stop()


def _serve(tmp_path, *extra: str, name: str = "server") -> ServiceProcess:
    return ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / f"{name}-store"),
                           "--max-pixels", str(256 * 256), "--decode-workers", "1", "--sglang-version", "0.5.23",
                           *extra], tmp_path / f"{name}.log")


class _Frame0(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch":
            return name
        return {"EmbeddingData": type("EmbeddingData", (), {}), "Modality": lambda v: v}[name]


def test_ranks_registering_at_any_api_process_get_every_part(tmp_path):
    """Two API processes on one socket: the part's /encode and each rank's registration arrive on connections
    of their own, so in either process; every rank gets every part, which ever process registered it."""
    server = _serve(tmp_path, "--api-processes", "2", "--sglang-push-timeout-s", "5")
    ctx = zmq.Context()
    try:
        ranks = [ctx.socket(zmq.PULL) for _ in range(2)]
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in ranks]
        item = data_url(data.photo("rocket.jpg", 120), "image/jpeg")
        req_ids = [f"r{i}_local_part_0" for i in range(12)]

        async def one(req_id: str):
            # a client each: a connection each, as SGLang's tokenizer and its ranks' side loops are
            async def post(path, body):
                async with httpx.AsyncClient(timeout=60) as c:
                    return await c.post(server.url + path, json=body)
            encode = asyncio.ensure_future(post("/sglang/encode", {
                "mm_items": [item], "num_parts": 1, "part_idx": 0, "req_id": req_id, "modality": "IMAGE",
                "prefill_host": "127.0.0.1", "embedding_port": None}))
            regs = await asyncio.gather(*(post("/sglang/scheduler_receive_url", {
                "req_id": req_id, "receive_count": 2, "receive_url": f"127.0.0.1:{p}", "modality": "IMAGE"})
                for p in ports))
            return [r.status_code for r in regs], (await encode).status_code

        async def run():
            return await asyncio.gather(*(one(r) for r in req_ids))

        assert asyncio.run(run()) == [([200, 200], 200)] * len(req_ids)
        for sock in ranks:
            got = []
            while sock.poll(5000) and len(got) < len(req_ids):
                frames = sock.recv_multipart()
                got.append(vars(_Frame0(io.BytesIO(frames[0])).load())["req_id"])
            assert sorted(got) == sorted(req_ids)
    finally:
        ctx.destroy(linger=0)
        assert server.stop()


def _urls(servers) -> list[str]:
    return [s.url + "/sglang" for s in servers]


def _encoded(servers) -> float:
    return sum(metric(httpx.get(s.url + "/metrics").text, "qve_images_total", 'outcome="encoded"') for s in servers)


def test_three_images_over_two_encoders_come_back_whole_equal_to_transformers(sglang, reference, tiny_checkpoint,
                                                                           tmp_path):
    """SGLang's own MMReceiverHTTP (zmq_to_tokenizer) splits the items over both services, and its Qwen-VL
    processor's get_validated_mm_data takes what comes back: every image's rows equal transformers'."""
    side, servers, _ = sglang
    names = ["astronaut.png", "rocket.jpg", "chelsea.png"]
    before = _encoded(servers)
    reply = side.call("tokenizer", urls=_urls(servers), checkpoint=str(tiny_checkpoint), prompt=_prompt(3),
                      images=_data_urls(names), out=str(tmp_path))
    assert reply.get("ok") is True, reply
    assert [item["modality"] for item in reply["items"]] == ["IMAGE"] * 3
    (received,) = reply["received"]
    assert received["meta"]["img_grid_thw"] == [reference[n][0] for n in names]
    for i, name in enumerate(names):
        got = torch.from_numpy(np.load(tmp_path / f"item{i}.npy"))
        ref = reference[name][1]
        assert got.shape == ref.shape and (got - ref).abs().max().item() <= 1e-5, name
        start, end = reply["items"][i]["offsets"][0]
        assert end - start + 1 == ref.shape[0]  # the placeholder expanded to the image's rows
    per_server = [metric(httpx.get(s.url + "/metrics").text, "qve_requests_total", 'status="200"') for s in servers]
    assert all(n >= 1 for n in per_server), per_server  # (both encoders took a part)
    assert _encoded(servers) - before == 3
    # To one encoder, twice (each service has its own store): the second time every item is a hit, pushed
    # from the store, nothing encoded.
    for again in ("once", "twice"):
        counted = _encoded(servers[:1])
        reply = side.call("tokenizer", urls=_urls(servers)[:1], checkpoint=str(tiny_checkpoint), prompt=_prompt(3),
                          images=_data_urls(names), out=str(tmp_path / again))
        assert reply.get("ok") is True
        for i in range(3):
            assert np.array_equal(np.load(tmp_path / again / f"item{i}.npy"), np.load(tmp_path / f"item{i}.npy"))
    assert _encoded(servers[:1]) == counted


def test_the_scheduler_path_with_two_ranks_gets_every_part_on_each(sglang, reference, tiny_checkpoint, tmp_path):
    """zmq_to_scheduler, SGLang's default for Qwen3-VL: the tokenizer dispatches with no port, each of two
    tensor-parallel ranks registers its own address, and each gets every part, assembled by SGLang's own code."""
    side, servers, _ = sglang
    names = ["coffee.png", "rocket.jpg", "camera.png"]
    reply = side.call("scheduler", urls=_urls(servers), checkpoint=str(tiny_checkpoint), prompt=_prompt(3),
                      images=_data_urls(names), ranks=2, out=str(tmp_path))
    assert reply["dispatch"] == {"returned": True, "errors": []}, reply
    assert [r["status"] for r in reply["ranks"]] == ["SUCCESS", "SUCCESS"], reply
    for rank in range(2):
        for i, name in enumerate(names):
            got = torch.from_numpy(np.load(tmp_path / f"rank{rank}_item{i}.npy"))
            assert (got - reference[name][1]).abs().max().item() <= 1e-5, (rank, name)


def test_a_video_comes_back_with_its_timestamps_in_the_prompt(sglang, tiny_checkpoint, tmp_path_factory, tmp_path):
    """A video part: SGLang's processor writes each temporal group's `<t seconds>` from the timestamps the message
    carries, then the group's rows (one item per group); rows and timestamps are the service's entry for it."""
    side, servers, _ = sglang
    from transformers import AutoTokenizer

    bpe = make_byte_level_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("bpe") / "ckpt")  # (Qwen's kind)
    clip = data_url(vd.clip(frames=24, fps=8), "video/mp4")
    reply = side.call("tokenizer", urls=_urls(servers)[:1], checkpoint=str(bpe), prompt=_prompt(videos=1),
                      videos=[clip], out=str(tmp_path), timeout=120)
    assert reply.get("ok") is True, reply
    entry = httpx.post(servers[0].url + "/encode", json={"images": [{"type": "video_url", "video_url": {"url": clip}}]},
                       timeout=120).json()["items"][0]
    assert entry["cached"] is True  # (the part stored it)
    (received,) = reply["received"]
    assert received["meta"]["video_grid_thw"] == [entry["grid_thw"]]
    assert received["meta"]["video_timestamps"] == [entry["timestamps"]]
    groups = entry["grid_thw"][0]
    assert [item["modality"] for item in reply["items"]] == ["VIDEO"] * groups
    rows = np.concatenate([np.load(tmp_path / f"item{i}.npy") for i in range(groups)])
    ec = read_ec_cache(servers[0].log.parent / "store0", entry["key"])
    assert np.array_equal(rows, ec.numpy())
    tok = AutoTokenizer.from_pretrained(bpe)
    ids = reply["input_ids"]
    for t in entry["timestamps"]:
        text = tok.encode(f"<{t:.1f} seconds>", add_special_tokens=False)
        assert any(ids[i:i + len(text)] == text for i in range(len(ids))), f"<{t:.1f} seconds> not in the prompt"


def test_a_bad_image_is_sglangs_error_frame_and_its_503_not_a_hang(sglang, tiny_checkpoint, tmp_path):
    side, servers, _ = sglang
    bad = data_url(data.corrupt_jpeg(), "image/jpeg")
    reply = side.call("tokenizer", urls=_urls(servers)[:1], checkpoint=str(tiny_checkpoint), prompt=_prompt(1),
                      images=[bad], out=str(tmp_path), timeout=60)
    assert reply == {"ok": False, "seconds": reply["seconds"], "received": []} and reply["seconds"] < 10
    assert side.call("reject_missing", checkpoint=str(tiny_checkpoint))["status_code"] == 503  # what its client sees
    sched = side.call("scheduler", urls=_urls(servers)[:1], checkpoint=str(tiny_checkpoint), prompt=_prompt(1),
                      images=[bad], ranks=2, out=str(tmp_path), timeout=60)
    for rank in sched["ranks"]:  # each rank fails the request with the service's own message, at once
        assert rank["status"] == "FAIL" and rank["error_code"] == 422 and "mm_items[0]" in rank["error_msg"], sched
    # and the service goes on
    ok = side.call("tokenizer", urls=_urls(servers)[:1], checkpoint=str(tiny_checkpoint), prompt=_prompt(1),
                   images=_data_urls(["rocket.jpg"]), out=str(tmp_path / "ok"))
    assert ok.get("ok") is True


def test_sglangs_allow_listed_unpickler_takes_every_frame_the_service_writes(sglang, tmp_path):
    side, _, version = sglang
    rows = torch.arange(12 * 8, dtype=torch.float32).reshape(12, 8).to(torch.bfloat16)
    frames = wire.success_frames("r_local_part_1", 2, 1, "VIDEO", [[2, 2, 12]], "bfloat16", (12, 8),
                                 rows.view(torch.int16).numpy().tobytes(), [[0.25, 1.25]])
    got = side.call("unpickle", frames_b64=[base64.b64encode(f).decode() for f in frames], out=str(tmp_path / "r.npy"))
    assert got["class"] == "sglang.srt.disaggregation.encoder.receiver.EmbeddingData", got
    assert got["dict"]["modality"] == "VIDEO" and got["dict"]["dtype"] == "torch.bfloat16"
    assert got["frame1"] == {"shape": [12, 8], "dtype": "torch.bfloat16"}
    assert got["meta"] == {"video_grid_thw": [[2, 2, 12]], "video_timestamps": [[0.25, 1.25]]}
    assert np.array_equal(np.load(tmp_path / "r.npy"), rows.float().numpy())
    (error,) = wire.error_frames("e_local_part_0", 1, 0, "IMAGE", "bad", 422)
    got = side.call("unpickle", frames_b64=[base64.b64encode(error).decode()])
    assert got["dict"]["error_msg"] == "bad" and got["dict"]["error_code"] == 422


def test_parts_over_a_mooncake_store_are_read_back_from_the_pool_by_each_api_process(tmp_path, mooncake_master_binary):
    """--store mooncake://: each API process reads a part's rows from the pool (its own Mooncake client) and
    pushes exactly the value the pool holds."""
    from service.store.reader import open_reader
    from tests.support.mooncake_pool import LOOPBACK, Master

    master = Master(mooncake_master_binary, LOOPBACK, tmp_path / "master.log", lease_ttl_ms=30_000)
    server = ctx = None
    try:
        server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", master.url,
                                 "--mooncake-local-host", "127.0.0.1", "--mooncake-segment-bytes", str(64 << 20),
                                 "--max-pixels", str(256 * 256), "--decode-workers", "1", "--api-processes", "2",
                                 "--sglang-version", "0.5.23"], tmp_path / "server.log")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        names = ["rocket.jpg", "coffee.png", "camera.png", "astronaut.png"]
        for i, url in enumerate(_data_urls(names)):
            with httpx.Client(timeout=60) as c:  # (a connection each: either API process)
                r = c.post(server.url + "/sglang/encode", json={
                    "mm_items": [url], "num_parts": 1, "part_idx": 0, "req_id": f"m{i}_local_part_0",
                    "modality": "IMAGE", "prefill_host": "127.0.0.1", "embedding_port": port})
            assert r.status_code == 200, r.text
        reader, got = open_reader(master.url), {}
        while len(got) < len(names) and sock.poll(10_000):
            frames = sock.recv_multipart()
            got[vars(_Frame0(io.BytesIO(frames[0])).load())["req_id"]] = frames
        for i, url in enumerate(_data_urls(names)):
            frames = got[f"m{i}_local_part_0"]
            item = httpx.post(server.url + "/encode", json={"images": [{"type": "image_url", "image_url": {"url": url}}]},
                              timeout=60).json()["items"][0]
            assert item["cached"] is True and item["store_key"]
            assert frames[1] == reader.read_ec_cache(item["key"], item["store_key"]).numpy().tobytes(), names[i]
        reader.close()
    finally:
        if ctx is not None:
            ctx.destroy(linger=0)
        if server is not None:
            assert server.stop()
        master.stop()

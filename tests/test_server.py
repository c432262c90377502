"""The real server as its own process (python -m service serve ... on a loopback port)."""

import io
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from PIL import Image, ImageOps
from transformers import Qwen3VLForConditionalGeneration

from service.store.format import read_embeddings
from tests import imagedata as data
from tests.checkpoints import PilProcessor
from tests.live import ServiceProcess, json_body, metric

ROOT = Path(__file__).resolve().parents[1]

IMAGES = [  # real photographs first, then modes / formats / shapes
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "page.png", "retina.jpg@360",
    "hubble_deep_field.jpg@400", "rgba.png", "palette_transparent.png", "gray.png", "cmyk.jpg", "exif6.jpg",
    "noise.webp.lossy", "noise.gif.animated", "wide_4000x40.png",
]


class Server(ServiceProcess):
    def __init__(self, ckpt, store, *extra):
        logs = len(list(store.parent.glob("server-*.log")))  # one log per server a test starts on this store
        super().__init__(["serve", "--model", str(ckpt), "--device", "cpu", "--dtype", "float32", "--store", str(store),
                          "--host", "127.0.0.1", "--decode-workers", "2", *extra],
                         store.parent / f"server-{logs}.log")

    def listening_addresses(self) -> set[str]:
        """Local addresses with a LISTEN socket on our port (from /proc/net/tcp{,6})."""
        found = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            if not os.path.exists(table):
                continue
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.split(":")
                if int(port, 16) == self.port and state == "0A":
                    found.add(addr)
        return found


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """transformers' processor + vision tower for every test image: name -> (grid_thw, [tokens, 48*3])."""
    blobs = [data.valid_images()[n] for n in IMAGES]
    pil = [ImageOps.exif_transpose(Image.open(io.BytesIO(b))) for b in blobs]
    inputs = PilProcessor.from_pretrained(tiny_checkpoint)(images=pil, return_tensors="pt")
    visual = Qwen3VLForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).model.visual.eval()
    with torch.no_grad():
        out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    full = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    refs, offset = {}, 0
    for name, grid in zip(IMAGES, inputs["image_grid_thw"].tolist()):
        n = grid[0] * grid[1] * grid[2] // 4
        refs[name] = (grid, full[offset : offset + n])
        offset += n
    return refs


def two_image_client(server, c: int):
    """Client c of many: two test images; odd clients use multipart, even ones JSON."""
    blobs = data.valid_images()
    names = [IMAGES[c % len(IMAGES)], IMAGES[(c * 7 + 3) % len(IMAGES)]]
    if c % 2:
        files = [("image", (n, blobs[n], "application/octet-stream")) for n in names]
        return names, httpx.post(server.url + "/encode", files=files, timeout=120)
    return names, httpx.post(server.url + "/encode", json=json_body(*(blobs[n] for n in names)), timeout=120)


def test_32_concurrent_clients_match_transformers(tmp_path, tiny_checkpoint, reference):
    store = tmp_path / "store"
    server = Server(tiny_checkpoint, store, "--max-wait-ms", "20")
    try:
        assert server.listening_addresses() == {"0100007F"}  # 127.0.0.1 only, nothing else advertised
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda c: two_image_client(server, c), range(32)))
        checked = set()
        for names, r in results:
            assert r.status_code == 200, r.text
            items = r.json()["items"]
            assert len(items) == 2
            for name, item in zip(names, items):
                grid, ref = reference[name]
                stored = read_embeddings(store, item["key"])
                ec = torch.cat([stored.main, *stored.deepstack], dim=1)
                # every response field against the stored tensor
                assert item["grid_thw"] == list(stored.grid_thw) == grid, name
                assert item["shape"] == list(ec.shape) and item["num_tokens"] == ec.shape[0], name
                assert item["dtype"] == "float32" and ec.dtype == torch.float32
                assert item["path"] == f"{item['key']}/encoder_cache.safetensors"
                assert (store / item["path"]).is_file()
                # and the stored tensor against transformers
                diff = (ec - ref).abs().max().item()
                assert diff <= 1e-5, f"{name}: max abs diff {diff}"
                checked.add(name)
        assert checked == set(IMAGES)
        m = httpx.get(server.url + "/metrics").text
        assert metric(m, "qve_requests_total", 'status="200"') == 32
        assert metric(m, "qve_images_total", 'outcome="encoded"') == len(IMAGES)  # each distinct image once
        assert metric(m, "qve_store_items") == len(IMAGES)
    finally:
        assert server.stop()


def test_sigterm_finishes_queued_work_and_restart_reuses_the_store(tmp_path, tiny_checkpoint):
    store = tmp_path / "store"
    # One large image per step (slow steps, so work piles up in the queue): SIGTERM lands once every
    # request is inside the service (answered, queued or running) and some are not answered yet.
    # NOTE: conditions, not timing. SIGTERM before every request was accepted would refuse the late
    # ones (uvicorn stops accepting first), which is right for a server and not what this tests.
    server = Server(tiny_checkpoint, store, "--max-batch-images", "1", "--max-wait-ms", "0", "--max-pixels", "1000000")
    blobs = [data.encode(data.textured_rgb(900, 860, seed=900 + i), "PNG") for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(httpx.post, server.url + "/encode", json=json_body(b), timeout=120) for b in blobs]
        deadline = time.monotonic() + 120
        while True:
            m = httpx.get(server.url + "/metrics").text
            waiting = metric(m, "qve_queue_depth") + metric(m, "qve_in_flight")
            answered = sum(metric(m, "qve_images_total", f'outcome="{o}"') for o in ("encoded", "cached", "coalesced"))
            if answered + waiting == len(blobs) and waiting >= 2:
                break
            assert time.monotonic() < deadline, f"requests never piled up ({answered} answered, {waiting} waiting)"
            time.sleep(0.002)
        assert server.stop()  # SIGTERM, then a graceful exit
        responses = [f.result() for f in futures]
    assert [r.status_code for r in responses] == [200] * 12
    keys = [r.json()["items"][0]["key"] for r in responses]
    assert all((store / k / "encoder_cache.safetensors").is_file() for k in keys)
    log = server.log.read_text()
    assert "Waiting for connections to close" in log or "Shutting down" in log

    # restart on the existing store: the index is rebuilt from disk and every image is a cache hit
    again = Server(tiny_checkpoint, store, "--max-pixels", "1000000")  # same preprocessing: same keys
    try:
        m = httpx.get(again.url + "/metrics").text
        assert metric(m, "qve_store_items") == 12
        r = httpx.post(again.url + "/encode", json=json_body(*blobs[:4]), timeout=60)
        assert [it["cached"] for it in r.json()["items"]] == [True] * 4
        assert [it["key"] for it in r.json()["items"]] == keys[:4]
    finally:
        assert again.stop()


def test_sigkill_of_a_single_process_server_leaves_no_decode_worker(tmp_path, tiny_checkpoint):
    from tests.procs.test_supervisor import alive, descendants, wait_for

    server = Server(tiny_checkpoint, tmp_path / "store", "--decode-workers", "2")
    r = httpx.post(server.url + "/encode", json=json_body(data.encode(data.textured_rgb(80, 80, seed=5), "PNG")),
                   timeout=60)
    assert r.status_code == 200
    children = descendants(server.proc.pid)
    assert len(children) >= 3  # the forkserver and two decode workers (+ multiprocessing's resource tracker)
    server.proc.kill()
    server.proc.wait(10)
    wait_for(lambda: not any(alive(p) for p in children), 15, "every child gone after the server's SIGKILL")


def test_bad_model_directory_fails_fast_with_a_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "service", "serve", "--model", str(tmp_path / "nope"), "--device", "cpu", "--port", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "neither a preset" in proc.stderr and "nope" in proc.stderr


def test_a_second_service_on_the_same_store_root_refuses_to_start(tmp_path, tiny_checkpoint):
    store = tmp_path / "store"
    first = Server(tiny_checkpoint, store)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "service", "serve", "--model", "tiny", "--device", "cpu", "--store", str(store),
             "--port", "0", "--no-warmup"],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
        assert second.returncode != 0
        assert "is writing to the store root" in second.stdout + second.stderr  # and says what to do
        assert httpx.get(first.url + "/health").status_code == 200  # the first one is unaffected
    finally:
        assert first.stop()


def stalled_heads_are_cut_off(server, timeout_s: float, n: int = 200) -> None:
    """`n` connections that each send part of a request head and stall (slowloris): each is answered 408
    and closed within the bound of --header-timeout-s, and the server answers normal requests meanwhile
    and afterwards."""
    import socket

    stalled = []
    for i in range(n):
        c = socket.create_connection(("127.0.0.1", server.port), timeout=timeout_s + 30)
        c.sendall(b"POST /encode HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Pad-%d: " % i)
        stalled.append((c, time.monotonic()))
    blob = data.encode(data.textured_rgb(72, 72, seed=n), "PNG")
    assert httpx.post(server.url + "/encode", json=json_body(blob), timeout=60).status_code == 200  # meanwhile
    took = []
    for c, opened in stalled:
        answer = b""
        while chunk := c.recv(65536):
            answer += chunk
        took.append(time.monotonic() - opened)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer, answer[:300]
        c.close()
    assert timeout_s * 0.9 <= min(took) and max(took) < timeout_s + 10, (min(took), max(took))
    r = httpx.post(server.url + "/encode", json=json_body(blob), timeout=60)  # afterwards
    assert r.status_code == 200 and r.json()["items"][0]["cached"] is True


def test_stalled_request_heads_are_cut_off_and_the_server_keeps_serving(tmp_path, tiny_checkpoint):
    server = Server(tiny_checkpoint, tmp_path / "store", "--header-timeout-s", "1")
    try:
        stalled_heads_are_cut_off(server, 1.0)
    finally:
        assert server.stop()

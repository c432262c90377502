"""Priorities and deadlines black-box, in both process modes: a queue filled with bulk work (priority 10)
and a later interactive request (priority 0) that finishes before most of it; a later bulk request sent with
it finishes after; a request whose deadline passes while it waits is answered 504 and never encoded."""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from tests.support import imagedata as data
from tests.support.live import ServiceProcess, json_body, metric

BULK = 24


def _photo(i: int) -> bytes:
    """A distinct 640x640 crop of a real photograph (distinct bytes: no coalescing, no cache hit)."""
    photo = Image.open(io.BytesIO(data.photo("chelsea.png"))).convert("RGB").resize((900, 700))
    x, y = (i * 11) % 260, (i * 7) % 60
    return data.encode(photo.crop((x, y, x + 640, y + 640)), "JPEG", quality=90)


def _waiting(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(metric(text, "qve_waiting_images", f'priority="{p}"') or 0 for p in (0, 10))


@pytest.mark.parametrize("api_processes", ["0", "1"], ids=["one-process", "api-processes"])
def test_a_later_urgent_request_overtakes_queued_bulk_work_and_a_spent_deadline_is_504(tmp_path, api_processes):
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--api-processes", api_processes, "--decode-workers", "1", "--max-batch-images", "1",
                             "--max-wait-ms", "0", "--max-pixels", str(640 * 640), "--priority-aging-s", "60"],
                            tmp_path / "server.log")
    finished: dict[str, float] = {}
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def post(name: str, blob: bytes, **fields) -> None:
        r = httpx.post(server.url + "/encode", json={**json_body(blob), **fields}, timeout=120)
        with lock:
            finished[name], statuses[name] = time.monotonic(), r.status_code

    try:
        blobs = [_photo(i) for i in range(BULK + 3)]
        with ThreadPoolExecutor(BULK + 3) as pool:
            bulk = [pool.submit(post, f"bulk{i}", blobs[i], priority=10) for i in range(BULK)]
            deadline = time.monotonic() + 60
            while _waiting(server.url) < BULK // 2:  # the queue (and the decoder's waiting room) holds bulk work
                assert time.monotonic() < deadline, "the bulk work never queued up"
                time.sleep(0.02)
            sent = time.monotonic()
            urgent = pool.submit(post, "urgent", blobs[BULK], priority=0)
            late_bulk = pool.submit(post, "late-bulk", blobs[BULK + 1], priority=10)
            expiring = pool.submit(post, "expiring", blobs[BULK + 2], priority=10, deadline_ms=300)
            for f in [*bulk, urgent, late_bulk, expiring]:
                f.result()
        assert statuses["urgent"] == 200 and statuses["late-bulk"] == 200, statuses
        assert statuses["expiring"] == 504, statuses
        pending = [n for n in finished if n.startswith("bulk") and finished[n] > sent]  # bulk still waiting then
        after_urgent = [n for n in pending if finished[n] > finished["urgent"]]
        before_late = [n for n in pending if finished[n] < finished["late-bulk"]]
        print(f"{len(pending)} bulk requests unfinished when the urgent one was sent; {len(after_urgent)} finished "
              f"after it, {len(before_late)} before the later bulk one")
        assert len(pending) >= BULK // 3, "the queue drained before the urgent request came: the test proves nothing"
        assert len(after_urgent) >= 0.75 * len(pending), (len(after_urgent), len(pending))
        assert len(before_late) >= 0.75 * len(pending), (len(before_late), len(pending))
        assert all(statuses[f"bulk{i}"] == 200 for i in range(BULK)), statuses
        text = httpx.get(server.url + "/metrics", timeout=10).text
        assert metric(text, "qve_requests_total", 'status="504"') == 1
        expired = sum(metric(text, "qve_deadline_exceeded_total", f'where="{w}"') or 0
                      for w in ("claim", "decode", "submit", "queue"))
        assert expired == 1, text
        assert metric(text, "qve_encoded_images_total") == BULK + 2  # the expired image never ran
    finally:
        assert server.stop()

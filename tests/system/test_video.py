"""Videos through the real server as its own process (python -m service serve ... on a loopback port): long
videos beside images, in one process and with API processes."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support import imagedata as data
from tests.support import videodata as vd
from tests.support.live import ServiceProcess, data_url, json_body

pytest.importorskip("av", reason="PyAV makes the clips (the `video` extra)")


def _video_body(blob: bytes) -> dict:
    return {"images": [{"type": "video_url", "video_url": {"url": data_url(blob, "video/mp4")}}]}


def _decode_s(r: httpx.Response) -> float:
    """The `decode` phase of an answer's Server-Timing, in seconds: the video's decode, as the server timed it."""
    spans = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    return float(spans["decode"]) / 1e3


@pytest.mark.slow  # a server of its own per mode, and 4K videos that each take seconds to decode
@pytest.mark.parametrize("api_processes", ["0", "1"], ids=["one-process", "api-processes"])
def test_long_videos_neither_starve_images_nor_trip_the_stall_watch(tmp_path, api_processes):
    """Two long videos decoding took both decoders: images waited for one of them to end (p50 14 s, max 36 s in
    one process, up to 21 s with API processes), and in one process the stall watch, seeing no decode finish
    for 30 s, answered both videos 503 although they were within --video-max-decode-s. Now videos decode on
    fewer decoders than there are (here one of two), so images sent beside them are answered within a small
    part of the first video's decode, whatever the machine's speed; and a video's frames are progress for the
    stall watch, so videos that decode for longer than --decode-stall-s (1 s here) are answered 200.

    Each video is 150 4K frames (a 100 KB file), every frame sampled: seconds of decoding."""
    stall_s = 1.0
    first, second = (vd.still_clip(3840, 2160, frames=n, fps=1) for n in (150, 151))
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--api-processes", api_processes, "--decode-workers", "2",
                             "--decode-stall-s", str(stall_s)], tmp_path / "server.log")
    try:
        warm = httpx.post(server.url + "/encode", json=_video_body(vd.clip()), timeout=300)  # (a decoder's imports)
        assert warm.status_code == 200, warm.text
        videos_done = threading.Event()
        latencies: list[tuple[int, float]] = []

        def video(blob: bytes) -> httpx.Response:
            return httpx.post(server.url + "/encode", json=_video_body(blob), timeout=300)

        def images() -> None:
            i = 0
            while not videos_done.is_set():
                start = time.monotonic()
                r = httpx.post(server.url + "/encode", json=json_body(data.encode(data.textured_rgb(96, 64, seed=i), "PNG")),
                               timeout=300)
                latencies.append((r.status_code, time.monotonic() - start))
                i += 1

        with ThreadPoolExecutor(3) as pool:
            videos = [pool.submit(video, first), pool.submit(video, second)]
            time.sleep(0.5)  # (both keyed and admitted by now: a header is read in milliseconds)
            client = pool.submit(images)
            answers = [v.result() for v in videos]
            videos_done.set()
            client.result()
        assert [r.status_code for r in answers] == [200, 200], [r.text[:300] for r in answers]
        decodes = sorted(_decode_s(r) for r in answers)
        if api_processes == "0":  # (the stall watch is the decode processes'; threads have none)
            assert decodes[0] > stall_s, f"the videos decoded in {decodes} s: too fast to outlast the stall limit"
        assert all(status == 200 for status, _ in latencies), latencies
        worst = max(s for _, s in latencies)
        print(f"two videos decoded in {decodes[0]:.1f} and {decodes[1]:.1f} s (their requests' decode phase); "
              f"{len(latencies)} images beside them, the slowest answered in {worst:.2f} s")
        assert len(latencies) >= 3 and worst < decodes[0] / 3, (decodes, latencies)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        assert server.stop()

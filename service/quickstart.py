"""`qwen3vl-encoder try` (`make try`): post an image or a video to a running server and print what came back
and where the embeddings are, so a newcomer sees the whole round trip without writing a client.

The image shipped for it, service/data/cat.jpg, is scikit-image's "chelsea" photograph (CC0, by
Stefan van der Walt) saved as a JPEG. Imports stay light (no torch): the command answers at once.
"""

from __future__ import annotations

import base64
import os
import sys
import time
from pathlib import Path

EXAMPLE_IMAGE = Path(__file__).with_name("data") / "cat.jpg"


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _wait_ready(client, url: str, wait_s: float) -> dict | int:
    """/ready's answer once it is 200, or an exit status after printing why not."""
    import httpx

    deadline = time.monotonic() + wait_s
    said = None
    while True:
        try:
            r = client.get("/ready", timeout=5)
            if r.status_code == 200:
                return r.json()
            try:
                phase = r.json().get("phase", "starting")
            except (ValueError, AttributeError):  # not this service's JSON
                phase = f"HTTP {r.status_code}"
        except httpx.ConnectError:
            return _fail(f"no server at {url} (connection refused); start one with `make run` or "
                         "`.venv/bin/qwen3vl-encoder serve`", 2)
        except httpx.TimeoutException:  # bound early, still importing: the connection waits in the backlog
            phase = "starting"
        except httpx.TransportError as e:
            return _fail(f"cannot reach {url}: {e}", 2)
        if time.monotonic() >= deadline:
            return _fail(f"the server at {url} is not ready after {wait_s:g} s (phase: {phase}); "
                         "try again, or pass --wait-s", 2)
        if phase != said:
            print(f"waiting for the server at {url} to be ready (phase: {phase})", file=sys.stderr)
            said = phase
        time.sleep(0.5)


def try_it(url: str, image: Path | None, wait_s: float, video: Path | None = None) -> int:
    """Post `video` as a video, or `image` (the example image if neither is given): an image, or a video when
    its bytes are a video container's. Exit status: 0 answered, 1 refused, 2 no ready server at `url`."""
    import httpx

    from service.media.sniff import looks_like_video

    path = video or image or EXAMPLE_IMAGE
    try:
        data = path.read_bytes()
    except OSError as e:
        return _fail(f"cannot read {path}: {e.strerror}")
    if video is not None or looks_like_video(data):
        part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(data).decode()}}
    else:
        mime = {".png": "image/png", ".webp": "image/webp", ".gif": "image/gif"}.get(path.suffix.lower(), "image/jpeg")
        part = {"type": "image_url", "image_url": {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}
    body = {"images": [part]}
    # The server's own variable: with --api-key set there, the same shell has the key.
    key = os.environ.get("QVE_API_KEY", "").split(",")[0].strip()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers) as client:
        info = _wait_ready(client, url, wait_s)
        if isinstance(info, int):
            return info
        try:
            r = client.post("/encode", json=body, timeout=300)
        except httpx.TransportError as e:
            return _fail(f"POST {url}/encode failed: {e}", 2)
    if r.status_code != 200:
        try:
            err = r.json()["error"]
            reason = f"{err['code']}: {err['message']}"
        except (ValueError, KeyError, TypeError):
            reason = r.text[:200]
        hint = " (set QVE_API_KEY to one of the server's keys)" if r.status_code == 401 else ""
        return _fail(f"POST {url}/encode answered HTTP {r.status_code}, {reason}{hint}")
    (item,) = r.json()["items"]
    store = info.get("store")
    if item.get("store_key") is not None:  # Mooncake Store: a key in the pool, not a file
        where = f"{item['store_key']}  (in the Mooncake pool at {store})"
    else:
        where = Path(store, item["path"]) if store else item["path"]
    print(f"POST {url}/encode {path.name} ({len(data)} bytes) -> 200")
    print(f"  model     {info.get('model')} on {info.get('device')} ({info.get('dtype')})")
    print(f"  key       {item['key']}")
    print(f"  modality  {item.get('modality', 'image')}")
    if item.get("frames_indices") is not None:
        print(f"  frames    {len(item['frames_indices'])} frames sampled, at {item['fps']:g} fps")
    print(f"  shape     {item['shape']} {item['dtype']} ({item['num_tokens']} tokens, grid_thw {item['grid_thw']})")
    print(f"  cached    {str(item['cached']).lower()}")
    if item.get("store_key") is not None:
        print(f"  entry     {where}")
    else:
        print(f"  file      {where}" + ("" if not store or Path(where).is_file() else "  (on the server's machine)"))
    return 0

"""Example LM-side consumer: how an LM server gets image embeddings from the encoder tier.

    python -m service.lm.consumer --url http://127.0.0.1:8080 --store /dev/shm/qwen3vl-encoder-cache cat.jpg

For each image it POSTs the file to /encode (multipart), then reads the returned key from the shared
store with `read_embeddings` -- the store is read-only from this side, and the embeddings never travel
over HTTP -- and checks that the answer and the file agree. With no image arguments it sends a small
synthetic image, so the compose `consumer` service has something to show. Exit status: 0 when every
check passed, 1 on a mismatch or a refused request, 2 when the service cannot be reached.

An LM server does the same per request: the image's `grid_thw` gives Qwen3-VL's 3-D rotary positions,
`main` replaces the image placeholder tokens' embeddings, and `deepstack[i]` is added after LM layer i.
"""

from __future__ import annotations

import argparse
import io
import mimetypes
import sys
import time
from pathlib import Path

import httpx

from service.lm.client import post
from service.store.options import default_store_dir
from service.store.format import StoredEmbeddings
from service.store.reader import read_embeddings

SPATIAL_MERGE = 2  # Qwen3-VL merges 2x2 patches into one output token


def synthetic_png(width: int = 320, height: int = 224) -> bytes:
    """A small deterministic test picture (colour gradients and a disc), PNG-encoded in memory."""
    from PIL import Image, ImageDraw

    img = Image.merge(
        "RGB",
        (
            Image.linear_gradient("L").resize((width, height)),
            Image.linear_gradient("L").rotate(90).resize((width, height)),
            Image.radial_gradient("L").resize((width, height)),
        ),
    )
    ImageDraw.Draw(img).ellipse((width // 4, height // 4, width // 2, height // 2), fill=(230, 60, 40))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def wait_ready(client: httpx.Client, timeout_s: float) -> None:
    """Poll GET /ready until it answers 200; connection errors count as not ready yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get("/ready").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{client.base_url} was not ready within {timeout_s:g} s")
        time.sleep(0.5)


def encode(client: httpx.Client, name: str, data: bytes) -> dict:
    """POST one image as a multipart `image` part; returns its item of the /encode answer."""
    mime = mimetypes.guess_type(name)[0] or "application/octet-stream"
    r, _ = post(client, "/encode", files=[("image", (name, data, mime))])  # retried once if the connection was stale
    if r.status_code != 200:
        raise RuntimeError(f"/encode refused {name}: HTTP {r.status_code}: {r.text[:500]}")
    (item,) = r.json()["items"]
    return item


def check(item: dict, emb: StoredEmbeddings, store: Path | None) -> list[str]:
    """Every disagreement between the /encode answer and the stored file (empty list: consistent).
    With `store`, also that the answered path is a file under it (None: the caller read the entry by
    key already, and a file check after the read could race an eviction)."""
    problems = []
    t, h, w = item["grid_thw"]
    n = item["num_tokens"]
    out_hidden = int(emb.metadata["out_hidden_size"])
    levels = len(emb.deepstack)
    if n != t * h * w // SPATIAL_MERGE**2:
        problems.append(f"num_tokens {n} != t*h*w/{SPATIAL_MERGE**2} = {t * h * w // SPATIAL_MERGE**2}")
    if list(emb.grid_thw) != [t, h, w]:
        problems.append(f"stored grid_thw {list(emb.grid_thw)} != answered {[t, h, w]}")
    if list(emb.main.shape) != [n, out_hidden]:
        problems.append(f"main shape {list(emb.main.shape)} != [{n}, {out_hidden}]")
    if any(d.shape != emb.main.shape for d in emb.deepstack):
        problems.append(f"deepstack shapes {[list(d.shape) for d in emb.deepstack]} != main {list(emb.main.shape)}")
    if levels != int(emb.metadata["deepstack_levels"]):
        problems.append(f"{levels} deepstack tensors, metadata says {emb.metadata['deepstack_levels']}")
    if list(item["shape"]) != [n, out_hidden * (1 + levels)]:
        problems.append(f"answered shape {item['shape']} != [{n}, {out_hidden}*(1+{levels})]")
    if str(emb.main.dtype).removeprefix("torch.") != item["dtype"]:
        problems.append(f"stored dtype {emb.main.dtype} != answered {item['dtype']}")
    if store is not None and not (store / item["path"]).is_file():
        problems.append(f"answered path {item['path']!r} is not a file under {store}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m service.lm.consumer", description=__doc__.split("\n\n")[0])
    p.add_argument("images", nargs="*", type=Path, metavar="IMAGE", help="image files (default: a synthetic one)")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="encoder service base URL")
    p.add_argument("--store", default=str(default_store_dir()), help="the store the service writes: its root, or "
                   "mooncake://MASTER_HOST:RPC_PORT")
    p.add_argument("--wait-ready", type=float, default=0.0, metavar="SECONDS", help="first wait this long for /ready")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS", help="per-request HTTP timeout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    inputs = [(p.name, p.read_bytes()) for p in args.images] or [("synthetic.png", synthetic_png())]
    failed = False
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        try:
            if args.wait_ready > 0:
                wait_ready(client, args.wait_ready)
            for name, data in inputs:
                try:
                    item = encode(client, name, data)
                except RuntimeError as e:
                    print(e, file=sys.stderr)
                    failed = True
                    continue
                try:
                    emb = read_embeddings(args.store, item["key"], store_key=item.get("store_key"))
                except KeyError:
                    print(f"{name}: key {item['key']} is not in the store at {args.store} (wrong --store, or evicted)")
                    failed = True
                    continue
                problems = check(item, emb, None if str(args.store).startswith("mooncake://") else Path(args.store))
                print(
                    f"{name}: key={item['key']} grid_thw={tuple(emb.grid_thw)} main={list(emb.main.shape)} "
                    f"deepstack_levels={len(emb.deepstack)} dtype={item['dtype']} cached={item['cached']} "
                    + ("OK" if not problems else "MISMATCH")
                )
                for p in problems:
                    print(f"  - {p}")
                failed |= bool(problems)
        except (httpx.TransportError, TimeoutError) as e:
            print(f"cannot reach the encoder service at {args.url}: {e}", file=sys.stderr)
            return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

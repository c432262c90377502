"""What keying one image costs the API process, per scheme, on this host's CPU (no GPU needed):

    python bench/bench_keys.py [--calls 2000] [--repeats 5] [--side 448] [--out FILE.json]

For a JPEG of service/data/cat.jpg resized to --side x --side px (quality 90, like a photo): the
content key (store/keys.py: SHA-256 of the bytes under the model's salt), vLLM's mm_hash (VllmKeys.image, for
--vllm-model-id) with each --mm-hasher-algorithm, and the header read both need first (media/images.py's
read_header). Each figure is the median over --repeats of the mean of --calls calls, in microseconds; the
content key is the baseline of the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _photo(side: int) -> bytes:
    from PIL import Image

    from service.quickstart import EXAMPLE_IMAGE

    img = Image.open(EXAMPLE_IMAGE).convert("RGB")
    img = img.resize((side, side), Image.BICUBIC)  # (square, as the front end benchmark's images)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _per_call_us(fn, calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(runs), 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from service.media.images import read_header
    from service.media.params import ImageLimits, PreprocessParams
    from service.store.keys import HASH_ALGORITHMS, VllmKeys, content_key, key_salt

    data = _photo(args.side)
    limits = ImageLimits()
    salt = key_salt("preset:qwen3-vl-2b:seed0", PreprocessParams(), "torch.bfloat16").encode()
    header = read_header(data, limits)
    converted = not header.plain_rgb
    res = {"jpeg_bytes": len(data), "size": list(header.size), "python": platform.python_version(),
           "cpu": platform.processor() or platform.machine(), "us": {}}
    res["us"]["header"] = _per_call_us(lambda: read_header(data, limits), args.calls, args.repeats)
    res["us"]["content_key"] = _per_call_us(lambda: content_key(salt, hashlib.sha256(data).digest()), args.calls,
                                            args.repeats)
    for algorithm in HASH_ALGORITHMS:
        keys = VllmKeys("Qwen/Qwen3-VL-2B-Instruct", algorithm)
        res["us"][f"vllm_{algorithm}"] = _per_call_us(lambda: keys.image(data, converted), args.calls, args.repeats)
    base = res["us"]["content_key"]
    res["vs_content_key"] = {k: round(v / base, 3) for k, v in res["us"].items() if k.startswith("vllm_")}
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

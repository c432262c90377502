"""Store keys (service/store/keys.py): what a key may be, content keys and their salts, the shard of a key."""

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest

from service.errors import RequestError
from service.media.images import read_header
from service.media.params import ImageLimits, PreprocessParams, VideoParams
from service.store.keys import (CONTENT_KEY_PREFIX, VllmKeys, content_key, is_store_key, key_salt, shard_of,
                                validate_key, video_salt)
from tests.support import imagedata as data
from tests.support.errors import raises_code
from tests.support.vllm_env import VERSIONS, vllm_env


def test_a_uuid_is_a_key_verbatim_but_never_a_content_key():
    content = content_key(b"salt", hashlib.sha256(b"bytes").digest())
    assert content.startswith(CONTENT_KEY_PREFIX) and len(content) == len(CONTENT_KEY_PREFIX) + 64
    assert is_store_key(content) and validate_key(content) == content
    with raises_code(RequestError, "invalid_key"):
        validate_key(content, content_keys=False)
    assert validate_key("cat-1", content_keys=False) == "cat-1"
    for bad in ("../x", ".hidden", "a" * 129, "a b", "abc\n", "", None):
        assert not is_store_key(bad)


def test_content_keys_change_with_the_salt_and_the_bytes_and_a_video_is_never_an_image():
    digest = hashlib.sha256(b"the same bytes").digest()
    salt = key_salt("qwen3-vl-2b", PreprocessParams(), "torch.bfloat16").encode()
    keys = {content_key(salt, digest),
            content_key(key_salt("qwen3-vl-4b", PreprocessParams(), "torch.bfloat16").encode(), digest),
            content_key(key_salt("qwen3-vl-2b", PreprocessParams(max_pixels=1 << 20), "torch.bfloat16").encode(), digest),
            content_key(key_salt("qwen3-vl-2b", PreprocessParams(), "torch.float32").encode(), digest),
            content_key(key_salt("qwen3-vl-2b", PreprocessParams(), "torch.bfloat16", ("qkv",), (1, 2)).encode(), digest),
            content_key(video_salt(salt, VideoParams()), digest),
            content_key(video_salt(salt, VideoParams(fps=3.0)), digest),
            content_key(salt, hashlib.sha256(b"other bytes").digest())}
    assert len(keys) == 8
    assert content_key(salt, digest) == content_key(salt, digest)  # the same inputs, the same key
    assert key_salt("m", PreprocessParams(), "torch.bfloat16", ("qkv", "fc1"), (1, 2)).endswith("|fp8 qkv+fc1 blocks 1,2")


def test_a_keys_shard_is_the_same_in_every_process():
    keys = [f"k{i}" for i in range(50)]
    here = [shard_of(k, 3) for k in keys]
    code = f"from service.store.keys import shard_of; print([shard_of(k, 3) for k in {keys!r}])"
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == str(here) and set(here) == {0, 1, 2}
    assert all(shard_of(k, 1) == 0 for k in keys)


_VLLM_KEYS = """import json, pathlib, sys
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.image import ImageMediaIO
out = {}
for path in sorted(pathlib.Path(sys.argv[1]).iterdir()):
    try:
        item = ImageMediaIO().load_bytes(path.read_bytes())
    except Exception as e:
        out[path.name] = f"{type(e).__name__}: {e}"
        continue
    out[path.name] = {a: MultiModalHasher.hash_kwargs(a, model_id=sys.argv[2], image=item)
                      for a in ("blake3", "sha256", "sha512")}
print("@@" + json.dumps(out))
"""


def _vllm_only_images() -> dict[str, bytes]:
    """Kinds beside the valid images that vLLM's loader converts: WebP with alpha, an RGB PNG with a
    transparent colour (tRNS), a GIF with a transparent index."""
    from PIL import Image

    rgba = Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 52, 4), dtype=np.uint8), "RGBA")
    rgb = data.textured_rgb(48, 40, seed=4)
    return {"rgba.webp": data.encode(rgba, "WEBP"), "rgba.webp.lossless": data.encode(rgba, "WEBP", lossless=True),
            "trns.png": data.encode(rgb, "PNG", transparency=(0, 0, 0)),
            "transparent.gif": data.encode(rgb.convert("P"), "GIF", transparency=0)}


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_keys_are_vllms_own_for_every_image_kind(tmp_path, version):
    """VllmKeys.image against vLLM's own MultiModalHasher.hash_kwargs(algorithm, model_id=..., image=ImageMediaIO()
    .load_bytes(bytes)), for every algorithm, on photographs and every container and mode the service takes
    (JPEG, PNG with and without alpha, WebP lossy, lossless and with alpha, GIF, palette, grey, CMYK, ...)."""
    env = vllm_env(version)
    blobs = {**data.valid_images(), **_vllm_only_images()}
    folder = tmp_path / "images"
    folder.mkdir()
    for name, blob in blobs.items():
        (folder / name).write_bytes(blob)
    model = "Qwen/Qwen3-VL-4B-Instruct"
    done = subprocess.run([sys.executable, "-c", _VLLM_KEYS, str(folder), model], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("@@"))[2:])
    failed = {name: why for name, why in theirs.items() if isinstance(why, str)}
    assert set(failed) <= {"float.tiff", "int32.tiff", "i16.png", "lab.tiff"}, failed  # (vLLM's loader refuses)
    converted = set()
    for name, keys in theirs.items():
        if name in failed:
            continue
        header = read_header(blobs[name], ImageLimits())
        assert header.plain_rgb is not None, name
        if not header.plain_rgb:
            converted.add(name)
        for algorithm, key in keys.items():
            assert VllmKeys(model, algorithm).image(blobs[name], converted=not header.plain_rgb) == key, (name, algorithm)
    # Both of vLLM's forms were met: the bytes alone, and the bytes with the io_config of a converted image.
    assert {"rgba.png", "rgba.webp", "trns.png", "transparent.gif", "cmyk.jpg", "gray.png"} <= converted
    assert {"rocket.jpg", "astronaut.png", "noise.webp.lossy"}.isdisjoint(converted)


def test_vllm_keys_take_the_model_and_the_algorithm_and_refuse_others():
    blob = data.photo("rocket.jpg")
    keys = {VllmKeys(m, a).image(blob, converted=False) for m in ("a", "b") for a in ("blake3", "sha256", "sha512")}
    assert len(keys) == 6 and all(is_store_key(k) for k in keys)
    assert len(VllmKeys("a", "sha512").image(blob, False)) == 128 and len(VllmKeys("a").image(blob, False)) == 64
    assert VllmKeys("a").image(blob, False) != VllmKeys("a").image(blob, True)
    with pytest.raises(ValueError, match="blake3, sha256, sha512"):
        VllmKeys("a", "md5")

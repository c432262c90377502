"""Store keys (service/store/keys.py): what a key may be, content keys and their salts, the shard of a key."""

import hashlib
import subprocess
import sys

from service.errors import RequestError
from service.media.params import PreprocessParams, VideoParams
from service.store.keys import (CONTENT_KEY_PREFIX, content_key, is_store_key, key_salt, shard_of, validate_key,
                                video_salt)
from tests.support.errors import raises_code


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

"""Tests for service/store/format.py, the store's format as a consumer reads it: read_embeddings (bit-exact
round trip, split order, malformed files) and key validation. The files are written by the real writer
(service/store/directory.py, tested in tests/unit/store/test_directory.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from service.errors import RequestError
from service.store.format import StoredItem
from service.store.format import (FILE_NAME, StoreFormatError, open_entry, read_ec_cache, read_embeddings, read_entry_data,
                                  read_open_ec_cache)
from service.store.keys import validate_key
from tests.support.storedata import MODEL, D, L, W, ec_for, files_under, make_store, parts_for
from tests.support.errors import raises_code


# ---- reading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_mmap", [False, True], ids=["copy", "mmap"])
@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_roundtrip_bit_exact_and_split_order(tmp_path, dtype, name, use_mmap):
    store = make_store(tmp_path / "s", dtype=name)
    parts = parts_for(7, 5, dtype)
    ec = torch.cat(parts, dim=1).contiguous()
    item = store.put("img-1", ec, (1, 4, 5))

    assert item == StoredItem(
        key="img-1", path=f"img-1/{FILE_NAME}", num_tokens=5, grid_thw=(1, 4, 5),
        shape=(5, W), dtype=name, nbytes=(tmp_path / "s" / "img-1" / FILE_NAME).stat().st_size,
    )
    got = read_embeddings(tmp_path / "s", "img-1", mmap=use_mmap)
    assert got.main.dtype == dtype and got.main.shape == (5, D)
    assert len(got.deepstack) == L
    # bit-exact, and in order: main first, then each tap (the +100*i offsets make a swap visible)
    for out, ref in zip([got.main, *got.deepstack], parts):
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert got.grid_thw == (1, 4, 5)
    meta = got.metadata
    assert meta["format_version"] == "1" and meta["model"] == MODEL
    assert meta["out_hidden_size"] == str(D) and meta["deepstack_levels"] == str(L)
    assert json.loads(meta["grid_thw"]) == [1, 4, 5] and meta["num_tokens"] == "5"

    # what vLLM's ECExampleConnector does: load_file(...)["ec_cache"]
    ref = load_file(str(tmp_path / "s" / item.path))
    assert list(ref) == ["ec_cache"] and ref["ec_cache"].dtype == dtype
    assert torch.equal(ref["ec_cache"], ec)
    assert store.lookup("img-1") == item
    # the result outlives the file (an eviction after the read), and writing to it never touches the store
    (tmp_path / "s" / item.path).unlink()
    got.main.add_(1)
    assert torch.equal(got.deepstack[0], parts[1]) and torch.equal(got.main, parts[0] + 1)
    store.put("img-1", ec, (1, 4, 5))
    # readable by others: the consumer may run as another user
    assert (tmp_path / "s" / item.path).stat().st_mode & 0o777 == 0o644


def test_the_whole_tensor_by_key_and_from_an_open_entry_after_its_eviction(tmp_path):
    """read_ec_cache: the unsplit tensor, as vLLM's encoder cache holds it. read_open_ec_cache: an entry
    held open (the vLLM connector's hold) reads whole after the writer replaced it and it was evicted."""
    root = tmp_path / "s"
    store = make_store(root, dtype="bfloat16")
    first, second = ec_for(3, 6, torch.bfloat16), ec_for(4, 6, torch.bfloat16)
    store.put("img-1", first, (1, 4, 6))
    got = read_ec_cache(root, "img-1")
    assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), first.view(torch.int16))
    with pytest.raises(KeyError):
        read_ec_cache(root, "absent")
    with pytest.raises(KeyError):
        open_entry(root, "absent")

    fd, where = open_entry(root, "img-1")
    try:
        store.put("img-1", second, (1, 4, 6))  # replaced (renamed over the held file) ...
        assert torch.equal(read_ec_cache(root, "img-1").view(torch.int16), second.view(torch.int16))
        (root / "img-1" / FILE_NAME).unlink()  # ... and evicted
        for _ in range(2):  # (each read starts at the file's start, whatever the handle's position)
            held = read_open_ec_cache(fd, where)
            assert torch.equal(held.view(torch.int16), first.view(torch.int16))
    finally:
        os.close(fd)
    assert where == str(root / "img-1" / FILE_NAME)


def test_the_raw_rows_of_an_answered_entry_and_nothing_else(tmp_path):
    """read_entry_data: the tensor's bytes without torch (a process that passes them on: SGLang's pushes),
    only while the file is the entry the answer named."""
    root = tmp_path / "s"
    store = make_store(root, dtype="bfloat16")
    ec = ec_for(5, 6, torch.bfloat16)
    item = store.put("img-2", ec, (1, 4, 6), content_sha256="ef" * 32)
    assert read_entry_data(root, item) == ec.view(torch.uint8).numpy().tobytes()
    store.put("img-2", ec_for(6, 4, torch.bfloat16), (1, 4, 4), content_sha256="ef" * 32)  # replaced since
    with pytest.raises(StoreFormatError, match="not the one answered"):
        read_entry_data(root, item)
    with pytest.raises(KeyError):
        read_entry_data(root, dataclasses.replace(item, key="absent"))


def test_read_rejects_malformed_files(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    store.put("a", ec_for(1, 6), (1, 4, 6))
    path = root / "a" / FILE_NAME
    whole = path.read_bytes()

    path.write_bytes(whole[:-3])  # truncated data
    with pytest.raises(StoreFormatError, match="bytes, header says"):
        read_embeddings(root, "a")
    path.write_bytes(whole[:5])  # not even a length prefix
    with pytest.raises(StoreFormatError, match="only 5 bytes"):
        read_embeddings(root, "a")
    path.write_bytes((10**12).to_bytes(8, "little") + whole[8:])  # absurd header length
    with pytest.raises(StoreFormatError, match="impossible"):
        read_embeddings(root, "a")
    path.write_bytes(b"garbage!" * 40)
    with pytest.raises(StoreFormatError):
        read_embeddings(root, "a")
    with pytest.raises(KeyError):
        read_embeddings(root, "never-written")


# ---- keys ------------------------------------------------------------------------------------------
def test_content_keys_are_store_keys_but_never_client_keys(tmp_path):
    content = "sha256+" + "ab" * 32
    assert validate_key(content) == content  # the store holds and serves them
    with raises_code(RequestError, "invalid_key"):
        validate_key(content, content_keys=False)  # a client uuid cannot be one
    for bad in ("sha256+" + "ab" * 31, "sha256+" + "AB" * 32, "sha256-" + "ab" * 32 + "/", "md5+" + "ab" * 16):
        with raises_code(RequestError, "invalid_key"):
            validate_key(bad)
    store = make_store(tmp_path / "s")
    item = store.put(content, ec_for(1, 4), (1, 2, 8), content_sha256="cd" * 32)
    assert item.content_sha256 == "cd" * 32 and read_embeddings(tmp_path / "s", content).metadata["content_sha256"] == "cd" * 32
    again = make_store(tmp_path / "s")  # the index is rebuilt from disk with the hash
    assert again.lookup(content).content_sha256 == "cd" * 32


BAD_KEYS = ["../x", "/abs", "", "a" * 129, ".hidden", "a/b", "a\x00b", "ключ", "é", ".", "..",
            "abc\n", "a b", "a\\b", "~x", None, 12]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_invalid_keys_rejected_and_nothing_created(tmp_path, key):
    root = tmp_path / "s"
    store = make_store(root)
    store.put("ok", ec_for(1, 4), (1, 2, 8))
    before = files_under(tmp_path)
    with raises_code(RequestError, "invalid_key", match="invalid key"):
        validate_key(key)
    with raises_code(RequestError, "invalid_key"):
        store.put(key, ec_for(2, 4), (1, 2, 8))
    with raises_code(RequestError, "invalid_key"):
        store.lookup(key)
    with raises_code(RequestError, "invalid_key"):
        read_embeddings(root, key)
    assert files_under(tmp_path) == before and len(store) == 1


def test_valid_keys(tmp_path):
    for key in ["a", "A-b_c.d", "_x", "-x", "0" * 128, "f" * 64, "x..y"]:
        assert validate_key(key) == key
    store = make_store(tmp_path / "s")
    store.put("x..y", ec_for(1, 4), (1, 2, 8))
    assert (tmp_path / "s" / "x..y" / FILE_NAME).exists()


def test_symlinked_key_dir_outside_root_is_refused(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    (tmp_path / "elsewhere").mkdir()
    (root / "evil").symlink_to(tmp_path / "elsewhere")
    with raises_code(RequestError, "invalid_key", match="outside the store root"):
        store.put("evil", ec_for(1, 4), (1, 2, 8))
    with raises_code(RequestError, "invalid_key", match="outside the store root"):
        read_embeddings(root, "evil")
    assert list((tmp_path / "elsewhere").iterdir()) == []

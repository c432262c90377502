"""Tests for service/store/directory.py, the store's writer: put and reserve, byte identity with safetensors, atomicity,
LRU capacity, concurrency, restart, shards. The format's tests (reading, keys) are in tests/unit/store/test_format.py."""

from __future__ import annotations

import json
import os
import stat
import random
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

import service.store.files as files_mod
import service.store.format as format_mod
from service.errors import StoreOwnershipError, Unavailable
from service.store import lock_root
from service.store.directory import DirectoryStore
from service.store.keys import shard_of
from service.store.format import FILE_NAME, read_embeddings, tensor_bytes
from tests.support.storedata import MODEL, D, W, ec_for, files_under, make_store, parts_for
from tests.support.errors import raises_code

def item_nbytes(store: DirectoryStore, n: int) -> int:
    """File size of one n-token float32 item with a one-digit grid, measured by writing one."""
    probe = make_store(store.root.parent / "probe")
    return probe.put("probe", ec_for(0, n), (1, 2, 2 * n)).nbytes


def tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp*")]


# ---- put and reserve -------------------------------------------------------------------------------
def test_put_accepts_row_slice_of_a_larger_buffer(tmp_path):
    # the engine hands the store row slices of one persistent host output buffer
    buf = ec_for(5, 12)
    store = make_store(tmp_path / "s")
    store.put("a", buf[3:7], (1, 4, 4))
    got = read_embeddings(tmp_path / "s", "a")
    assert torch.equal(torch.cat([got.main, *got.deepstack], dim=1), buf[3:7])


def test_put_rejects_wrong_tensors(tmp_path):
    store = make_store(tmp_path / "s")
    with pytest.raises(ValueError, match="ec_cache must be"):
        store.put("a", torch.zeros(4, W + 1), (1, 2, 8))
    with pytest.raises(ValueError, match="dtype"):
        store.put("a", torch.zeros(4, W, dtype=torch.float16), (1, 2, 8))
    with pytest.raises(ValueError, match="contiguous"):
        store.put("a", torch.zeros(W, 4).t(), (1, 2, 8))
    with pytest.raises(ValueError, match="grid_thw"):
        store.put("a", torch.zeros(4, W), (1, 0, 8))
    assert len(store) == 0 and files_under(tmp_path / "s") == set()


def test_reserve_allocates_the_file_before_the_data_exists_then_commit_or_abort(tmp_path):
    # The engine reserves while the GPU computes (allocating tmpfs pages is most of a write's cost).
    store = make_store(tmp_path / "s")
    ec = ec_for(6, 3)
    r = store.reserve("a", tuple(ec.shape), ec.dtype, (1, 4, 6), content_sha256="ab" * 32)
    (tmp,) = tmp_files(tmp_path / "s")
    assert tmp.stat().st_size == len(r.header) + ec.numel() * ec.element_size()  # pre-allocated, full size
    assert store.lookup("a") is None and len(store) == 0  # nothing visible before the commit
    item = store.commit(r, ec)
    assert tmp_files(tmp_path / "s") == [] and not tmp.exists()  # renamed onto the final name
    assert item.nbytes == (tmp_path / "s" / "a" / FILE_NAME).stat().st_size == len(r.header) + ec.numel() * 4
    got = read_embeddings(tmp_path / "s", "a")
    assert torch.equal(torch.cat([got.main, *got.deepstack], dim=1), ec)
    assert got.metadata["content_sha256"] == "ab" * 32 and store.lookup("a") == item

    r2 = store.reserve("b", tuple(ec.shape), ec.dtype, (1, 4, 6))
    store.abort(r2)
    assert tmp_files(tmp_path / "s") == [] and not (tmp_path / "s" / "b").exists() and len(store) == 1
    # A commit of other rows than reserved fails and leaves nothing behind; the old entry is untouched.
    r3 = store.reserve("a", tuple(ec.shape), ec.dtype, (1, 4, 6))
    with pytest.raises(ValueError, match="reserved"):
        store.commit(r3, ec_for(5, 9))
    assert tmp_files(tmp_path / "s") == [] and store.lookup("a") == item
    with pytest.raises(ValueError, match="ec_cache must be"):
        store.reserve("c", (4, W + 1), torch.float32, (1, 2, 8))
    assert tmp_files(tmp_path / "s") == [] and not (tmp_path / "s" / "c").exists()


def test_a_mapped_reservation_writes_the_same_bytes_as_writev_and_unmaps(tmp_path):
    # A lone image's entry is reserved mapped (Writer): its commit is a memmove into the mapped file.
    ec = ec_for(7, 5)
    plain, mapped = make_store(tmp_path / "plain"), make_store(tmp_path / "mapped")
    plain.put("a", ec, (1, 2, 10), content_sha256="cd" * 32)
    r = mapped.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 10), content_sha256="cd" * 32, lone=True)
    assert r.mapping is not None and len(r.mapping) == (tmp_files(tmp_path / "mapped")[0]).stat().st_size
    item = mapped.commit(r, ec)
    assert r.mapping is None and tmp_files(tmp_path / "mapped") == []  # unmapped, renamed onto the final name
    assert (tmp_path / "mapped" / "a" / FILE_NAME).read_bytes() == (tmp_path / "plain" / "a" / FILE_NAME).read_bytes()
    assert stat.S_IMODE((tmp_path / "mapped" / "a" / FILE_NAME).stat().st_mode) == mapped.file_mode
    assert item.nbytes == len(r.header) + ec.numel() * 4 and mapped.lookup("a") == item
    # A bf16 row slice of a larger buffer (the engine's pinned output), as the writer hands it over.
    buf = ec_for(8, 9, torch.bfloat16)
    r = mapped.reserve("b", (4, W), torch.bfloat16, (1, 2, 8), lone=True)
    mapped.commit(r, buf[2:6])
    assert torch.equal(torch.cat([(got := read_embeddings(tmp_path / "mapped", "b")).main, *got.deepstack], 1), buf[2:6])
    # Aborted: unmapped and removed.
    r = mapped.reserve("c", tuple(ec.shape), ec.dtype, (1, 2, 10), lone=True)
    mapped.abort(r)
    assert r.mapping is None and tmp_files(tmp_path / "mapped") == [] and not (tmp_path / "mapped" / "c").exists()




def test_a_reservation_is_not_mapped_with_fsync_or_where_the_file_could_not_be_allocated(tmp_path, monkeypatch):
    ec = ec_for(9, 3)
    durable = make_store(tmp_path / "durable", fsync=True)
    r = durable.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 6), lone=True)
    assert r.mapping is None  # (a mapping would need an msync: writev then fsync, as always)
    durable.commit(r, ec)
    monkeypatch.setattr(files_mod.os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
        OSError(files_mod.errno.EOPNOTSUPP, "not supported")))
    store = make_store(tmp_path / "s")
    r = store.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 6), lone=True)
    assert r.mapping is None  # the file is still empty: a write through a mapping would fault past its end
    store.commit(r, ec)
    for root in (tmp_path / "durable", tmp_path / "s"):
        got = read_embeddings(root, "a")
        assert torch.equal(torch.cat([got.main, *got.deepstack], 1), ec)


def test_commit_answers_once_the_entry_is_published_and_before_its_evictions_are_unlinked(tmp_path):
    ec = ec_for(1, 4)
    size = item_nbytes(make_store(tmp_path / "x"), 4)
    store = make_store(tmp_path / "s", capacity=size)  # room for one entry: each commit evicts the last one
    store.put("old", ec, (1, 2, 8))
    seen = {}

    def answer(item):
        seen["item"] = item
        seen["lookup"] = store.lookup("new")
        seen["files"] = sorted(str(p.relative_to(tmp_path / "s")) for p in (tmp_path / "s").rglob("*") if p.is_file())

    r = store.reserve("new", tuple(ec.shape), ec.dtype, (1, 2, 8), lone=True)
    item = store.commit(r, ec, answer=answer)
    assert seen["item"] == item == seen["lookup"]  # published when answered
    assert r.mapping is None
    # When answered, "old" was out of the index and renamed aside but not yet unlinked; after the commit it is gone.
    assert store.lookup("old") is None and f"new/{FILE_NAME}" in seen["files"] and len(seen["files"]) == 2
    assert [p for p in (tmp_path / "s").rglob("*") if p.is_file()] == [tmp_path / "s" / "new" / FILE_NAME]


def spares(root: Path) -> list[Path]:
    return sorted(root.glob(f"{files_mod.SPARE_PREFIX}*"))


def test_a_spare_file_is_taken_by_the_next_mapped_reservation_of_its_size(tmp_path):
    # A lone image's next file is made ahead (Writer, after answering one): its reservation is then no
    # create, allocate or map, and the entry it becomes is byte for byte a writev entry.
    ec, other = ec_for(7, 5), ec_for(8, 5)
    plain, store = make_store(tmp_path / "plain"), make_store(tmp_path / "s")
    plain.put("b", other, (1, 2, 10), content_sha256="ef" * 32)
    first = store.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 10), content_sha256="cd" * 32, lone=True)
    assert spares(tmp_path / "s") == []
    store.commit(first, ec)
    assert store.prepare_next(first) is True and store.prepare_next(first) is True  # (one spare, kept)
    (spare,) = spares(tmp_path / "s")
    assert spare.name.startswith(".spare-0-") and spare.stat().st_size == files_mod.SPARE_ROUND  # rounded up
    os.utime(spare, (1, 1))  # made long ago
    r = store.reserve("b", tuple(other.shape), other.dtype, (1, 2, 10), content_sha256="ef" * 32, lone=True)
    assert r.tmp == spare and r.mapping is not None and spares(tmp_path / "s") == [spare]  # taken, not yet renamed
    assert not (tmp_path / "s" / "b").exists()  # the key's directory is made at commit
    item = store.commit(r, other)
    assert spares(tmp_path / "s") == [] and r.mapping is None and tmp_files(tmp_path / "s") == []
    final = tmp_path / "s" / "b" / FILE_NAME
    assert final.read_bytes() == (tmp_path / "plain" / "b" / FILE_NAME).read_bytes()  # trimmed to its size
    assert item.nbytes == final.stat().st_size == r.nbytes and store.lookup("b") == item
    assert final.stat().st_mtime > time.time() - 60  # written now, for start-up's LRU order
    assert stat.S_IMODE(final.stat().st_mode) == store.file_mode
    assert store.bytes_used == 2 * item.nbytes  # the spare was never counted; its entry is, once
    # Another size neither takes it nor loses it; a spare of the new size replaces it.
    assert store.prepare_next(r) is True
    (spare,) = spares(tmp_path / "s")
    big = store.reserve("c", (2000, W), torch.float32, (1, 2, 4000), lone=True)  # 2000 * W * 4 bytes of rows
    assert big.tmp.parent == tmp_path / "s" / "c" and spares(tmp_path / "s") == [spare]
    store.commit(big, ec_for(9, 2000))
    assert store.prepare_next(big) is True
    (bigger,) = spares(tmp_path / "s")
    rounds = -(-big.nbytes // files_mod.SPARE_ROUND)
    assert rounds > 1 and bigger != spare and bigger.stat().st_size == rounds * files_mod.SPARE_ROUND
    # A reservation that is not mapped (a step's entries) does not take it; an aborted spare is removed.
    assert store.reserve("d", (2000, W), torch.float32, (1, 2, 4000)).tmp.parent == tmp_path / "s" / "d"
    r = store.reserve("e", (2000, W), torch.float32, (1, 2, 4000), lone=True)
    assert r.tmp == bigger
    store.abort(r)
    assert spares(tmp_path / "s") == [] and not (tmp_path / "s" / "e").exists() and store.lookup("e") is None


def test_no_spare_with_fsync_or_beyond_its_bound_and_close_removes_it(tmp_path, monkeypatch):
    ec = ec_for(1, 4)
    durable = make_store(tmp_path / "durable", fsync=True)
    assert durable.prepare_next(durable.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 8))) is False
    assert spares(tmp_path / "durable") == []
    small = make_store(tmp_path / "small", capacity=7 * files_mod.SPARE_ROUND)  # an eighth: less than one round
    r = small.reserve("a", tuple(ec.shape), ec.dtype, (1, 2, 8))
    assert small.prepare_next(r) is False and spares(tmp_path / "small") == []
    store = make_store(tmp_path / "s")
    monkeypatch.setattr(files_mod.os, "posix_fallocate", lambda fd, off, n: (_ for _ in ()).throw(
        OSError(files_mod.errno.ENOSPC, "no space left")))
    assert store.prepare_next(r) is False and spares(tmp_path / "s") == []  # a full filesystem: none, no error
    monkeypatch.undo()
    assert store.prepare_next(r) is True and len(spares(tmp_path / "s")) == 1
    store.close()
    assert spares(tmp_path / "s") == []


def test_start_up_removes_its_own_shards_spare_and_leaves_the_others(tmp_path):
    root = tmp_path / "s"
    ec = ec_for(1, 4)
    store = make_store(root, shard=(0, 2))
    key = next(k for k in (f"k{i}" for i in range(100)) if shard_of(k, 2) == 0)
    assert store.prepare_next(store.reserve(key, tuple(ec.shape), ec.dtype, (1, 2, 8))) is True
    (mine,) = spares(root)
    theirs = root / f"{files_mod.SPARE_PREFIX}1-0123456789abcdef"
    theirs.write_bytes(b"x" * 10)
    make_store(root, shard=(0, 2))  # the first one crashed: its spare is stale
    assert spares(root) == [theirs]
    make_store(root, shard=(1, 2))
    assert spares(root) == []


# ---- byte identity with safetensors ---------------------------------------------------------------
# NOTE: safetensors 0.8 writes the __metadata__ entries in Rust HashMap order, randomized per call, so
# its own output is not reproducible; our writer uses the metadata dict's order. Byte identity is
# checked (a) for any metadata by encoding it in the order safetensors chose, and (b) for put's own
# files by calling safetensors until it happens to choose our order (~1 in 6! = 720 calls).

def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def st_header(data: bytes) -> tuple[int, dict]:
    """(header length, header dict in the file's key order) of safetensors bytes."""
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def our_bytes(t: torch.Tensor, metadata: dict[str, str], path: Path) -> bytes:
    """What the store's writer produces for `t` (through the real file write)."""
    code = {torch.float32: "F32", torch.bfloat16: "BF16"}[t.dtype]
    header = format_mod._encode_header(code, tuple(t.shape), t.numel() * t.element_size(), metadata)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        nbytes = files_mod.write_ec_file(fd, header, t, fsync=False)
    finally:
        os.close(fd)
    assert path.stat().st_mode & 0o777 == 0o644
    data = path.read_bytes()
    assert nbytes == len(data)
    return data


def tensor_cases(dtype):
    big = torch.randn(20, 5 * W, generator=torch.Generator().manual_seed(3)).to(dtype)
    return {
        "1x1": torch.tensor([[1.5]], dtype=dtype),
        "3x5": torch.randn(3, 5).to(dtype),  # odd byte count in bf16: padding is only before the data
        "0x8": torch.empty(0, 8, dtype=dtype),
        "2x3x4": torch.randn(2, 3, 4).to(dtype),
        "rows 3:10 of 20": big[3:10],  # a row slice of a bigger buffer (storage offset != 0)
        "196x10240": torch.randn(196, 10240).to(dtype),  # the real size, 4 MB in bf16
    }


METADATA_CASES = {
    "put": {"format_version": "1", "model": "qwen3-vl-4b", "out_hidden_size": "2560", "deepstack_levels": "3",
            "grid_thw": "[1, 28, 28]", "num_tokens": "196"},
    "one": {"model": "a"},
    "empty": {},
    "escapes": {"model": "/ckpt/Модель é ☃ \U0001F600 \u2028 \x7f \"q\" \\ </", "ctl": "".join(map(chr, range(32)))},
}


@pytest.mark.parametrize("meta_name", list(METADATA_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_writer_bytes_identical_to_safetensors(tmp_path, dtype, meta_name):
    metadata = METADATA_CASES[meta_name]
    for name, t in tensor_cases(dtype).items():
        ref = save({"ec_cache": t}, metadata=metadata)
        _, ref_header = st_header(ref)
        in_ref_order = ref_header["__metadata__"]  # json.loads keeps the file's order
        assert in_ref_order == metadata
        ours = our_bytes(t, in_ref_order, tmp_path / f"{name}.safetensors")
        assert ours == ref, f"{name}: {ours[:200]!r} != {ref[:200]!r}"
        loaded = load_file(tmp_path / f"{name}.safetensors")
        assert list(loaded) == ["ec_cache"] and loaded["ec_cache"].dtype == dtype
        assert torch.equal(as_bits(loaded["ec_cache"]), as_bits(t))
        # and in the caller's order (what put does): same length, same bytes apart from the entry order
        ours = our_bytes(t, metadata, tmp_path / f"{name}.2.safetensors")
        assert len(ours) == len(ref) and ours[:8] == ref[:8] and st_header(ours) == st_header(ref)


@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_put_file_is_byte_identical_to_safetensors_save(tmp_path, dtype, name):
    root = tmp_path / "s"
    store = make_store(root, dtype=name)
    big = ec_for(9, 20, dtype)
    cases = {"one row": ec_for(1, 1, dtype), "5 rows": ec_for(2, 5, dtype), "rows 3:10 of 20": big[3:10],
             "last row of 20": big[19:]}
    for i, (case, t) in enumerate(cases.items()):
        item = store.put(f"k{i}", t, (1, 2, 2 * t.shape[0]))
        got = (root / item.path).read_bytes()
        assert item.nbytes == len(got)
        _, header = st_header(got)
        metadata = header["__metadata__"]
        assert list(metadata) == ["format_version", "model", "out_hidden_size", "deepstack_levels", "grid_thw",
                                  "num_tokens"]
        for _ in range(50_000):  # until safetensors' random metadata order is ours (p = 1/720 per call)
            ref = save({"ec_cache": t}, metadata=metadata)
            if ref == got:
                break
            assert len(ref) == len(got) and st_header(ref) == st_header(got), case
        else:
            pytest.fail(f"{case}: no safetensors.save output equals the put's file")
        loaded = load_file(root / item.path)["ec_cache"]
        assert loaded.dtype == dtype and torch.equal(as_bits(loaded), as_bits(t)), case


def test_tensor_bytes_is_a_zero_copy_view():
    buf = torch.zeros(4, 6, dtype=torch.bfloat16)  # like the engine's host buffer; put gets row slices
    mv = tensor_bytes(buf[1:3])
    assert mv.format == "B" and len(mv) == 2 * 6 * 2
    mv[2:4] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert buf[1, 1] == 1.5 and int(buf.ne(0).sum()) == 1  # the same memory, at the slice's offset
    assert len(tensor_bytes(buf[2:2])) == 0


def test_put_file_mode_and_fsync(tmp_path):
    store = make_store(tmp_path / "s", fsync=True)
    old_umask = os.umask(0o077)  # the file is 0644 whatever the writer's umask
    try:
        item = store.put("a", ec_for(1, 4), (1, 2, 8))
    finally:
        os.umask(old_umask)
    path = tmp_path / "s" / item.path
    assert path.stat().st_mode & 0o777 == 0o644
    assert torch.equal(load_file(path)["ec_cache"], ec_for(1, 4)) and tmp_files(tmp_path) == []


def test_real_size_bf16_puts_read_back_bit_exact_while_evicting(tmp_path):
    """Real-size items (196 tokens x 2560 x (1 + 3 deepstack) bf16 = 4 MB), put as row slices of one buffer
    as the engine hands them, into a store that holds 8: each put past the 8th evicts the oldest; what is
    resident reads back bit-exact (copied and mmapped) and what was evicted is gone from the disk.
    (bench/bench_store.py times these puts.)"""
    n, d, levels = 196, 2560, 3
    buf = torch.randn(8 * n, d * (1 + levels)).to(torch.bfloat16)
    one = DirectoryStore(tmp_path / "probe", 1 << 30, model_id=MODEL, out_hidden_size=d, deepstack_levels=levels,
                         dtype="bfloat16").put("probe", buf[:n], (1, 14, 14)).nbytes
    root = tmp_path / "s"
    store = DirectoryStore(root, 8 * one, model_id=MODEL, out_hidden_size=d, deepstack_levels=levels, dtype="bfloat16")
    rows = {}
    for i in range(20):
        rows[f"k{i}"] = buf[(i % 8) * n:(i % 8 + 1) * n]
        item = store.put(f"k{i}", rows[f"k{i}"], (1, 14, 14))
        assert item.nbytes == one == (root / item.path).stat().st_size
    assert store.lru_keys() == [f"k{i}" for i in range(12, 20)] and store.evictions == 12
    assert sorted(p.parent.name for p in root.glob(f"*/{FILE_NAME}")) == sorted(store.lru_keys())
    for key in store.lru_keys():
        for use_mmap in (False, True):
            got = read_embeddings(root, key, mmap=use_mmap)
            assert got.main.dtype == torch.bfloat16 and got.grid_thw == (1, 14, 14)
            assert torch.equal(torch.cat([got.main, *got.deepstack], dim=1), rows[key]), (key, use_mmap)


# ---- atomicity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["allocate", "write_ec_file", "write_all"])
def test_failed_write_leaves_nothing_visible(tmp_path, monkeypatch, where):
    root = tmp_path / "s"
    store = make_store(root)
    old = store.put("kept", ec_for(1, 4), (1, 4, 4))

    if where == "allocate":  # the device fails when the file is reserved (ENOSPC evicts: see below)
        def half_write(fd, size):
            os.write(fd, b"\x00" * 100)
            raise OSError(5, "Input/output error")
    elif where == "write_ec_file":  # the whole file write fails
        def half_write(fd, header, ec_cache, *, fsync, mode, mapping):
            os.write(fd, b"\x00" * 100)  # partial bytes, then the "disk" fails
            raise OSError(28, "No space left on device")
    else:  # the real writer (fchmod) runs, and its data write fails half way
        def half_write(fd, bufs):
            os.write(fd, b"\x00" * 100)
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_mod, where, half_write)
    msg = "Input/output error" if where == "allocate" else "No space"
    with pytest.raises(OSError, match=msg):
        store.put("new", ec_for(2, 4), (1, 4, 4))
    with pytest.raises(OSError, match=msg):
        store.put("kept", ec_for(3, 4), (1, 4, 4))  # overwrite of an existing key fails

    assert tmp_files(root) == []
    assert not (root / "new").exists()  # the key directory made for the failed put is gone too
    assert store.lookup("new") is None
    with pytest.raises(KeyError):
        read_embeddings(root, "new")
    # the previous version is untouched and still indexed
    assert store.lookup("kept") == old and len(store) == 1 and store.bytes_used == old.nbytes
    assert torch.equal(read_embeddings(root, "kept").main, parts_for(1, 4)[0])


def test_reader_sees_old_or_new_never_partial_during_overwrite(tmp_path):
    """Many overwrites of one key while a reader reads it: each read is one whole version."""
    root = tmp_path / "s"
    store = make_store(root)
    versions = {s: ec_for(s, 64) for s in range(4)}
    store.put("k", versions[0], (1, 16, 16))
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = 0

    def reader():
        nonlocal reads
        while not stop.is_set():
            try:
                got = read_embeddings(root, "k", mmap=reads % 2 == 1)
                full = torch.cat([got.main, *got.deepstack], dim=1)
                assert any(torch.equal(full, v) for v in versions.values()), "read a torn file"
                reads += 1
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)
                return

    t = threading.Thread(target=reader)
    t.start()
    for i in range(200):
        store.put("k", versions[i % 4], (1, 16, 16))
    stop.set()
    t.join()
    assert errors == [] and reads > 0
    assert tmp_files(root) == [] and len(store) == 1


# ---- capacity and LRU ------------------------------------------------------------------------------
def test_capacity_evicts_least_recently_used(tmp_path):
    root = tmp_path / "s"
    store = make_store(root, capacity=1)  # placeholder, replaced below once we know an item's size
    size = item_nbytes(store, 4)
    store = make_store(root, capacity=3 * size)

    for k in "abc":
        store.put(k, ec_for(ord(k), 4), (1, 2, 8))
    assert len(store) == 3 and store.bytes_used == 3 * size and store.evictions == 0
    assert store.lookup("a") is not None  # a becomes most recently used
    assert store.lru_keys() == ["b", "c", "a"]

    store.put("d", ec_for(ord("d"), 4), (1, 2, 8))
    assert store.evictions == 1 and store.lru_keys() == ["c", "a", "d"]
    assert store.lookup("b") is None and not (root / "b").exists()  # file and directory gone
    with pytest.raises(KeyError):
        read_embeddings(root, "b")
    assert store.bytes_used == 3 * size <= store.capacity_bytes

    # re-putting an existing key replaces it without double counting, and refreshes it
    store.put("c", ec_for(ord("c"), 4), (1, 2, 8))
    assert len(store) == 3 and store.bytes_used == 3 * size and store.lru_keys() == ["a", "d", "c"]
    assert sorted(p.name for p in root.iterdir()) == ["a", "c", "d"]


def test_an_evicted_file_is_freed_outside_the_lock_and_a_left_one_at_start(tmp_path, monkeypatch):
    """Freeing an evicted file's pages (an unlink) happens after the store's lock is released: other puts'
    commits wait for that lock. A file renamed aside but never unlinked (a crash) goes at the next start."""
    root = tmp_path / "s"
    size = item_nbytes(make_store(tmp_path / "x"), 4)
    store = make_store(root, capacity=2 * size)
    unlinked = []
    real = files_mod.unlink_quietly
    monkeypatch.setattr(files_mod, "unlink_quietly",
                        lambda path: unlinked.append((Path(path).name, store._lock.locked())) or real(path))
    for k in "abc":
        store.put(k, ec_for(ord(k), 4), (1, 2, 8))
    assert store.evictions == 1 and store.lru_keys() == ["b", "c"]
    assert [(name.startswith(format_mod.TMP_PREFIX + "evicted-"), locked) for name, locked in unlinked] == [(True, False)]
    assert sorted(p.name for p in root.iterdir()) == ["b", "c"]
    monkeypatch.setattr(files_mod, "unlink_quietly", real)

    (root / f"{format_mod.TMP_PREFIX}evicted-0123456789abcdef").write_bytes(b"x" * 100)  # left by a crash
    again = make_store(root, capacity=2 * size)
    assert again.lru_keys() == ["b", "c"] and sorted(p.name for p in root.iterdir()) == ["b", "c"]


def test_the_service_owns_its_root_private_checked_and_locked(tmp_path):
    root = tmp_path / "own"
    store = make_store(root, exclusive=True)
    item = store.put("a", ec_for(1, 4), (1, 2, 8))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.abspath(item)).st_mode) == 0o600
    with pytest.raises(StoreOwnershipError, match=rf"another service \(pid {os.getpid()}\) is writing"):
        make_store(root, exclusive=True)  # one writer per root
    assert make_store(root).lookup("a") is not None  # (a reader-only, non-exclusive handle is not refused)
    store.close()
    make_store(root, exclusive=True).close()  # released: the next service takes it

    planted = tmp_path / "planted"  # pre-created by someone else, world-writable, with an entry in it
    make_store(planted).put("victim", ec_for(2, 4), (1, 2, 8))
    os.chmod(planted, 0o777)
    with pytest.raises(StoreOwnershipError, match="writable by others .mode 0777.*chmod 700"):
        make_store(planted, exclusive=True)
    os.chmod(planted, 0o770)
    with pytest.raises(StoreOwnershipError, match="writable by its group"):
        make_store(planted, exclusive=True)
    # A sticky shared directory (as /dev/shm and /tmp are): never `chmod` it, take a folder inside it.
    os.chmod(planted, 0o1777)
    with pytest.raises(StoreOwnershipError, match="mode 1777") as e:
        make_store(planted, exclusive=True)
    assert "chmod" not in str(e.value) and f"--store {planted / 'qwen3vl-encoder-cache'}" in str(e.value)
    make_store(planted / "qwen3vl-encoder-cache", exclusive=True).close()  # which works
    if os.geteuid() == 0:  # only root can give a directory away
        os.chmod(planted, 0o700)
        os.chown(planted, 12345, -1)
        with pytest.raises(StoreOwnershipError, match="belongs to uid 12345"):
            make_store(planted, exclusive=True)


def test_a_root_that_is_a_symbolic_link_or_not_a_directory_is_refused_and_nothing_behind_it_is_touched(tmp_path):
    # Issue 23's finding: `ln -s victimdir /dev/shm/<the default store's name>` by another local user had
    # the service lock, evict (deleting victimdir/abc/.tmp-precious, removing abc/) and write in victimdir,
    # a private folder of the service's own user, which passed every ownership check through the link.
    victim = tmp_path / "victimdir"
    (victim / "abc").mkdir(parents=True, mode=0o700)
    os.chmod(victim, 0o700)
    (victim / "abc" / ".tmp-precious").write_bytes(b"precious")
    link = tmp_path / "store-root"
    link.symlink_to(victim)
    with pytest.raises(StoreOwnershipError, match=r"is a symbolic link \(to .*victimdir\)"):
        make_store(link, exclusive=True)
    assert sorted(p.name for p in victim.rglob("*")) == [".tmp-precious", "abc"]  # no .lock, nothing evicted
    assert (victim / "abc" / ".tmp-precious").read_bytes() == b"precious"
    not_dir = tmp_path / "a-file"
    not_dir.write_bytes(b"x")
    with pytest.raises(StoreOwnershipError, match="is not a directory"):
        make_store(not_dir, exclusive=True)


def test_a_reading_group_gets_0750_and_0640(tmp_path):
    import grp

    group = grp.getgrgid(os.getegid()).gr_name
    store = make_store(tmp_path / "g", exclusive=True, group=group)
    item = store.put("a", ec_for(1, 4), (1, 2, 8))
    st = os.stat(tmp_path / "g")
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == os.getegid()
    assert stat.S_IMODE(os.stat(store.abspath(item)).st_mode) == 0o640
    store.close()


def test_min_residency_protects_answered_entries_then_lru_resumes(tmp_path):
    class Clock:
        t = 1000.0

        def __call__(self):
            return self.t

    clock = Clock()
    root = tmp_path / "s"
    size = item_nbytes(make_store(tmp_path / "x"), 4)
    store = make_store(root, capacity=3 * size, min_residency_s=30, clock=clock)
    for k in "abc":
        store.put(k, ec_for(ord(k), 4), (1, 2, 8))
        clock.t += 10  # a at 1000, b at 1010, c at 1020: kept until 1030, 1040, 1050
    # t = 1030: a's window just ended, b's and c's not: d may evict a, and only a.
    store.put("d", ec_for(ord("d"), 4), (1, 2, 8))
    assert store.lru_keys() == ["b", "c", "d"] and store.evictions == 1
    # t = 1030: everything left is young: a put that needs an eviction is refused, nothing written.
    with raises_code(Unavailable, "store_full") as e:
        store.put("e", ec_for(ord("e"), 4), (1, 2, 8))
    assert e.value.retry_after_s == 10 and "store is full" in e.value.message  # b's window ends at 1040
    assert not (root / "e").exists() and store.lru_keys() == ["b", "c", "d"]
    # A hit renews the window: b answered at 1035 stays until 1065, so c (until 1050) goes first.
    clock.t = 1035
    assert store.lookup("b") is not None
    clock.t = 1055
    store.put("e", ec_for(ord("e"), 4), (1, 2, 8))
    assert store.lru_keys() == ["d", "b", "e"]
    assert read_embeddings(root, "b").main.shape == (4, D)
    # Re-putting a key that is itself young needs no room from others.
    store.put("e", ec_for(ord("e") + 1, 4), (1, 2, 8))
    assert store.lru_keys() == ["d", "b", "e"] and store.bytes_used == 3 * size


def test_oversize_item_is_kept_and_evicts_everything_else(tmp_path, caplog):
    root = tmp_path / "s"
    size = item_nbytes(make_store(tmp_path / "x"), 4)
    store = make_store(root, capacity=2 * size)
    store.put("a", ec_for(1, 4), (1, 2, 8))
    store.put("b", ec_for(2, 4), (1, 2, 8))

    with caplog.at_level("WARNING", logger="service.store.directory"):
        big = store.put("big", ec_for(3, 40), (1, 2, 80))
    assert "more than the whole capacity" in caplog.text
    assert big.nbytes > store.capacity_bytes
    assert store.lru_keys() == ["big"] and store.bytes_used == big.nbytes and store.evictions == 2
    assert store.lookup("big") == big
    assert torch.equal(read_embeddings(root, "big").main, parts_for(3, 40)[0])

    store.put("c", ec_for(4, 4), (1, 2, 8))  # the next put evicts the oversize one
    assert store.lru_keys() == ["c"] and store.bytes_used == size


def test_externally_deleted_file_is_a_miss(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    item = store.put("a", ec_for(1, 4), (1, 2, 8))
    (root / item.path).unlink()
    assert store.lookup("a") is None
    assert len(store) == 0 and store.bytes_used == 0


# ---- concurrency -----------------------------------------------------------------------------------
def test_eviction_while_readers_read(tmp_path):
    """Two writers put random keys out of 16 into a store that holds 6 (constant evictions, and puts
    of keys that the other writer is evicting) while 4 readers read random keys: a read is KeyError
    or exactly that key's tensor, never a torn one or another error."""
    root = tmp_path / "s"
    n_keys, tokens = 16, 16
    size = item_nbytes(make_store(tmp_path / "x"), tokens)
    store = make_store(root, capacity=6 * size)
    expected = {f"k{i}": ec_for(i, tokens) for i in range(n_keys)}
    stop = threading.Event()
    errors: list[BaseException] = []
    hits = misses = puts = 0
    count_lock = threading.Lock()

    def writer(seed: int):
        nonlocal puts
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                key = f"k{rng.randrange(n_keys)}"
                store.put(key, expected[key], (1, 4, 4 * tokens // 4))
                with count_lock:
                    puts += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def reader(seed: int):
        nonlocal hits, misses
        rng = random.Random(100 + seed)
        try:
            while not stop.is_set():
                key = f"k{rng.randrange(n_keys)}"
                try:
                    got = read_embeddings(root, key, mmap=rng.random() < 0.5)
                except KeyError:
                    with count_lock:
                        misses += 1
                    continue
                full = torch.cat([got.main, *got.deepstack], dim=1)
                assert torch.equal(full, expected[key]), f"wrong tensor for {key}"
                with count_lock:
                    hits += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def enough() -> bool:  # each race happened often enough (not a fixed time: a slow machine runs longer)
        return bool(errors) or (hits >= 100 and misses >= 100 and store.evictions >= 100)

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, so the interleavings the locks guard happen
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not enough() and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old_interval)

    assert errors == [], errors[:3]
    assert hits >= 100 and misses >= 100 and store.evictions >= 100, (hits, misses, store.evictions, puts)
    # the index and the disk agree, and no temp file or empty directory is left behind
    on_disk = {p.parent.name: p.stat().st_size for p in root.glob(f"*/{FILE_NAME}")}
    assert set(on_disk) == set(store.lru_keys())
    assert sum(on_disk.values()) == store.bytes_used <= store.capacity_bytes
    assert tmp_files(root) == []
    assert sorted(p.name for p in root.iterdir()) == sorted(on_disk)


def test_put_of_a_key_being_evicted_lands(tmp_path, monkeypatch):
    """Deterministic version of the race: key k is evicted while a new put of k is mid-write."""
    root = tmp_path / "s"
    size = item_nbytes(make_store(tmp_path / "x"), 4)
    store = make_store(root, capacity=2 * size)
    store.put("k", ec_for(1, 4), (1, 2, 8))  # old version of k, soon the LRU entry
    store.put("other", ec_for(2, 4), (1, 2, 8))

    writing, release = threading.Event(), threading.Event()
    real_write = files_mod.write_ec_file
    new_k = ec_for(3, 4)

    def slow_write(fd, header, ec_cache, **kw):
        if ec_cache is new_k:  # the put of k
            writing.set()
            assert release.wait(5)
        return real_write(fd, header, ec_cache, **kw)

    monkeypatch.setattr(files_mod, "write_ec_file", slow_write)
    result: list = []
    t = threading.Thread(target=lambda: result.append(store.put("k", new_k, (1, 2, 8))))
    t.start()
    assert writing.wait(5)
    store.put("evicts-k", ec_for(4, 4), (1, 2, 8))  # evicts the old k while the new k is being written
    assert "k" not in store.lru_keys() and store.evictions == 1
    release.set()
    t.join()

    assert store.lookup("k") == result[0]
    assert torch.equal(read_embeddings(root, "k").main, parts_for(3, 4)[0])
    on_disk = {p.parent.name for p in root.glob(f"*/{FILE_NAME}")}
    assert on_disk == set(store.lru_keys()) and tmp_files(root) == []


# ---- restart ---------------------------------------------------------------------------------------
def test_restart_rebuilds_index_in_mtime_order(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    items = {k: store.put(k, ec_for(i, 4 + i), (1, 2, 2 * (4 + i))) for i, k in enumerate("abcd")}
    # recency on disk: d oldest ... a newest (lookups touch mtime, so this is what a restart sees)
    for age, k in enumerate("dcba"):
        t = 1_700_000_000 + age
        os.utime(root / items[k].path, (t, t))
    # leftovers of a crash: temp files, an empty key directory; and things not ours
    (root / "a" / ".tmp-deadbeef").write_bytes(b"partial")
    (root / "b" / ".tmpXyZ123").write_bytes(b"partial")  # safetensors' own temp name (older writers)
    (root / ".tmp-cafe").write_bytes(b"partial")
    (root / "empty").mkdir()
    (root / "README").write_text("not a store entry")

    store2 = make_store(root)
    assert len(store2) == 4 and store2.bytes_used == sum(it.nbytes for it in items.values())
    assert store2.lru_keys() == ["d", "c", "b", "a"]
    for k, it in items.items():
        assert store2.lookup(k) == it
    assert tmp_files(root) == [] and not (root / "empty").exists()
    assert (root / "README").exists()

    # a smaller capacity at start evicts the oldest down to fit (lookups above refreshed a..d in order)
    keep = items["c"].nbytes + items["d"].nbytes
    store3 = make_store(root, capacity=keep)
    assert store3.lru_keys() == ["c", "d"] and store3.evictions == 2 and store3.bytes_used == keep
    assert not (root / "a").exists() and not (root / "b").exists()


def test_restart_lookup_refreshes_recency_persistently(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    for i, k in enumerate("abc"):
        it = store.put(k, ec_for(i, 4), (1, 2, 8))
        t = 1_700_000_000 + i
        os.utime(root / it.path, (t, t))
    store.lookup("a")
    assert make_store(root).lru_keys() == ["b", "c", "a"]


def test_other_model_is_indexed_but_not_a_hit(tmp_path):
    root = tmp_path / "s"
    store = make_store(root, model="model-A")
    a = store.put("shared", ec_for(1, 4), (1, 2, 8))
    store.put("only-a", ec_for(2, 4), (1, 2, 8))

    other = make_store(root, model="model-B")
    assert len(other) == 2 and other.bytes_used == 2 * a.nbytes  # counted against capacity
    assert other.lookup("shared") is None and other.lookup("only-a") is None
    # different deepstack layout or dtype of the same model name: not a hit either
    layout = DirectoryStore(root, 1 << 30, model_id="model-A", out_hidden_size=2 * D, deepstack_levels=1)
    assert layout.lookup("shared") is None
    assert make_store(root, model="model-A", dtype="bfloat16").lookup("shared") is None
    assert make_store(root, model="model-A", dtype="float32").lookup("shared") == a

    b = other.put("shared", ec_for(3, 4), (1, 2, 8))  # overwrite with this model's embeddings
    assert other.lookup("shared") == b and read_embeddings(root, "shared").metadata["model"] == "model-B"
    # the other model's entries are evictable like any other
    small = make_store(root, capacity=b.nbytes, model="model-B")
    assert small.lru_keys() == ["shared"] and not (root / "only-a").exists()


def test_malformed_file_at_start_is_counted_not_a_hit(tmp_path):
    root = tmp_path / "s"
    (root / "junk").mkdir(parents=True)
    (root / "junk" / FILE_NAME).write_bytes(b"not safetensors at all")
    store = make_store(root)
    assert len(store) == 1 and store.bytes_used == 22 and store.lookup("junk") is None


# ---- a filesystem smaller than the capacity -----------------------------------------------------------
def test_capacity_is_capped_to_what_the_filesystem_holds(tmp_path, monkeypatch, caplog):
    real = os.statvfs

    class Small:  # the root's filesystem with 10 MB free (as Docker's 64 MB /dev/shm, nearly full)
        f_bavail, f_frsize = 2560, 4096

    monkeypatch.setattr(files_mod.os, "statvfs", lambda p: Small if str(p).startswith(str(tmp_path)) else real(p))
    store = make_store(tmp_path / "s", capacity=1 << 30)
    assert store.capacity_bytes == int(10 * 1024 * 1024 * 0.95)
    assert "more than" in caplog.text and "--store-capacity-bytes" in caplog.text
    assert make_store(tmp_path / "t", capacity=1 << 20).capacity_bytes == 1 << 20  # fits: as asked


def test_enospc_evicts_and_retries_or_answers_store_full(tmp_path, monkeypatch):
    now = [0.0]
    store = make_store(tmp_path / "s", min_residency_s=10, clock=lambda: now[0])
    for k in ("a", "b"):
        store.put(k, ec_for(1, 4), (1, 4, 4))
    real, failures = files_mod.allocate, [0]

    def full_once(fd, size):  # the filesystem is full the first time, until something is freed
        if failures[0] == 0:
            failures[0] += 1
            raise OSError(28, "No space left on device")
        return real(fd, size)

    monkeypatch.setattr(files_mod, "allocate", full_once)
    # Both entries are young (answered under 10 s ago): nothing may be evicted, so 503 store_full.
    with raises_code(Unavailable, "store_full", match="filesystem") as exc:
        store.put("c", ec_for(2, 4), (1, 4, 4))
    assert exc.value.retry_after_s >= 1 and tmp_files(tmp_path / "s") == [] and store.unwritable is None
    now[0] = 60.0  # residency over: the LRU entry can make room
    failures[0] = 0
    item = store.put("c", ec_for(2, 4), (1, 4, 4))
    assert store.lookup("a") is None and store.lookup("b") is not None and store.lookup("c") == item
    assert store.evictions == 1 and store.unwritable is None


def test_a_store_that_cannot_be_written_says_why_until_a_write_succeeds(tmp_path, monkeypatch):
    store = make_store(tmp_path / "s")
    real = files_mod.allocate

    def read_only(fd, size):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(files_mod, "allocate", read_only)
    with pytest.raises(OSError, match="Read-only"):
        store.put("a", ec_for(1, 4), (1, 4, 4))
    assert "Read-only file system" in store.unwritable
    monkeypatch.setattr(files_mod, "allocate", real)
    store.put("a", ec_for(1, 4), (1, 4, 4))
    assert store.unwritable is None


# ---- shards (one engine per device) ----------------------------------------------------------------
def test_shard_of_is_stable_across_processes_and_spreads_keys():
    # Fixed values: every process (API and engine, any run) must route a key to the same shard.
    keys = ["a", "b", "img-1", "img-2", "sha256+" + "0" * 64]
    assert [shard_of(k, 2) for k in keys] == [0, 0, 0, 1, 1]
    assert [shard_of(k, 3) for k in keys] == [2, 2, 0, 2, 0]
    assert all(shard_of(k, 1) == 0 for k in keys)
    counts = [0] * 4
    for i in range(4000):
        counts[shard_of(f"k{i}", 4)] += 1
    assert all(900 <= c <= 1100 for c in counts), counts


def test_shards_index_write_and_lock_only_their_own_keys(tmp_path):
    root = tmp_path / "s"
    whole = make_store(root, exclusive=True)
    keys = [f"img-{i}" for i in range(12)]
    for i, k in enumerate(keys):
        whole.put(k, ec_for(i, 2), (1, 2, 4))
    whole.close()
    mine = {i: {k for k in keys if shard_of(k, 2) == i} for i in (0, 1)}
    assert mine[0] and mine[1]
    stale = root / sorted(mine[1])[0] / ".tmp-of-a-running-put"
    stale.write_bytes(b"x")

    # As a sharded service runs: the supervisor holds the root's lock, each engine its shard's.
    root_lock = lock_root(root, None)
    try:
        with pytest.raises(StoreOwnershipError, match="is writing to the store root"):
            make_store(root, exclusive=True)  # a second, one-engine service on the root: refused
        from service.errors import StartupError, Unavailable
        from service.procs.preflight import check_store

        with pytest.raises(StartupError, match="is writing to the store root"):
            check_store(root, None)  # what a second service's preflight runs: refused
        shard0 = make_store(root, exclusive=True, shard=(0, 2))
        assert set(shard0.lru_keys()) == mine[0]  # indexed: only its keys
        assert shard0.bytes_used == sum((root / k / FILE_NAME).stat().st_size for k in mine[0])
        assert stale.exists()  # another shard's directory: left alone
        with pytest.raises(StoreOwnershipError):
            make_store(root, exclusive=True, shard=(0, 2))  # one writer per shard
        shard1 = make_store(root, exclusive=True, shard=(1, 2))
        assert set(shard1.lru_keys()) == mine[1] and not stale.exists()  # its own stale temp file: removed
        with pytest.raises(AssertionError, match="routing bug"):
            shard0.put(sorted(mine[1])[0], ec_for(0, 2), (1, 2, 4))
        shard0.close()
        # A tiny capacity evicts only the shard's own keys; the others' files stay.
        shard0 = make_store(root, capacity=1, exclusive=True, shard=(0, 2))
        assert len(shard0) == 0 and not any((root / k).exists() for k in mine[0])
        assert all((root / k / FILE_NAME).exists() for k in mine[1])
        shard0.close()
        shard1.close()
    finally:
        root_lock.close()
    make_store(root, exclusive=True).close()  # all released: a one-engine service takes the root again


def test_a_video_entry_keeps_its_sampling_and_timestamps_through_the_reader_and_a_restart(tmp_path):
    from service.store.format import VideoMeta

    store = make_store(tmp_path / "s")
    video = VideoMeta(frames_indices=(0, 15, 30, 45), fps=29.97, timestamps=(0.25, 1.25))
    ec = ec_for(4, 2)
    item = store.put("v", ec, (2, 2, 4), content_sha256="cd" * 32, video=video)
    assert item.video == video and item.modality == "video" and item.grid_thw == (2, 2, 4)
    got = read_embeddings(tmp_path / "s", "v")
    assert got.modality == "video" and got.video == video and got.grid_thw == (2, 2, 4)
    assert got.metadata["frames_indices"] == "[0, 15, 30, 45]" and json.loads(got.metadata["timestamps"]) == [0.25, 1.25]
    image = store.put("i", ec, (1, 4, 4))
    assert image.video is None and image.modality == "image" and read_embeddings(tmp_path / "s", "i").video is None
    store.close()
    again = make_store(tmp_path / "s")
    assert again.lookup("v") == item and again.lookup("i") == image


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24683568k
31 27 0:40 / /mnt/huge rw,relatime - tmpfs tmpfs rw,size=41943040k,huge=within_size
32 31 0:41 / /mnt/huge/plain\\040dir rw,relatime - tmpfs tmpfs rw,size=1024k
33 27 8:1 / /srv rw,relatime - ext4 /dev/sda1 rw
34 25 0:42 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=1g,huge=always
"""


@pytest.mark.parametrize(("path", "shmem", "expected"), [
    ("/dev/shm/qwen3vl-encoder-cache", "always within_size advise [never] deny force", "always"),  # the top mount
    ("/mnt/huge/store", "", "within_size"),
    ("/mnt/huge/plain dir/store", "", "never"),  # a mount inside it, its name escaped in mountinfo
    ("/mnt/hugestore", "", None),  # not under /mnt/huge: on / (not listed: not a tmpfs)
    ("/srv/store", "", None),  # ext4
    ("/mnt/huge/plain dir", "always within_size advise never deny [force]", "force"),  # forced on every tmpfs
])
def test_tmpfs_huge_reads_the_mount_holding_the_path(path, shmem, expected):
    assert files_mod.tmpfs_huge(path, MOUNTINFO, shmem) == expected


def test_a_service_store_on_a_tmpfs_without_huge_pages_says_how_to_mount_it(tmp_path, monkeypatch, caplog):
    seen = []
    monkeypatch.setattr(files_mod, "tmpfs_huge", lambda path: seen.append(path) or "never")
    with caplog.at_level("INFO", logger="service.store.directory"):
        DirectoryStore(tmp_path / "a", 1 << 20, MODEL, D, 1, exclusive=True).close()
    assert "huge=within_size" in caplog.text and seen == [os.path.realpath(tmp_path / "a")]
    caplog.clear()
    monkeypatch.setattr(files_mod, "tmpfs_huge", lambda path: "within_size")
    with caplog.at_level("INFO", logger="service.store.directory"):
        DirectoryStore(tmp_path / "b", 1 << 20, MODEL, D, 1, exclusive=True).close()
    assert "huge" not in caplog.text


@pytest.mark.parametrize("writers", [1, 3, 4])
def test_a_steps_entries_are_shared_among_the_writer_threads_in_order(tmp_path, writers):
    """commit_step: a step's entries in `writers` contiguous shares, one written by the calling thread, the
    rest by the store's pool, each answered with its own index."""
    store = make_store(tmp_path / "s", writers=writers)
    seen: dict[int, str] = {}

    def commit(pending, rows, answer=None):
        seen[pending] = threading.current_thread().name
        time.sleep(0.001)  # long enough that the shares run at the same time, on different threads
        answer(pending * 10 + rows)

    store.commit = commit
    for n in (1, 2, 7, 64):
        answers: dict[int, int] = {}
        store.commit_step(list(range(n)), [1] * n, lambda i, item: answers.__setitem__(i, item))
        assert answers == {a: a * 10 + 1 for a in range(n)}
    # 64 entries: `writers` contiguous shares, one run by the calling thread, the rest by the pool.
    threads = [seen[a] for a in range(64)]
    assert len(set(threads)) == writers and threads[0] == threading.current_thread().name
    assert threads == sorted(threads, key=threads.index)  # each thread's share is one contiguous run
    store.close()


def test_a_failed_entry_of_a_step_answers_only_its_own_index(tmp_path):
    store = make_store(tmp_path / "s", writers=2)
    ecs = [ec_for(i, 4) for i in range(3)]
    pendings = [store.reserve(k, tuple(ec.shape), ec.dtype, (1, 2, 8)) for k, ec in zip("abc", ecs)]
    rows = [ecs[0], ecs[1][:, :-1].contiguous(), ecs[2]]  # b's rows do not match its reservation
    answers: dict[int, object] = {}
    store.commit_step(pendings, rows, lambda i, item: answers.__setitem__(i, item))
    assert answers[0].key == "a" and answers[2].key == "c" and isinstance(answers[1], ValueError)
    assert sorted(store.lru_keys()) == ["a", "c"] and tmp_files(tmp_path / "s") == []
    store.close()


def test_the_store_protocol_finds_at_once_reads_and_evicts(tmp_path):
    """What the engine uses of a store (service/store/base.py), on a directory: `find` is answered before it
    returns (the index is here), `known` is the same lookup, `evict` takes the entry and its file."""
    store = make_store(tmp_path / "s")
    ec = ec_for(5, 4)
    item = store.put("k", ec, (1, 2, 8), content_sha256="ab" * 32)
    found = store.find("k")
    assert found.done() and found.result() == item and store.known("k") == item
    assert store.find("nothing").result() is None
    bad = store.find("../escape")
    assert bad.done() and bad.exception().code == "invalid_key"
    got = store.read("k")
    assert torch.equal(torch.cat([got.main, *got.deepstack], 1), ec)
    assert store.stats().entries == 1 and store.stats().bytes_used == item.nbytes and store.health() is None
    assert store.evict("k") is True and store.evict("k") is False
    assert store.find("k").result() is None and not (tmp_path / "s" / "k").exists() and store.stats().bytes_used == 0
    with pytest.raises(KeyError):
        store.read("k")
    assert store.location == str(tmp_path / "s")
    store.close()

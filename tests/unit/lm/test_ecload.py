"""service/lm/ecload.py, what the vLLM connector does with the store, without vLLM: its options as vLLM's
ec_connector_extra_config gives them, and the directory's hold from vLLM's check to its load, loaded in
another process (vLLM's worker) after the writer evicted the entry. (vLLM's own calls drive it in
tests/unit/lm/test_vllm_connector.py.)"""

from __future__ import annotations

import logging
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.lm.ecload import DirectoryEntries, EntryOptions, Held
from service.store.format import FILE_NAME, read_ec_cache
from tests.support.storedata import ec_for, make_store

ROOT = Path(__file__).resolve().parents[3]


# ---- options -------------------------------------------------------------------------------------
def test_options_from_vllms_extra_config():
    assert EntryOptions.from_config({"store": "/dev/shm/s"}) == EntryOptions(store="/dev/shm/s")
    opts = EntryOptions.from_config({"store": "mooncake://m.example:50051", "mooncake_namespace": "ns",
                                     "mooncake_local_host": "10.0.0.3", "mooncake_protocol": "rdma"})
    assert (opts.mooncake_namespace, opts.mooncake_local_host, opts.mooncake_protocol) == ("ns", "10.0.0.3", "rdma")


@pytest.mark.parametrize("extra,says", [
    ({}, "needs 'store'"),
    ({"shared_storage_path": "/dev/shm/s"}, "unknown ['shared_storage_path']"),  # ECExampleConnector's name
    ({"store": "mooncake://m:50051"}, "needs 'mooncake_namespace'"),
    ({"store": "mooncake://m", "mooncake_namespace": "ns"}, "mooncake://MASTER_HOST:RPC_PORT"),
    ({"store": "/s", "mooncake_protocol": "udp"}, "'tcp' or 'rdma'"),
])
def test_options_refused_say_what_to_fix(extra, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        EntryOptions.from_config(extra)


# ---- the directory's hold ------------------------------------------------------------------------
def _load_elsewhere(root: Path, held: Held, out: Path) -> subprocess.CompletedProcess:
    """DirectoryEntries(root).load(held) in another process (a worker of vLLM's), the tensor saved to `out`."""
    code = ("import pickle, sys, torch; from service.lm.ecload import DirectoryEntries; "
            "t = DirectoryEntries(sys.argv[1]).load(pickle.loads(bytes.fromhex(sys.argv[2]))); torch.save(t, sys.argv[3])")
    return subprocess.run([sys.executable, "-c", code, str(root), pickle.dumps(held).hex(), str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _open_store_files(root: Path) -> list[str]:
    fds = "/proc/self/fd"
    links = [os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds) if os.path.islink(f"{fds}/{fd}")]
    return [link for link in links if link.startswith(os.path.realpath(root) + os.sep)]


def test_a_held_entry_loads_in_another_process_after_its_eviction_and_its_replacement(tmp_path):
    root = tmp_path / "s"
    store = make_store(root)
    first, second = ec_for(1, 5), ec_for(2, 5)
    store.put("img-1", first, (1, 2, 10))
    entries = DirectoryEntries(root)
    held = entries.hold("img-1")
    assert held is not None and held.hold and entries.held == 1
    store.put("img-1", second, (1, 2, 10))  # re-encoded: a new file renamed over the held one
    assert torch.equal(read_ec_cache(root, "img-1"), second)
    (root / "img-1" / FILE_NAME).unlink()  # then evicted

    done = _load_elsewhere(root, held, tmp_path / "t.pt")
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.load(tmp_path / "t.pt"), first)  # the version the check found, whole
    assert "cannot reach" not in done.stderr  # (through the scheduler's handle, not by path)

    entries.release(held.hold)
    assert entries.held == 0 and _open_store_files(root) == []
    assert _load_elsewhere(root, held, tmp_path / "t2.pt").returncode != 0  # released and gone: nothing to load


def test_no_entry_is_nothing_held():
    entries = DirectoryEntries("/nonexistent-store")
    assert entries.hold("absent") is None
    assert entries.hold("lora-a:0123abcd") is None  # vLLM's mm_hash with a LoRA prefix: no key of a store
    assert entries.held == 0


def test_where_the_schedulers_handle_cannot_be_reached_it_loads_by_path(tmp_path, caplog):
    root = tmp_path / "s"
    store = make_store(root)
    store.put("img-1", ec_for(1, 5), (1, 2, 10))
    entries = DirectoryEntries(root)
    held = entries.hold("img-1")
    # A worker on another host (or PID namespace) finds another process's file under that /proc path, or
    # none: the inode tells it is not the scheduler's.
    with open(tmp_path / "other", "w") as other:
        elsewhere = Held("img-1", held.hold, handle=f"/proc/self/fd/{other.fileno()}", inode=held.inode)
        with caplog.at_level(logging.WARNING, "service.lm.ecload"):
            assert torch.equal(DirectoryEntries(root).load(elsewhere), ec_for(1, 5))
    assert "loading entries by path" in caplog.text
    gone = Held("img-1", held.hold, handle="/proc/999999999/fd/3", inode=held.inode)
    entries.close()
    (root / "img-1" / FILE_NAME).unlink()
    with pytest.raises(KeyError):
        DirectoryEntries(root).load(gone)
    assert entries.held == 0


# ---- whose entries ---------------------------------------------------------------------------------
def test_entries_of_another_encoder_model_are_not_found_and_said_once(tmp_path, caplog):
    """An encoder on the random 2B preset behind an LM of a real 2B checkpoint gave garbage with shapes that
    fit. The connector finds only entries of the encoder model it reads (same_tower: the same checkpoint
    under another directory name is the same tower), and says in one line per other model that it skips."""
    ours, theirs = "Qwen3-VL-2B-Instruct@1a2b3c", "preset:qwen3-vl-2b:seed0"
    make_store(tmp_path / "s", model=ours).put("mine", ec_for(1, 5), (1, 2, 10))
    other = make_store(tmp_path / "s2", model=theirs)
    other.put("random-1", ec_for(2, 5), (1, 2, 10))
    other.put("random-2", ec_for(3, 5), (1, 2, 10))
    for key in ("random-1", "random-2"):
        os.rename(tmp_path / "s2" / key, tmp_path / "s" / key)  # (one directory, written by two encoders)
    entries = DirectoryEntries(tmp_path / "s", model="mounted-elsewhere@1a2b3c")
    with caplog.at_level(logging.WARNING, logger="service.lm.ecload"):
        assert entries.hold("random-1") is None and entries.hold("random-2") is None
        held = entries.hold("mine")
    assert held is not None and torch.equal(entries.load(held), ec_for(1, 5))
    assert entries.held == 1  # (nothing of the refused ones stays open)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and theirs in said[0] and "mounted-elsewhere@1a2b3c" in said[0], said
    assert DirectoryEntries(tmp_path / "s").hold("random-1") is not None  # no model given: any


def test_the_encoder_model_is_vllms_own_checkpoints_tower_unless_named(tiny_checkpoint, caplog):
    from service.engine.loader import checkpoint_model_id
    from service.lm.ecload import encoder_model_for

    auto = EntryOptions(store="/s")
    assert encoder_model_for(auto, str(tiny_checkpoint)) == checkpoint_model_id(tiny_checkpoint)
    with caplog.at_level(logging.INFO, logger="service.lm.ecload"):
        assert encoder_model_for(auto, "Qwen/Qwen3-VL-2B-Instruct") is None  # a hub name: its files are not here
    assert "not a local checkpoint directory" in caplog.text
    assert encoder_model_for(EntryOptions(store="/s", encoder_model="any"), str(tiny_checkpoint)) is None
    assert encoder_model_for(EntryOptions(store="/s", encoder_model="x@1"), str(tiny_checkpoint)) == "x@1"
    with pytest.raises(ValueError, match="encoder_model must be"):
        EntryOptions.from_config({"store": "/s", "encoder_model": 3})

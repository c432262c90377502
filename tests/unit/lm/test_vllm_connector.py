"""The vLLM connector we ship (service/lm/vllm_connector.py), driven through vLLM's own connector calls (0.33
and 0.34, tests/support/vllm_env.py's VERSIONS) on the CPU, for both stores: a directory written by a real encoder process, and Mooncake Store with a
real master and a real encoder process. vLLM's scheduler-side calls (has_cache_item,
update_state_after_alloc, build_connector_meta) run in one process and a worker's
(bind_connector_metadata, start_load_caches into an encoder-cache dict) in another, with the metadata
pickled between them as vLLM's executor sends it (tests/support/vllm_side.py). They load exactly, bit for
bit, the tensors the encoder stored; an absent key is absent, and an input vLLM encodes itself is not
loaded.

The directory's check-then-load race: the encoder evicts the entries right after vLLM's check, and
they still load (the scheduler held them open); vLLM's own ECExampleConnector, under the same eviction,
loads nothing for an image its scheduler had found (in vLLM: "Encoder cache miss" in the model step).

vLLM is installed beside the venv, once per machine (tests/support/vllm_env.py); skipped, saying why, where it
cannot be; Mooncake's test also where Mooncake's client cannot work here (tests/support/mooncake_pool.py).
"""

from __future__ import annotations

import base64
import os
import re
import time

import httpx
import pytest
import safetensors.torch

from service.store.format import FILE_NAME, TMP_PREFIX
from tests.support import imagedata as data
from tests.support.live import ServiceProcess, image_part, json_body, proxy_request
from tests.support.vllm_side import VllmSide
from tests.support.mooncake_pool import LOOPBACK, Master, SegmentHost
from tests.support.processes import wait_for
from tests.support.vllm_env import VERSIONS, vllm_env

# NOTE: slow for vLLM's import (~30 s per process on two busy cores), not for what is tested.
pytestmark = pytest.mark.slow

OURS = {"ec_connector": "EncoderStoreConnector", "module": "service.lm.vllm_connector"}
TINY = ["serve", "--model", "tiny", "--device", "cpu", "--min-pixels", "16384", "--max-pixels", "16384"]
ABSENT = "never-encoded"


@pytest.fixture(scope="module", params=VERSIONS)
def vllm(request, tmp_path_factory):
    """(scheduler, worker): two vLLM-side processes, importing vLLM while the test starts its encoder; once for
    each vLLM release tested."""
    env = vllm_env(request.param)
    logs = tmp_path_factory.mktemp(f"vllm-{request.param}")
    sides = VllmSide(env, logs / "scheduler.log"), VllmSide(env, logs / "worker.log")
    try:
        yield sides
    finally:
        for side in sides:
            side.stop()


def _image(seed: int) -> bytes:
    return data.encode(data.textured_rgb(128, 128, seed=seed), "PNG")


def _encode(encoder: ServiceProcess, seeds: list[int], keys: list[str]) -> list[dict]:
    r = httpx.post(encoder.url + "/encode", json=json_body(*map(_image, seeds), uuids=keys), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["items"]


def _connect(vllm, name: str, **connector) -> None:
    """The connector in both processes, made by vLLM's factory for its role."""
    for side, role in zip(vllm, ("scheduler", "worker")):
        made = side.call("connector", name=name, role=role, **connector)
        assert "error" not in made, made


def _one_step(vllm, name: str, images: list[list], request_id: str | None = None) -> dict:
    """vLLM's calls for one request, [[mm_hash, tokens], ...], after its scheduler's checks: every input
    allocated (found or not: vLLM allocates the ones it encodes itself too), the metadata built and
    loaded by the worker. -> the worker's reply (keys loaded, its metadata for the scheduler)."""
    sched, worker = vllm
    for index in range(len(images)):
        assert sched.call("alloc", name=name, request_id=request_id or f"{name}-req", images=images, index=index) == {}
    meta = sched.call("meta", name=name)["meta"]
    got = worker.call("load", name=name, meta=meta, out=str(worker.log.parent / f"{name}-cache.safetensors"))
    assert "error" not in got, got
    return got


def _loaded(vllm, name: str) -> dict:
    return safetensors.torch.load_file(vllm[1].log.parent / f"{name}-cache.safetensors")


def _held_store_files(pid: int, store) -> list[str]:
    """The store's files process `pid` has open (an evicted one reads '... (deleted)')."""
    fds, root = f"/proc/{pid}/fd", os.path.realpath(store)
    links = [os.readlink(f"{fds}/{fd}") for fd in os.listdir(fds) if os.path.islink(f"{fds}/{fd}")]
    return sorted(link for link in links if link.startswith(root + os.sep))


def test_directory_entries_load_bit_for_bit_even_evicted_right_after_vllms_check(vllm, tmp_path):
    sched, worker = vllm
    store = tmp_path / "store"
    # Room for about four entries, none kept once answered: encoding four more evicts the first two.
    encoder = ServiceProcess([*TINY, "--store", str(store), "--store-capacity-bytes", "45000",
                              "--store-min-residency-s", "0"], tmp_path / "encoder.log")
    try:
        items = _encode(encoder, [0, 1], ["cat-1", "dog-2"])
        keys = [it["key"] for it in items]
        # What the encoder stored, read as ECExampleConnector reads it.
        stored = {k: safetensors.torch.load_file(store / k / FILE_NAME)["ec_cache"] for k in keys}
        assert [list(stored[k].shape) for k in keys] == [it["shape"] for it in items]

        _connect(vllm, "dir", **OURS, extra={"store": str(store)})
        _connect(vllm, "example", ec_connector="ECExampleConnector", extra={"shared_storage_path": str(store)})
        for name in ("dir", "example"):
            assert [sched.call("has", name=name, mm_hash=k)["found"] for k in [*keys, ABSENT]] == [True, True, False]

        _encode(encoder, [2, 3, 4, 5], ["f-2", "f-3", "f-4", "f-5"])  # the encoder's LRU evicts cat-1, dog-2
        wait_for(lambda: not any((store / k / FILE_NAME).exists() for k in keys), 10, "the eviction")

        tokens = [it["num_tokens"] for it in items]
        image_inputs = [[keys[0], tokens[0]], [ABSENT, 16], [keys[1], tokens[1]]]
        got = _one_step(vllm, "dir", image_inputs)
        assert got["keys"] == sorted(keys)  # the absent input is vLLM's to encode
        loaded = _loaded(vllm, "dir")
        for k in keys:
            assert loaded[k].dtype == stored[k].dtype and loaded[k].equal(stored[k]), k  # bit for bit
        # Held from the check until the worker reported the load, then released.
        root = os.path.realpath(store)
        # (The encoder renames an evicted entry aside before it unlinks it: DirectoryStore._evict_locked.)
        held = _held_store_files(sched.pid, store)
        assert len(held) == len(keys) and all(re.fullmatch(rf"{re.escape(root)}/{re.escape(TMP_PREFIX)}evicted-[0-9a-f]{{16}} "
                                                           r"\(deleted\)", h) for h in held), held
        assert sched.call("output", name="dir", worker_meta=got["worker_meta"]) == {}
        assert _held_store_files(sched.pid, store) == []
        assert _held_store_files(worker.pid, store) == []
        # The next step's check sees the store as it is now.
        assert sched.call("has", name="dir", mm_hash=keys[0])["found"] is False

        # vLLM's own connector under the same eviction: its scheduler found both, its worker gets neither.
        assert _one_step(vllm, "example", image_inputs)["keys"] == []
    finally:
        assert encoder.stop(), encoder.log.read_text()[-3000:]


def test_entries_of_another_encoder_model_are_not_found_by_vllm(vllm, tmp_path):
    """The connector given the encoder model it reads (ec_connector_extra_config's encoder_model; by default
    vLLM's own checkpoint's tower, tests/unit/lm/test_ecload.py) finds no entry of another: vLLM encodes
    those images itself instead of loading another tower's embeddings that fit its shapes."""
    sched, _ = vllm
    store = tmp_path / "store"
    encoder = ServiceProcess([*TINY, "--store", str(store)], tmp_path / "encoder.log")
    try:
        (item,) = _encode(encoder, [7], ["tiny-1"])
    finally:
        assert encoder.stop(), encoder.log.read_text()[-3000:]
    _connect(vllm, "other-model", **OURS, extra={"store": str(store), "encoder_model": "Qwen3-VL-2B-Instruct@0123"})
    _connect(vllm, "this-model", **OURS, extra={"store": str(store), "encoder_model": "preset:tiny:seed0"})
    assert sched.call("has", name="other-model", mm_hash=item["key"])["found"] is False
    assert sched.call("has", name="this-model", mm_hash=item["key"])["found"] is True
    for side in vllm:
        for name in ("other-model", "this-model"):
            assert side.call("shutdown", name=name) == {}


def test_mooncake_entries_load_bit_for_bit_as_vllm_reads_them(vllm, tmp_path, mooncake_master_binary):
    sched, worker = vllm
    namespace = "vllm-connector-test"
    master = Master(mooncake_master_binary, LOOPBACK, tmp_path / "master.log", lease_ttl_ms=30_000)
    encoder = None
    try:
        encoder = ServiceProcess([*TINY, "--store", master.url, "--mooncake-segment-bytes", "256MiB",
                                  "--mooncake-namespace", namespace], tmp_path / "encoder.log")
        items = _encode(encoder, [10, 11], ["cat-10", "dog-11"])
        keys = [it["key"] for it in items]
        assert [it["store_key"] for it in items] == [f"{namespace}@id:{k}" for k in keys]

        _connect(vllm, "mc", **OURS, extra={"store": master.url, "mooncake_namespace": namespace})
        assert [sched.call("has", name="mc", mm_hash=k)["found"] for k in [*keys, ABSENT]] == [True, True, False]
        got = _one_step(vllm, "mc", [[keys[0], items[0]["num_tokens"]], [ABSENT, 16], [keys[1], items[1]["num_tokens"]]])
        assert got["keys"] == sorted(keys)
        assert sched.call("output", name="mc", worker_meta=got["worker_meta"]) == {}

        # What the encoder stored, read by vLLM 0.33's own Mooncake embedding client (in the worker's process).
        specs = [[it["shape"], it["dtype"], it["shape"][0] * it["shape"][1] * (4 if it["dtype"] == "float32" else 2)]
                 for it in items]
        ref_out = str(tmp_path / "vllm-read.safetensors")
        assert worker.call("vllm_mooncake_read", master=master.url, keys=[it["store_key"] for it in items],
                           specs=specs, out=ref_out) == {"keys": sorted(it["store_key"] for it in items)}
        stored = safetensors.torch.load_file(ref_out)
        loaded = _loaded(vllm, "mc")
        for it in items:
            ref = stored[it["store_key"]]
            assert list(ref.shape) == it["shape"] and str(ref.dtype) == f"torch.{it['dtype']}"
            assert loaded[it["key"]].dtype == ref.dtype and loaded[it["key"]].equal(ref), it["key"]  # bit for bit
        for side in vllm:
            assert side.call("shutdown", name="mc") == {}  # (its Mooncake clients, before the master goes)
    finally:
        if encoder is not None:
            assert encoder.stop(), encoder.log.read_text()[-3000:]
        master.stop()


def test_a_stopped_mooncake_host_costs_vllms_check_the_deadline_not_a_minute(vllm, tmp_path, mooncake_master_binary):
    """vLLM's scheduler loop asks has_cache_item of every image it schedules: with the entry's host stopped
    (SIGSTOP: a read from it would wait a minute), the check answers False (vLLM encodes the image itself)
    within mooncake_timeout_s."""
    sched, _ = vllm
    namespace = "vllm-connector-stopped"
    master = Master(mooncake_master_binary, LOOPBACK, tmp_path / "master.log", lease_ttl_ms=30_000)
    host = None
    try:
        host = SegmentHost(master.url, tmp_path / "host.log", namespace=namespace, model="m", out_hidden=8, levels=2,
                           dtype="float32", entries=[["before-stop", 4, None], ["on-stopped", 4, None]])
        _connect(vllm, "mc-stopped", **OURS, extra={"store": master.url, "mooncake_namespace": namespace,
                                                    "mooncake_timeout_s": 1.0})
        assert sched.call("has", name="mc-stopped", mm_hash="before-stop")["found"] is True
        host.stop()
        t0 = time.monotonic()
        assert sched.call("has", name="mc-stopped", mm_hash="on-stopped")["found"] is False
        took = time.monotonic() - t0
        print(f"has_cache_item with the entry's host stopped: {took:.2f} s")
        assert took < 3.0, took
        host.resume()
        for side in vllm:
            assert side.call("shutdown", name="mc-stopped") == {}
    finally:
        if host is not None:
            host.kill()
        master.stop()


def test_a_mooncake_entry_that_contradicts_itself_is_not_found_and_no_load_raises(vllm, tmp_path, mooncake_master_binary):
    """Values anyone may have written under a key (Mooncake has no authentication; a vLLM deployment shares
    the namespace): truncated, more rows or another width than the companion says, another dtype than the
    deployment's (its namespace names it), a 100,000-row value where the companion says 4. has_cache_item
    reads each value's 24-byte header and answers False (vLLM encodes the image itself). A load whose entry
    is gone since the check, or whose rows are not the tokens vLLM placed, leaves it out of the encoder
    cache and raises nothing (it runs in vLLM's execute_model: a raise ends the engine core)."""
    import struct

    import torch

    from service.store.mooncake import MooncakeStore
    from service.store.options import MOONCAKE_BUFFER_BYTES, MooncakeOptions, parse_mooncake

    sched, _ = vllm
    ns = "embedding@model:m@revision:default@encoder:e@dtype:torch.float32@protocol:v3"
    master = Master(mooncake_master_binary, LOOPBACK, tmp_path / "master.log", lease_ttl_ms=30_000)
    stores = []
    try:
        def store(dtype: str) -> MooncakeStore:
            options = MooncakeOptions(master=parse_mooncake(master.url), local_host="127.0.0.1", segment_bytes=32 << 20,
                                      buffer_bytes=MOONCAKE_BUFFER_BYTES, protocol="tcp", namespace=ns)
            stores.append(MooncakeStore(master.url, options, model_id="m", out_hidden_size=48, deepstack_levels=2,
                                        dtype=dtype, min_residency_s=30.0, salt="s"))
            return stores[-1]

        f32 = store("float32")
        rows = torch.randn(4, 144)
        for key in ["good", "truncated", "rows", "width", "too-many", "vanishes"]:
            f32.put(key, rows, (1, 4, 4))
        store("float16").put("dtype", rows.half(), (1, 4, 4))  # whole and consistent, but not this deployment's dtype
        data = rows.numpy().tobytes()

        def value(n: int, width: int, body: bytes) -> bytes:
            return struct.pack("<IIQQ", 0x4D4F4F4E, 0, n, width) + body

        tampered = {"truncated": value(4, 144, data[:-4]), "rows": value(5, 144, data + data[:576]),
                    "width": value(4, 7, data[: 4 * 7 * 4]), "too-many": value(100_000, 144, data)}
        for key, raw in tampered.items():
            vkey = f"{ns}@id:{key}"
            assert f32.client.remove(vkey, True) == 0 and f32.client.put(vkey, raw, f32._config) == 0, key

        _connect(vllm, "mc-bad", **OURS, extra={"store": master.url, "mooncake_namespace": ns})
        found = {key: sched.call("has", name="mc-bad", mm_hash=key)["found"] for key in ["good", *tampered, "dtype"]}
        assert found == {"good": True, **{key: False for key in [*tampered, "dtype"]}}, found
        assert sched.call("has", name="mc-bad", mm_hash="vanishes")["found"] is True
        assert f32.evict("vanishes")  # gone between vLLM's check and its load
        # "good" placed as 9 tokens where it has 4 rows: not loaded either; neither raises.
        got = _one_step(vllm, "mc-bad", [["good", 9], ["vanishes", 4]])
        assert got["keys"] == [], got
        assert sched.call("has", name="mc-bad", mm_hash="good")["found"] is True
        got = _one_step(vllm, "mc-bad", [["good", 4]], request_id="mc-bad-placed-right")
        assert got["keys"] == ["good"] and _loaded(vllm, "mc-bad")["good"].equal(rows)
        for side in vllm:
            assert side.call("shutdown", name="mc-bad") == {}
    finally:
        for s in stores:
            s.close()
        master.stop()


def test_vllms_own_connector_loads_what_the_chat_route_stored_under_the_key_vllm_computes(vllm, tmp_path):
    """vLLM's EPD deployment with this service as its encoder: the proxy's request to /v1/chat/completions
    (--vllm-model-id), then vLLM's LM side as it is: its own hasher computes each image's key from the
    request's bytes, its own ECExampleConnector (shared_storage_path = the store) finds and loads them."""
    sched, worker = vllm
    store, model = tmp_path / "store", "Qwen/Qwen3-VL-2B-Instruct"
    blobs = [_image(7), data.rgba_png()]  # (the second converted by vLLM's loader: keyed with its io_config)
    encoder = ServiceProcess([*TINY, "--store", str(store), "--vllm-model-id", model], tmp_path / "encoder.log")
    try:
        r = httpx.post(encoder.url + "/v1/chat/completions", timeout=60, headers={"x-request-id": "epd-1"},
                       json=proxy_request(model, *map(image_part, blobs)))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        hashes = [sched.call("mm_hash", model=model, data=base64.b64encode(b).decode())["mm_hash"] for b in blobs]
        stored = {h: safetensors.torch.load_file(store / h / FILE_NAME)["ec_cache"] for h in hashes}
        assert sum(t.shape[0] for t in stored.values()) == r.json()["usage"]["prompt_tokens"]
        _connect(vllm, "example-epd", ec_connector="ECExampleConnector", extra={"shared_storage_path": str(store)})
        assert [sched.call("has", name="example-epd", mm_hash=h)["found"] for h in hashes] == [True, True]
        got = _one_step(vllm, "example-epd", [[h, stored[h].shape[0]] for h in hashes])
        assert got["keys"] == sorted(hashes)
        loaded = _loaded(vllm, "example-epd")
        assert all(loaded[h].equal(stored[h]) for h in hashes)
    finally:
        assert encoder.stop(), encoder.log.read_text()[-3000:]

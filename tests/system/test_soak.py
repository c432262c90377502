"""The CI soak, scaled down for a CPU: `qwen3vl-encoder soak` (service/loadtest/soak.py)
starts a real server on 127.0.0.1 (tiny preset) with a store small enough that nearly every write evicts,
sends 2,000 distinct images through the load tool, replays every 10th from the store and verifies it
against the float32 reference, while reader threads read random store entries. 60-66 s under pytest on
the 2-core development machine (bench/RESULTS.md has the latest CPU soak's figures)."""

from __future__ import annotations

import json
import time

import pytest

from service.loadtest import soak

IMAGES = 2000
CAPACITY = 2_000_000  # bytes: ~200 entries of a 128x128 image (16 tokens x 144 floats + header), so ~1,800 evictions
SERVE = (f"--model tiny --device cpu --store-capacity-bytes {CAPACITY} --store-min-residency-s 1 "
         # 128x128 images kept at 128x128 (64 patches): a quarter of the tower work of the default
         # 256x256 minimum, so 2,000 images fit the CI time budget on two cores.
         "--min-pixels 16384 --max-pixels 16384")

# RSS: late-window median minus early-window median (resources.windows: 20-40% vs the last 20% of the
# samples, ~1,200 images apart). Measured here: +6 to +9 MiB in four runs with these images. The server's RSS does move
# without a leak: per-image batcher objects (WorkItem, Ticket, EncodeJob, the PreparedImage and its
# pixels, three futures) sit in reference cycles and are freed only when the cyclic GC runs, so RSS
# climbs and falls back in a sawtooth (+42 MiB over 2,500 256px images, then back, in a longer run).
# 32 MiB is 4x the measured rise, and a real leak of one decoded image per request (128*128*3 = 48 KiB)
# would add ~56 MiB between the windows.
RSS_TOLERANCE_MIB = 32
# File descriptors: the load keeps 8 keep-alive connections (--concurrency 8) and a /health or /metrics
# connection may be open at a sample; one descriptor leaked per request or per store write would add
# hundreds.
FD_TOLERANCE = 8


@pytest.mark.slow  # a minute alone on two cores: 2,000 images through a real server
@pytest.mark.timeout(400)
def test_cpu_soak_2000_distinct_images_with_constant_eviction_and_readers(tmp_path):
    store, out = tmp_path / "store", tmp_path / "soak"
    t0 = time.monotonic()
    rc = soak.main(["--serve", f"{SERVE} --store {store}", "--images", str(IMAGES), "--sizes", "128x128",
                    "--concurrency", "8", "--replay-every", "10", "--readers", "2", "--read-pause-ms", "2",
                    "--out-dir", str(out)])
    elapsed = time.monotonic() - t0
    report = json.loads((out / "soak.json").read_text())
    print(f"\nsoak: {elapsed:.0f} s\n" + (out / "soak.md").read_text())
    assert rc == 0 and report["passed"], report["checks"]

    # Every image distinct, every answer a 200.
    load = report["load"]
    assert load["ok_images"] == IMAGES and load["cached_images"] == 0 and load["requests"] == IMAGES
    assert load["non_2xx"] == 0 and load["status_counts"] == {"200": IMAGES} and load["interrupted"] is False
    assert report["server"]["ready"]["model"] == "preset:tiny:seed0"

    # Every 10th image read back as a consumer reads it, and each of those equal to the reference.
    replay, verify = report["replay"], report["verify"]
    assert (replay["every"], replay["ok"], replay["missing"], replay["wrong"]) == (10, IMAGES // 10, 0, 0)
    assert (verify["ok"], verify["wrong"], verify["skipped"]) == (IMAGES // 10, 0, 0)
    assert verify["worst_rel_err"] <= 1e-5  # float32 on the CPU on both sides: the same arithmetic

    # Constant eviction: all but what the capacity holds was evicted.
    entries = list(store.glob("*/encoder_cache.safetensors"))
    entry_bytes = entries[0].stat().st_size
    fits = CAPACITY // entry_bytes
    assert len(entries) <= fits + 1
    assert report["store"]["evictions"] >= IMAGES - fits - 1

    # Readers raced the evictions: no torn or inconsistent read; reads that lost the race are counted apart.
    readers = report["readers"]
    assert readers["reads"] >= 1000 and readers["inconsistent"] == 0, readers["problems"]
    assert readers["ok"] + readers["vanished"] == readers["reads"]

    # Nothing half-written left, nothing wrong in the log, healthy after, a clean stop.
    assert report["store"]["temp_files_after_load"] == [] and report["store"]["temp_files_after_stop"] == []
    assert list(store.rglob(".tmp*")) == []
    log = (out / "server.log").read_text()
    assert "Traceback" not in log and report["server_log"]["tracebacks"] == 0 and report["server_log"]["cuda_errors"] == 0
    assert report["health_after"] == 200 and report["server"]["shutdown_clean"] is True

    # Memory and file descriptors flat (tolerances justified above).
    res = report["resources"]
    rss, fds = res["rss_mib"], res["fds"]
    assert rss["samples"] >= 20 and len(res["samples"]) == rss["samples"]
    assert rss["late_median"] - rss["early_median"] <= RSS_TOLERANCE_MIB, rss
    assert fds["late_max"] <= fds["early_max"] + FD_TOLERANCE, fds
    assert all(s[3] >= 2 for s in res["samples"])  # the server and its decode workers were sampled

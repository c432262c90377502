"""The soak's store readers: threads (in a process of their own) that read random entries of the store
while the load runs, as consumers would, and tally what they find."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import threading
import time


def readers_main(root: str, threads: int, pause_s: float, stop, out) -> None:
    """Read random store entries on `threads` threads until `stop`; put the tally on `out`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the soak's parent handles Ctrl-C
    from service.store.format import StoreFormatError, read_embeddings

    tally = {"reads": 0, "ok": 0, "vanished": 0, "inconsistent": 0, "problems": []}
    digests: dict[str, bytes] = {}  # key -> digest of its bytes at the first read: a key is written once
    lock = threading.Lock()
    keys: list[str] = []

    def problem(text: str) -> None:
        with lock:
            tally["inconsistent"] += 1
            if len(tally["problems"]) < 10:
                tally["problems"].append(text)

    def read_one(rng: random.Random) -> None:
        key = rng.choice(keys)
        try:
            emb = read_embeddings(root, key)
        except (KeyError, FileNotFoundError):  # evicted since the listing, or still being written: fine
            with lock:
                tally["reads"] += 1
                tally["vanished"] += 1
            return
        except StoreFormatError as e:
            tally["reads"] += 1
            problem(f"{key}: {e}")
            return
        import torch

        t, h, w = emb.grid_thw
        ec = torch.cat([emb.main, *emb.deepstack], dim=1)
        meta = emb.metadata
        why = []
        if ec.shape[0] != t * h * w // 4 or str(ec.shape[0]) != meta.get("num_tokens"):
            why.append(f"{ec.shape[0]} rows for grid {emb.grid_thw}, metadata num_tokens {meta.get('num_tokens')}")
        if len(emb.deepstack) != int(meta["deepstack_levels"]) or emb.main.shape[1] != int(meta["out_hidden_size"]):
            why.append(f"{len(emb.deepstack)} deepstack x {emb.main.shape[1]} vs metadata {meta}")
        if not torch.isfinite(ec).all():
            why.append("non-finite values")
        digest = hashlib.blake2b(ec.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
        with lock:
            tally["reads"] += 1
            first = digests.setdefault(key, digest)
        if first != digest:
            why.append("different bytes than an earlier read of the same key")
        if why:
            problem(f"{key}: " + "; ".join(why))
        else:
            with lock:
                tally["ok"] += 1

    def loop(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            if not keys:
                time.sleep(0.01)
                continue
            read_one(rng)
            if pause_s:
                time.sleep(pause_s)

    def lister() -> None:  # one listing shared by the readers, refreshed often (entries come and go)
        while not stop.is_set():
            try:
                keys[:] = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
            except FileNotFoundError:
                pass
            stop.wait(0.1)

    workers = [threading.Thread(target=lister, daemon=True)]
    workers += [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(tally)

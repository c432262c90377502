"""Time EmbeddingStore.put for one real-size item (196 tokens x 2560 x (1 + 3 deepstack) bf16 = 4 MB) with the
store's writer and with safetensors.save_file (the writer put used before), on /dev/shm where there is one.

    python bench/bench_store_put.py [--rounds 3] [--puts 50] [--dir /dev/shm]

Each round puts `--puts` items into a store that holds 8 (from the 9th put on every put also evicts one),
row slices of one buffer as the engine hands them; the first 10 puts of a round are warm-up. The rounds
alternate the two writers, so both see the same machine noise. Prints the median put latency of each.
(tests/store/test_directory.py checks that what these puts write reads back bit-exact.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import service.store.directory as store_mod  # noqa: E402
from service.store.directory import EmbeddingStore  # noqa: E402
from service.store.format import read_embeddings  # noqa: E402

N, D, LEVELS = 196, 2560, 3


def save_file_writer(fd, header, ec_cache, *, fsync, mode):
    """What put did before its own writer: safetensors.save_file onto the temp file's name."""
    path = os.readlink(f"/proc/self/fd/{fd}")
    metadata = json.loads(header[8:])["__metadata__"]
    save_file({"ec_cache": ec_cache}, path, metadata=metadata)
    os.chmod(path, 0o644)
    return os.stat(path).st_size


def one_round(base: Path, buf: torch.Tensor, puts: int) -> list[float]:
    """Seconds per put after the first 10, in a fresh store that holds 8 items."""
    root = Path(tempfile.mkdtemp(prefix="ec-store-bench-", dir=base))
    try:
        store = EmbeddingStore(root, 8 * 5 << 20, model_id="bench", out_hidden_size=D, deepstack_levels=LEVELS)
        samples = []
        for i in range(puts):
            rows = buf[(i % 8) * N:(i % 8 + 1) * N]
            t0 = time.perf_counter()
            store.put(f"k{i}", rows, (1, 14, 14))
            if i >= 10:
                samples.append(time.perf_counter() - t0)
        assert read_embeddings(root, f"k{puts - 1}").main.shape == (N, D)
        return samples
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per writer (default: 3)")
    ap.add_argument("--puts", type=int, default=50, help="puts per round, the first 10 not timed (default: 50)")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                    help="where the stores are made (default: /dev/shm if there is one, else the temp dir)")
    args = ap.parse_args(argv)
    if not Path("/proc/self/fd").is_dir():
        print("the save_file writer needs /proc/self/fd (Linux)", file=sys.stderr)
        return 2
    buf = torch.randn(8 * N, D * (1 + LEVELS)).to(torch.bfloat16)
    ours: list[float] = []
    before: list[float] = []
    writer = store_mod._write_ec_file
    for _ in range(args.rounds):
        ours += one_round(args.dir, buf, args.puts)
        store_mod._write_ec_file = save_file_writer
        try:
            before += one_round(args.dir, buf, args.puts)
        finally:
            store_mod._write_ec_file = writer
    print(f"put of 4 MB bf16 in {args.dir or tempfile.gettempdir()}, median of {len(ours)} puts (incl. eviction):")
    print(f"  safetensors.save_file  {statistics.median(before) * 1e3:.2f} ms")
    print(f"  store writer           {statistics.median(ours) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

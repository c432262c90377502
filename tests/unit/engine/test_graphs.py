"""The padding scheme that lets one CUDA graph serve any step up to its bucket, checked on the CPU:
padded rows in their own attention segments never change the real images' outputs."""

import numpy as np
import pytest
import torch

from service.config import Settings
from service.engine.graphs import MIN_BUCKET_STEP, PAD_SEGMENT, equal_steps, graph_buckets, pad_segments, padded_cu_seqlens
from service.engine.loader import load_model
from service.engine.tower import TowerBatch, build_batch


def test_buckets_are_dense_so_padding_wastes_little():
    b = graph_buckets(65536, limit=12544, smallest=256)
    assert b[0] == 256 and b[-1] == 12544 and b == sorted(set(b))
    assert all(x % 4 == 0 for x in b)  # every image's patch count is a multiple of 4
    # Any step of n patches (n >= 256, a multiple of 4) pads to a bucket at most 64 patches or 1/16 larger.
    for n in range(256, 12545, 4):
        bucket = next(x for x in b if x >= n)
        assert bucket - n < max(MIN_BUCKET_STEP, n / 16), (n, bucket)
    assert len(b) <= 80  # a bounded number of graphs to capture at start
    assert [x for x in b if x <= 1024] == list(range(256, 1025, 64))
    assert graph_buckets(3000, limit=12544, smallest=256)[-1] == 3000  # never beyond a step's capacity
    assert graph_buckets(65536, limit=12544, smallest=64)[0] == 64  # small min_pixels: small buckets
    gaps = [y - x for x, y in zip([0, *b], b)]
    assert pad_segments(max(gaps[1:])) == 1


def test_equal_steps_are_the_exact_sizes_up_to_the_largest_bucket():
    steps = equal_steps(12544, exact=(784, 1024))
    assert [(k, 784) for k in range(1, 17)] == [s for s in steps if s[1] == 784]
    assert [(k, 1024) for k in range(1, 13)] == [s for s in steps if s[1] == 1024]  # 13 x 1024 > 12544
    assert equal_steps(12544) == [] and equal_steps(1000, exact=(784, 0)) == [(1, 784)]
    # --graph-exact-images: up to that many equal images, still within the largest bucket
    assert equal_steps(65536, exact=(784,), exact_images=64) == [(k, 784) for k in range(1, 65)]
    assert equal_steps(12544, exact=(784,), exact_images=4) == [(k, 784) for k in range(1, 5)]


def test_padded_cu_seqlens_layout():
    cu = padded_cu_seqlens([784, 400], bucket=3072, length=10)
    assert cu == [0, 784, 1184, 2208, 3072, 3072, 3072, 3072, 3072, 3072]
    assert padded_cu_seqlens([1024], 1024, 4) == [0, 1024, 1024, 1024]
    segs = np.diff(cu)
    assert segs.max() <= max(784, PAD_SEGMENT) and (segs >= 0).all()
    with pytest.raises(AssertionError):
        padded_cu_seqlens([2000], 1024, 8)


def test_padding_rows_never_change_real_outputs():
    m = load_model(Settings(model="tiny", device="cpu"))
    spec = m.spec
    grids = [(1, 16, 20), (1, 8, 12), (1, 10, 10)]
    lens = [t * h * w for t, h, w in grids]
    n = sum(lens)
    bucket = 1024
    arr = build_batch(grids, spec)
    g = torch.Generator().manual_seed(0)
    patches = torch.randn(bucket, spec.frame_patch_dim, generator=g)
    real = TowerBatch(patches[:n], *(torch.from_numpy(arr[k]) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")),
                      seq_lens=tuple(lens))
    # Padding rows hold stale-but-valid values, as in the engine's static buffers.
    pos = torch.cat([torch.from_numpy(arr["pos_hw"]), torch.randint(0, 40, (bucket - n, 2), generator=g)])
    idx = torch.cat([torch.from_numpy(arr["interp_idx"]), torch.randint(0, 2304, (bucket - n, 4), generator=g)])
    wts = torch.cat([torch.from_numpy(arr["interp_w"]), torch.rand(bucket - n, 4, generator=g)])
    cu = padded_cu_seqlens(lens, bucket, length=12)
    padded = TowerBatch(patches, pos, idx, wts, torch.tensor(cu, dtype=torch.int32),
                        seq_lens=tuple(int(x) for x in np.diff(cu)), max_seqlen=bucket)
    with torch.no_grad():
        a = m.tower(real)
        b = m.tower(padded)
    assert b.shape == (bucket // 4, spec.out_width)
    assert (a - b[: n // 4]).abs().max().item() <= 1e-6

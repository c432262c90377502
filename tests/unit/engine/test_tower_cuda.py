"""The fast tower on a CUDA GPU (skipped without one): torch.compile'd and CUDA-graph-replayed steps
against the eager tower and a float32 reference, for 1..16 images, a mixed-size step and a step too
large for a graph. Also: compiling happens at start-up only, never in the middle of serving; and a
step with a video's temporal groups through varlen attention against the float32 CPU tower."""

import pytest
import torch
import torch.nn.functional as F

from qve_kernels.patchify import cupy_available
from service.config import Settings
from service.engine.core import Engine
from service.engine.graphs import GraphKey
from service.media.images import prepare_image
from service.engine.loader import load_model
from service.engine import attention
from service.engine.runner import use_compile_cache
from service.engine.tower import AttentionKind, TowerBatch, attention_kind, build_batch, step_segments
from service.metrics import Metrics
from tests.support import imagedata as data

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and cupy_available()), reason="needs a CUDA GPU and CuPy")


def _engine(model, s: Settings) -> Engine:
    """An Engine without a store, built as the entry points build one: compile cache first."""
    options = s.runner_options()
    use_compile_cache(model, options)
    return Engine(model, store=None, batcher=None, options=options, metrics=Metrics())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def steps():
    """Steps the service runs: k equal 448x448 images for k = 1..16, photographs of mixed sizes, and
    20 equal images (beyond the largest graph: the compiled tower runs without one)."""
    params = load_model(Settings(model="tiny", device="cpu")).params
    limits = Settings().image_limits
    same = [prepare_image(data.encode(data.textured_rgb(448, 448, seed=i), "PNG"), params, limits) for i in range(20)]
    photos = [prepare_image(data.photo(n, max_side=640), params, limits)
              for n in ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png")]
    out = {f"{k} x 448px": same[:k] for k in range(1, 17)}
    out["mixed photos"] = photos
    out["20 x 448px"] = same
    return out


def _attention_runs(choice: str) -> None:
    """Skip (saying why) where --attention `choice` cannot run on this GPU (FA3: the fa3 extra, Hopper)."""
    if choice == "auto":
        return
    spec = load_model(Settings(model="tiny", device="cpu")).spec
    try:
        attention.plan_for(choice, torch.device("cuda"), torch.bfloat16, spec.num_heads, spec.head_dim)
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("choice", ["auto", "cudnn", "fa3", "fa2", "sdpa"])
def test_compiled_and_graph_replayed_steps_equal_the_eager_tower(tmp_path, steps, choice):
    """With every attention kernel (--attention NAME forces it where it runs) and with the measured plan."""
    _attention_runs(choice)
    s = Settings(model="tiny", device="cuda", dtype="bfloat16", max_batch_tokens=8192, compile_cache=tmp_path / "cc",
                 graph_max_patches=16 * 784, attention=choice)
    model = load_model(s)
    ref_model = load_model(s.model_copy(update={"dtype": "float32"}))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref_engine = _engine(ref_model, ref_model_settings(s))
    # the eager reference: SDPA for equal steps, FA2 for the others (the kernels before the plan)
    eager = _engine(model, s.model_copy(update={"compile": False, "cuda_graphs": False, "attention": "sdpa"}))
    expected = {name: (torch.cat(ref_engine.encode_sync(imgs)), torch.cat(eager.encode_sync(imgs)))
                for name, imgs in steps.items()}

    fast = _engine(model, s)
    runner = fast.runner
    plan = model.tower.attention_plan
    if choice != "auto":  # forced: that kernel wherever it runs a layout
        forced = attention.Backend(choice)
        assert all(plan.choose(k, n) == forced for k in plan.table for n in (256, 784, 8160))
        assert plan.table, choice
    assert model.tower.compiled and runner.graphs is not None
    assert runner.startup["compile_s"] > 0 and runner.startup["graphs"] == len(runner.buckets) + len(runner.equal_steps)
    assert (1, 784) in runner.equal_steps and (16, 784) in runner.equal_steps
    from torch._dynamo.utils import counters

    graphs_after_startup = counters["stats"]["unique_graphs"]
    for name, imgs in steps.items():
        patches = sum(i.num_patches for i in imgs)
        graph = runner.graphs.graph_for(tuple(i.num_patches for i in imgs))
        replayed = graph is not None
        assert replayed == (name != "20 x 448px"), name
        if replayed and "448px" in name:  # 448 is one of --graph-exact-sides: an unpadded batched-attention graph
            assert graph == GraphKey.equal(len(imgs), patches // len(imgs)) and not graph.padded, name
        elif replayed:
            assert graph.padded, name  # images of different sizes: a padded varlen graph
        out = torch.cat(fast.encode_sync(imgs))
        ref32, ref_eager = expected[name]
        assert out.shape == ref32.shape and out.dtype == torch.bfloat16
        assert torch.isfinite(out.float()).all()
        err_fast, err_eager = _rel(out, ref32), _rel(ref_eager, ref32)
        print(f"{choice:5s} {name:14s} graph={replayed!s:5s} rel err vs fp32: fast {err_fast:.2e} eager {err_eager:.2e} "
              f"fast-vs-eager {_rel(out, ref_eager):.2e}")
        # As accurate as the eager bf16 tower, and the same function (not merely "close").
        assert err_fast <= 1.25 * err_eager + 1e-3, name
        assert _rel(out, ref_eager) <= 2 * err_eager + 1e-3, name
    # Every step above ran on what start-up compiled: no compile in the middle of serving.
    assert counters["stats"]["unique_graphs"] == graphs_after_startup


def test_a_step_of_unequal_images_on_an_equal_step_size_takes_the_varlen_graph(tmp_path):
    """1568 patches is two 448px images' equal-step graph, and also one 512px image (1024 patches) with
    a 256x544 one (544): that step must replay a padded varlen graph and match the eager tower."""
    s = Settings(model="tiny", device="cuda", dtype="bfloat16", max_batch_tokens=8192, compile_cache=tmp_path / "cc",
                 graph_max_patches=4 * 784)
    model = load_model(s)
    limits = Settings().image_limits
    imgs = [prepare_image(data.encode(data.textured_rgb(w, h, seed=i), "PNG"), model.params, limits)
            for i, (w, h) in enumerate(((512, 512), (544, 256)))]
    assert [i.num_patches for i in imgs] == [1024, 544]
    eager = _engine(model, s.model_copy(update={"compile": False, "cuda_graphs": False}))
    expected = torch.cat(eager.encode_sync(imgs))
    fast = _engine(model, s)
    varlen = fast.runner.graphs.graph_for((1024, 544))
    assert varlen.padded and varlen.patches >= 1568 and fast.runner.graphs.graph_for((784, 784)) == GraphKey.equal(2, 784)
    out = torch.cat(fast.encode_sync(imgs))
    assert _rel(out, expected) < 2e-2
    # and the equal step of the same size right after it still replays its own graph correctly
    two = [prepare_image(data.encode(data.textured_rgb(448, 448, seed=7 + i), "PNG"), model.params, limits) for i in range(2)]
    assert _rel(torch.cat(fast.encode_sync(two)), torch.cat(eager.encode_sync(two))) < 2e-2


def ref_model_settings(s: Settings) -> Settings:
    return s.model_copy(update={"dtype": "float32", "compile": False, "cuda_graphs": False})


def test_graph_replays_of_one_step_are_identical_and_independent_of_stale_padding(tmp_path, steps):
    """A graph replays the same kernels on the same rows: a step's output must not depend on what an
    earlier, larger step left in the padding rows."""
    s = Settings(model="tiny", device="cuda", dtype="bfloat16", max_batch_tokens=8192, compile_cache=tmp_path / "cc",
                 graph_exact_sides=[])  # no exact buckets: one image pads to its bucket
    fast = _engine(load_model(s), s)
    one = steps["1 x 448px"]
    assert fast.runner.graphs.bucket_for(784) > 784
    first = torch.cat(fast.encode_sync(one))
    fast.encode_sync(steps["16 x 448px"])  # fills the padding rows of one image's bucket with other data
    again = torch.cat(fast.encode_sync(one))
    assert torch.equal(first, again)


def test_a_step_with_a_video_in_bfloat16_through_varlen_attention_equals_the_float32_cpu_tower():
    """Two images and a video of three temporal groups (two distinct frames each: the Conv3d's per-frame
    slices, one segment per group), its rows last, in one eager bf16 step on CUDA, against the same
    preset's float32 tower on the CPU (a seed draws the same weights on every device and dtype)."""
    ref = load_model(Settings(model="tiny", device="cpu", dtype="float32"))
    fast = load_model(Settings(model="tiny", device="cuda", dtype="bfloat16"))
    spec = ref.spec
    grids = [(1, 16, 16), (1, 8, 12), (3, 8, 12)]  # the video last, as a step stages it
    n, nv = sum(t * h * w for t, h, w in grids), 3 * 8 * 12
    gen = torch.Generator().manual_seed(0)
    patches = torch.randn(n, spec.frame_patch_dim, generator=gen)  # a video group's first frame in its last rows
    frame1 = torch.randn(nv, spec.frame_patch_dim, generator=gen)  # the video groups' second frames
    arr = build_batch(grids, spec)

    def batch(device: torch.device, dtype: torch.dtype) -> TowerBatch:
        geometry = (torch.from_numpy(arr[k]).to(device) for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens"))
        return TowerBatch(patches.to(device, dtype), *geometry, seq_lens=step_segments(grids),
                          frame1=frame1.to(device, dtype))

    cuda = torch.device("cuda")
    on_gpu = batch(cuda, torch.bfloat16)
    assert on_gpu.seq_lens == (256, 96, 96, 96, 96)
    assert attention_kind(on_gpu, cuda, torch.bfloat16) == AttentionKind.VARLEN
    with torch.inference_mode():
        out = fast.tower(on_gpu)
        expected = ref.tower(batch(torch.device("cpu"), torch.float32))
    assert out.shape == expected.shape == (n // 4, spec.out_width) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    err = _rel(out.cpu(), expected)
    video = slice((n - nv) // 4, None)
    err_video = _rel(out[video].cpu(), expected[video])
    print(f"2 images + a video, bf16 varlen vs fp32 CPU: rel err {err:.2e} (video rows {err_video:.2e})")
    assert err < 2e-2 and err_video < 2e-2


def test_fp8_compiled_and_graph_replayed_steps_stay_close_to_the_eager_bf16_tower(tmp_path, steps):
    """--dtype fp8 with every GEMM that can be FP8 and no block kept in bf16 (the most FP8 can differ), compiled and graph-replayed, for
    1..16 images, mixed photographs, a step beyond the graphs and a step with a video: every token within
    cosine 0.99 of the eager bf16 tower (random weights: trained ones' outlier channels are not here), and
    the compiled path the same function as FP8 eager (close to it as the compiled bf16 tower is to eager)."""
    s = Settings(model="tiny", device="cuda", dtype="fp8", fp8_bf16_blocks=[], fp8_gemms=["qkv", "fc1", "fc2"],
                 max_batch_tokens=8192, compile_cache=tmp_path / "cc", graph_max_patches=16 * 784)
    fp8 = load_model(s)
    assert fp8.tower.fp8_blocks == (0, 1, 2) and fp8.tower.fp8_gemms == ("qkv", "fc1", "fc2")
    assert fp8.dtype == torch.bfloat16
    bf16 = load_model(s.model_copy(update={"dtype": "bfloat16"}))
    plain = {"compile": False, "cuda_graphs": False, "attention": "sdpa"}
    eager_bf16 = _engine(bf16, s.model_copy(update={**plain, "dtype": "bfloat16"}))
    eager_fp8 = _engine(fp8, s.model_copy(update=plain))
    expected = {name: (torch.cat(eager_bf16.encode_sync(imgs)), torch.cat(eager_fp8.encode_sync(imgs)))
                for name, imgs in steps.items()}
    fast = _engine(fp8, s)
    assert fp8.tower.compiled and fast.runner.graphs is not None
    worst = 1.0
    for name, imgs in steps.items():
        out = torch.cat(fast.encode_sync(imgs))
        want_bf16, want_fp8 = expected[name]
        cos = F.cosine_similarity(out.float(), want_bf16.float(), dim=1)
        err, err_eager = _rel(out, want_bf16), _rel(want_fp8, want_bf16)
        print(f"fp8 {name:14s} min cosine {cos.min():.5f} rel err vs bf16 eager {err:.2e} (fp8 eager {err_eager:.2e}) "
              f"vs fp8 eager {_rel(out, want_fp8):.2e}")
        worst = min(worst, cos.min().item())
        assert cos.min() > 0.99 and err < 5e-2, name
        assert _rel(out, want_fp8) <= 0.5 * err_eager + 1e-2, name
    # a step with a video's temporal groups (varlen, frame1), through the compiled FP8 blocks
    spec = fp8.spec
    grids = [(1, 16, 16), (4, 24, 32)]
    n, nv = sum(t * h * w for t, h, w in grids), 4 * 24 * 32
    gen = torch.Generator().manual_seed(0)
    patches = torch.randn(n, spec.frame_patch_dim, generator=gen).cuda()
    frame1 = torch.randn(nv, spec.frame_patch_dim, generator=gen).cuda()
    arr = build_batch(grids, spec)
    geometry = [torch.from_numpy(arr[k]).cuda() for k in ("pos_hw", "interp_idx", "interp_w", "cu_seqlens")]
    with torch.inference_mode():
        got = fp8.tower(TowerBatch(patches.bfloat16(), *geometry, seq_lens=step_segments(grids),
                                   frame1=frame1.bfloat16()))
        want = bf16.tower(TowerBatch(patches.bfloat16(), *geometry, seq_lens=step_segments(grids),
                                     frame1=frame1.bfloat16()))
    cos = F.cosine_similarity(got.float(), want.float(), dim=1)
    print(f"fp8 video step: min cosine {cos.min():.5f} rel err {_rel(got, want):.2e}; worst image step {worst:.5f}")
    assert cos.min() > 0.99 and _rel(got, want) < 5e-2

"""The encoder end to end on CPU: --model <checkpoint dir> -> decode -> preprocess -> one packed batch
through the step loop's stage/run path -> per-image [tokens, out_hidden * (1 + deepstack)] tensors,
compared with transformers' own processor + vision tower."""

import io

import pytest
import torch
from PIL import Image, ImageOps
from transformers import Qwen3VLForConditionalGeneration

from service.__main__ import build_parser
from service.config import FaultInjection, Settings
from service.engine.core import Engine
from service.media.images import prepare_image
from service.engine.loader import load_model
from service.metrics import Metrics
from service.engine.runner import Runner
from tests.support import imagedata as data
from tests.support.checkpoints import PilProcessor, TEST_MAX_PIXELS, TEST_MIN_PIXELS

PHOTOS = [  # real photographs shipped by scikit-image
    "astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "camera.png", "moon.png", "page.png",
    "hubble_deep_field.jpg@400", "retina.jpg@360", "motorcycle_left.png@300",
]
SYNTHETIC = [  # modes, formats, sizes and aspect ratios
    "rgba.png", "palette_transparent.png", "gray.png", "cmyk.jpg", "exif6.jpg", "exif8.png", "la.png",
    "noise.webp.lossy", "noise.gif.animated", "noise.bmp", "noise.tiff", "tiny_10x7.png", "wide_4000x40.png",
    "tall_30x6000.png",
]


def _settings_from_cli(ckpt) -> Settings:
    args = vars(build_parser().parse_args(["serve", "--model", str(ckpt), "--device", "cpu", "--dtype", "float32"]))
    args.pop("command")
    return Settings(**args)


def _reference(ckpt, blobs):
    """transformers: load_image-style decode (EXIF applied, mode kept), PIL processor, vision tower."""
    pil = [ImageOps.exif_transpose(Image.open(io.BytesIO(b))) for b in blobs]
    proc = PilProcessor.from_pretrained(ckpt)
    assert proc.size["longest_edge"] == TEST_MAX_PIXELS  # the checkpoint's limits, not the defaults
    inputs = proc(images=pil, return_tensors="pt")
    visual = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).model.visual.eval()
    with torch.no_grad():
        out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    return inputs["image_grid_thw"], out.pooler_output, out.deepstack_features


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(_settings_from_cli(tiny_checkpoint))


def test_packed_batch_equals_transformers(tiny_checkpoint, model):
    names = PHOTOS + SYNTHETIC
    blobs = [data.valid_images()[n] for n in names]
    settings = _settings_from_cli(tiny_checkpoint)
    assert (model.params.min_pixels, model.params.max_pixels) == (TEST_MIN_PIXELS, TEST_MAX_PIXELS)
    prepared = [prepare_image(b, model.params, settings.image_limits) for b in blobs]
    assert len({p.grid_thw for p in prepared}) >= 8  # really different sizes in one batch

    engine = Engine(model, store=None, batcher=None, options=settings.runner_options(), metrics=Metrics())
    outs = engine.encode_sync(prepared)  # ONE packed step

    grids, pooler, deepstack = _reference(tiny_checkpoint, blobs)
    spec = model.spec
    d = spec.out_hidden_size
    assert len(deepstack) == spec.deepstack_levels == 2
    offset, worst = 0, 0.0
    for name, prep, out, grid in zip(names, prepared, outs, grids.tolist()):
        assert list(prep.grid_thw) == grid, name
        n = grid[0] * grid[1] * grid[2] // 4
        assert out.shape == (n, d * (1 + spec.deepstack_levels)) and out.dtype == torch.float32, name
        ref_parts = [pooler[offset : offset + n]] + [f[offset : offset + n] for f in deepstack]
        for level, ref in enumerate(ref_parts):  # main first, then each deepstack tap in index order
            diff = (out[:, level * d : (level + 1) * d] - ref).abs().max().item()
            assert diff <= 1e-5, f"{name} level {level}: max abs diff {diff}"
            worst = max(worst, diff)
        offset += n
    assert offset == pooler.shape[0]
    print(f"{len(names)} images, {offset} tokens in one packed step; worst max abs diff {worst:.2e}")


def test_one_image_alone_equals_its_slice_of_a_batch(model, tiny_checkpoint):
    """Packing must not leak between images: an image encoded alone gives the same rows."""
    settings = _settings_from_cli(tiny_checkpoint)
    imgs = [prepare_image(data.valid_images()[n], model.params, settings.image_limits)
            for n in ("coffee.png", "rgba.png", "wide_4000x40.png")]
    engine = Engine(model, store=None, batcher=None, options=settings.runner_options(), metrics=Metrics())
    together = engine.encode_sync(imgs)
    for img, t in zip(imgs, together):
        alone = engine.encode_sync([img])[0]
        assert (alone - t).abs().max().item() <= 1e-5


def test_a_step_that_fails_while_staging_gives_its_slot_back(model, monkeypatch):
    # Found on the GPU: an exception between acquire and release left the slot held, and every later
    # step that came round to it failed ("acquired again before release") -- the loop lived, but half
    # of all steps failed from then on.
    import service.engine.runner as runner_mod

    options = Settings(device="cpu", dtype="float32", pool_slots=2).runner_options()
    engine = Engine(model, store=None, batcher=None, options=options, metrics=Metrics())
    img = prepare_image(data.photo("astronaut.png", 64), model.params, Settings().image_limits)
    real = runner_mod.grid_geometry
    monkeypatch.setattr(runner_mod, "grid_geometry", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.encode_sync([img])
    monkeypatch.setattr(runner_mod, "grid_geometry", real)
    outs = [engine.encode_sync([img])[0] for _ in range(engine.runner.pool.num_slots + 1)]  # every slot, round robin
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_a_step_that_fails_between_staging_and_its_fence_gives_its_slot_back(model, monkeypatch):
    # Before the slot's acquire and release were one block, only run() released it: a step that raised
    # after staging and before run's own try (a wrapped or patched run does) kept its slot for good.
    options = Settings(device="cpu", dtype="float32", pool_slots=2).runner_options()
    engine = Engine(model, store=None, batcher=None, options=options, metrics=Metrics())
    img = prepare_image(data.photo("astronaut.png", 64), model.params, Settings().image_limits)
    monkeypatch.setattr(engine.runner, "run", lambda staged: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.encode_sync([img])
    monkeypatch.undo()
    outs = [engine.encode_sync([img])[0] for _ in range(engine.runner.pool.num_slots + 1)]  # every slot, round robin
    assert all(torch.equal(o, outs[0]) for o in outs)



def test_fault_injection_is_off_unless_asked_and_refuses_unknown_faults(model, monkeypatch):
    # The soak's control run turns the fence off through QVE_FAULT_INJECT; a service must never run so by accident.
    s = Settings(device="cpu", dtype="float32", pool_slots=2)
    assert FaultInjection.from_env({}) == FaultInjection() == s.runner_options().faults
    assert Runner(model, s.runner_options()).pool.fence is True
    monkeypatch.setenv("QVE_FAULT_INJECT", "no-fence")  # the entry points read it; the Runner reads no environment
    assert Runner(model, s.runner_options()).pool.fence is True
    assert Runner(model, s.runner_options(FaultInjection.from_env({"QVE_FAULT_INJECT": "no-fence"}))).pool.fence is False
    both = FaultInjection.from_env({"QVE_FAULT_INJECT": "stall=1000,no-fence"})
    assert both == FaultInjection(stall_cycles=1000, fence=False)
    r = Runner(model, s.runner_options(both))  # a CPU engine has nothing to stall: accepted
    assert r.test_stall_cycles == 0 and r.pool.fence is False
    with pytest.raises(ValueError, match="unknown fault 'no-fense'"):
        FaultInjection.from_env({"QVE_FAULT_INJECT": "no-fense"})


# ---- video -------------------------------------------------------------------------------------------
def _video_fixture() -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parents[2] / "support" / "fixtures" / "video_reference.json").read_text())


@pytest.fixture(scope="module")
def video_checkpoint(tmp_path_factory, tiny_checkpoint):
    """The tiny checkpoint with a video_preprocessor_config.json unlike the defaults (the fixture's 'limits'
    config: fps 3, max 12 frames, its own pixel bounds, CLIP's mean and std)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny-qwen3vl-video")
    shutil.copytree(tiny_checkpoint, path, dirs_exist_ok=True)
    (path / "video_preprocessor_config.json").write_text(json.dumps(_video_fixture()["configs"]["limits"]))
    return path


@pytest.fixture(scope="module")
def video_model(video_checkpoint):
    return load_model(_settings_from_cli(video_checkpoint))


def _clip_cases() -> list[tuple[bytes, dict]]:
    """(the clip, its fixture case) for the fixture's three clips under the 'limits' config."""
    from tests.support import videodata as vd

    out = []
    for case in _video_fixture()["cases"]:
        if case["config"] == "limits":
            s = case["source"]
            out.append((vd.clip(s["codec"], s["container"], frames=s["frames"], fps=s["fps"], width=s["width"],
                                height=s["height"]), case))
    return out


def _prepare_video(blob: bytes, model, limits):
    from service.media.video import read_header
    from service.media.video_preprocess import prepare_video

    return prepare_video(blob, read_header(blob, limits), model.video, limits)


def _video_reference(ckpt, videos) -> list[torch.Tensor]:
    """transformers' vision tower on pixel_values_videos made by OUR patchify_video from the same decoded
    frames. Our pixels are bit-exact with transformers' Qwen3VLVideoProcessor (torchvision backend):
    tests/unit/media/test_video.py's fixture test proves it on these clips and this config."""
    from service.media.video_preprocess import patchify_video, video_lut

    visual = Qwen3VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).model.visual.eval()
    outs = []
    for v, params in videos:
        pixels = patchify_video(torch.from_numpy(v.frames), torch.from_numpy(video_lut(params)), params)
        with torch.no_grad():
            out = visual(pixels, grid_thw=torch.tensor([v.grid_thw]))
        outs.append(torch.cat([out.pooler_output, *out.deepstack_features], dim=1))
    return outs


def test_a_video_equals_transformers_on_its_patchified_frames_for_three_codecs(video_checkpoint, video_model):
    from service.media.params import VideoParams

    settings = _settings_from_cli(video_checkpoint)
    model = video_model
    assert model.video != VideoParams() and model.video.fps == 3 and model.video.max_frames == 12
    cases = _clip_cases()
    videos = [_prepare_video(blob, model, settings.video_limits) for blob, _ in cases]
    for v, (_, case) in zip(videos, cases):
        ref = case["reference"]
        assert list(v.indices) == ref["frames_indices"] and list(v.grid_thw) == ref["video_grid_thw"], case["clip"]
        assert v.timestamps == pytest.approx(ref["timestamps"], abs=1e-9) and v.fps == case["video_fps"]
    engine = Engine(model, store=None, batcher=None, options=settings.runner_options(), metrics=Metrics())
    outs = engine.encode_sync(videos)  # ONE step of three videos
    refs = _video_reference(video_checkpoint, [(v, model.video) for v in videos])
    for v, out, ref, (_, case) in zip(videos, outs, refs, cases):
        assert out.shape == ref.shape == (v.num_tokens, model.spec.out_width), case["clip"]
        diff = (out - ref).abs().max().item()
        print(f"{case['clip']}: max abs diff {diff:.3g} vs transformers")
        assert diff <= 1e-5, f"{case['clip']}: max abs diff {diff}"
    # Images and videos in one step give what each gives alone.
    images = [prepare_image(data.valid_images()[n], model.params, settings.image_limits) for n in PHOTOS[:3]]
    alone = engine.encode_sync(images)
    mixed = engine.encode_sync(images + videos)
    for a, b in zip(alone + outs, mixed):
        assert (a - b).abs().max().item() <= 1e-5


def test_a_video_split_across_steps_is_one_entry_equal_to_one_step(video_checkpoint, video_model, tmp_path):
    from service.engine.batcher import Batcher
    from service.engine.job import EncodeJob
    from service.store.directory import DirectoryStore
    from service.store.format import read_embeddings

    blob, case = _clip_cases()[0]
    args = vars(build_parser().parse_args(["serve", "--model", str(video_checkpoint), "--device", "cpu", "--dtype",
                                           "float32", "--max-batch-tokens", "25"]))
    args.pop("command")
    settings = Settings(**args)
    model = video_model
    video = _prepare_video(blob, model, settings.video_limits)
    assert video.num_tokens == 60 and video.grid_thw == (5, 6, 8)  # 12 tokens a group: 2 groups a step, 3 steps
    whole = Engine(model, store=None, batcher=None, options=settings.runner_options(), metrics=Metrics()).encode_sync(
        [video])[0]
    store = DirectoryStore(tmp_path / "s", 1 << 30, model.model_id, out_hidden_size=model.spec.out_hidden_size,
                           deepstack_levels=model.spec.deepstack_levels)
    batcher = Batcher(settings.batch_limits())
    engine = Engine(model, store, batcher, settings.runner_options(), Metrics())
    engine.start()
    try:
        image = prepare_image(data.valid_images()["astronaut.png"], model.params, settings.image_limits)
        tickets = [batcher.submit("v", EncodeJob("v", video, "ab" * 32), tokens=video.num_tokens),
                   batcher.submit("i", EncodeJob("i", image), tokens=image.num_tokens)]
        stored = [t.future.result(timeout=60) for t in tickets]
    finally:
        batcher.close()
        engine.join(30)
    steps = engine.metrics.registry.get_sample_value("qve_steps_total", {"result": "ok"})
    assert engine.loop.failed_steps == 0 and steps == 4, steps  # the video's three parts, then the image
    assert stored[0].grid_thw == (5, 6, 8) and stored[0].num_tokens == 60 and stored[0].modality == "video"
    got = read_embeddings(tmp_path / "s", "v")
    split = torch.cat([got.main, *got.deepstack], dim=1)
    diff = (split - whole).abs().max().item()
    print(f"split across 3 steps vs one step: max abs diff {diff:.3g}")
    assert diff <= 1e-5, f"split vs one step: max abs diff {diff}"
    assert got.video.frames_indices == tuple(case["reference"]["frames_indices"])
    assert got.video.timestamps == pytest.approx(case["reference"]["timestamps"]) and got.video.fps == 8.0
    assert read_embeddings(tmp_path / "s", "i").modality == "image"

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
from tests import imagedata as data
from tests.checkpoints import PilProcessor
from tests.checkpoints import TEST_MAX_PIXELS, TEST_MIN_PIXELS

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

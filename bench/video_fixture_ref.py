"""The video reference: transformers' own Qwen3VLVideoProcessor (its torchvision backend) on the frames
bench/video_fixture_frames.py wrote, and our path (service/media/video.py, video_preprocess.py) on the
same frames, compared, into the JSON tests/media/test_video.py checks our CPU path against.

    python bench/video_fixture_ref.py FRAMES_DIR OUT_JSON            # needs torchvision: the reference
    python bench/video_fixture_ref.py FRAMES_DIR OUT_JSON --ours-only  # a draft without it (never commit)

Needs only the standard library, numpy, torch, transformers and torchvision (no PyAV, no project
dependency: our modules need only numpy, torch and PIL); run from anywhere. For every clip (FRAMES_DIR/*.npz)
and every config of CONFIGS (limits unlike the defaults, so that frames are resized down and up, an odd
sampled count padded, the per-frame cap on, a clip left at its size), it records what the processor makes
of the clip with video_metadata (fps, total frames) and do_sample_frames=True: frames_indices,
video_grid_thw, the sha256 of pixel_values_videos (float32, C order), its shape, its first and last 8
values, the sha256 of the resized uint8 frames (the processor's own resize, called on the sampled frames),
the prompt's timestamps (Qwen3VLProcessor._calculate_timestamps); then the same from our functions, and
whether each matches. On a machine with CUDA, also the processor's pixel_values with device="cuda" (for
the record: torchvision resizes uint8 on CUDA through float32, not as on the CPU). Exits 1 on a mismatch,
2 where it cannot run (no torchvision, no frames).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import numpy as np  # noqa: E402
import torch  # noqa: E402

from service.media.video import VideoParams, clip_size, sample_indices, timestamps  # noqa: E402
from service.media.video_preprocess import patchify_video, resize_frames, video_grid, video_lut  # noqa: E402

# Video processor configs (video_preprocessor_config.json values): transformers builds its processor from
# one, tests/media/test_video.py our VideoParams (VideoParams.from_config).
CONFIGS = {
    # fps 3, at most 12 frames; the clip's pixels within [65536, 131072]: the 8 and 12 fps clips are resized
    # down, the 25 fps portrait one (4 frames) up; CLIP's mean and std, which float32 does not hold exactly.
    "limits": {"fps": 3, "min_frames": 4, "max_frames": 12,
               "size": {"shortest_edge": 65536, "longest_edge": 131072},
               "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]},
    # the per-frame cap on, at 8 tokens a frame: it, not longest_edge, sets every clip's size.
    "capped": {"size": {"shortest_edge": 4096, "longest_edge": 131072}, "cap_pixels_per_frame": True,
               "max_video_tokens": 8},
    # 4 x 128 x 96 is the whole budget: the portrait clip keeps its size (torchvision does not resample it).
    "native": {"size": {"shortest_edge": 4096, "longest_edge": 4 * 128 * 96}},
}


def sha256(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def summary(indices, grid, resized: np.ndarray, pixels: np.ndarray, stamps) -> dict:
    """resized: uint8 [n, h, w, 3]; pixels: float32 [rows, 3*t*p*p]."""
    assert resized.dtype == np.uint8 and pixels.dtype == np.float32
    return {
        "frames_indices": [int(i) for i in indices],
        "video_grid_thw": [int(g) for g in grid],
        "resized_shape": list(resized.shape),
        "resized_sha256": sha256(resized),
        "pixel_values_shape": list(pixels.shape),
        "pixel_values_sha256": sha256(pixels),
        "first8": [float(v) for v in pixels.reshape(-1)[:8]],
        "last8": [float(v) for v in pixels.reshape(-1)[-8:]],
        "timestamps": [float(t) for t in stamps],
    }


def ours(frames: np.ndarray, fps: float, config: dict) -> tuple[dict, np.ndarray, np.ndarray]:
    params = VideoParams.from_config(config)
    idx = sample_indices(len(frames), fps, params)
    h, w = clip_size(len(idx), frames.shape[1], frames.shape[2], params)
    resized = resize_frames(frames[idx], h, w)
    pixels = patchify_video(torch.from_numpy(resized), torch.from_numpy(video_lut(params)), params).numpy()
    out = summary(idx, video_grid(len(idx), h, w, params), resized, pixels, timestamps(idx, fps, params.temporal_patch_size))
    return out, resized, pixels


def reference(frames: np.ndarray, fps: float, config: dict) -> tuple[dict, np.ndarray, np.ndarray, str | None]:
    """transformers' processor on the frames (on the CPU, its default), its own resize of the sampled frames,
    and the sha256 of its pixel_values with device="cuda" where there is CUDA (else None)."""
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    proc = Qwen3VLVideoProcessor(**config)

    def run(**kw):
        meta = [VideoMetadata(total_num_frames=len(frames), fps=fps)]
        return proc(videos=frames, video_metadata=meta, do_sample_frames=True, return_metadata=True,
                    return_tensors="pt", **kw)

    out = run()
    idx = np.asarray(out["video_metadata"][0].frames_indices).tolist()
    pixels = out["pixel_values_videos"].numpy()
    grid = out["video_grid_thw"][0].tolist()
    # The processor's resize on the sampled frames as its _preprocess hands them over: [1, n, 3, H, W] uint8.
    video = torch.from_numpy(frames[idx]).permute(0, 3, 1, 2).contiguous()[None]
    size = SizeDict(**proc.size) if isinstance(proc.size, dict) else proc.size
    resized = proc.resize(videos=video, size=size, resample=proc.resample, factor=proc.patch_size * proc.merge_size,
                          temporal_factor=proc.temporal_patch_size, cap_pixels_per_frame=bool(proc.cap_pixels_per_frame))
    resized = resized[0].permute(0, 2, 3, 1).contiguous().numpy()  # [n, h, w, 3], as ours
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(idx), fps, proc.temporal_patch_size)
    cuda = sha256(run(device="cuda")["pixel_values_videos"].cpu().numpy()) if torch.cuda.is_available() else None
    return summary(idx, grid, resized, pixels, stamps), resized, pixels, cuda


def compare(theirs: dict, mine: dict, ref_pixels: np.ndarray, our_pixels: np.ndarray,
            ref_resized: np.ndarray, our_resized: np.ndarray) -> dict:
    match = {key: theirs[key] == mine[key] for key in
             ("frames_indices", "video_grid_thw", "resized_sha256", "pixel_values_sha256", "timestamps")}
    if ref_resized.shape == our_resized.shape and not match["resized_sha256"]:
        d = np.abs(ref_resized.astype(np.int16) - our_resized.astype(np.int16))
        match["resized_differ"] = {"values": int((d > 0).sum()), "max_levels": int(d.max())}
    if ref_pixels.shape == our_pixels.shape and not match["pixel_values_sha256"]:
        d = np.abs(ref_pixels.astype(np.float64) - our_pixels.astype(np.float64))
        match["pixel_values_differ"] = {"values": int((d > 0).sum()), "max_abs": float(d.max())}
    return match


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("frames_dir", type=Path)
    ap.add_argument("out_json", type=Path)
    ap.add_argument("--ours-only", action="store_true",
                    help="skip transformers' half (a draft that tests this script; never the fixture)")
    args = ap.parse_args()

    versions = {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cuda": torch.cuda.is_available()}
    if not args.ours_only:
        try:
            import torchvision
            import transformers
        except ImportError as e:
            print(f"the reference is transformers' Qwen3VLVideoProcessor on its torchvision backend: {e}. Install "
                  "transformers and torchvision, or pass --ours-only for a draft without the reference.", file=sys.stderr)
            sys.exit(2)
        versions.update(transformers=transformers.__version__, torchvision=torchvision.__version__)

    clips = sorted(args.frames_dir.glob("*.npz"))
    if not clips:
        print(f"no .npz in {args.frames_dir}: run bench/video_fixture_frames.py {args.frames_dir} first (where PyAV is)",
              file=sys.stderr)
        sys.exit(2)
    cases = []
    for path in clips:
        with np.load(path) as z:
            frames, fps, source = z["frames"], float(z["fps"]), json.loads(str(z["source"]))
        for name, config in CONFIGS.items():
            case = {"clip": path.stem, "config": name, "source": source, "video_fps": fps,
                    "total_frames": len(frames), "frames_shape": list(frames.shape), "frames_sha256": sha256(frames)}
            mine, our_resized, our_pixels = ours(frames, fps, config)
            case["ours"] = mine
            if args.ours_only:
                case["reference"] = case["match"] = None
            else:
                theirs, ref_resized, ref_pixels, cuda = reference(frames, fps, config)
                case["reference"] = theirs
                case["match"] = compare(theirs, mine, ref_pixels, our_pixels, ref_resized, our_resized)
                if cuda is not None:
                    case["cuda_pixel_values_sha256"] = cuda
                    case["match"]["cuda_equals_cpu"] = cuda == theirs["pixel_values_sha256"]
            cases.append(case)
            status = "draft" if args.ours_only else ("MATCH" if all(
                v for k, v in case["match"].items() if k != "cuda_equals_cpu" and isinstance(v, bool)) else "DIFFER")
            print(f"{path.stem:28s} {name:7s} {status:6s} grid {mine['video_grid_thw']} indices {mine['frames_indices']}")

    all_match = None if args.ours_only else all(
        v for c in cases for k, v in c["match"].items() if k != "cuda_equals_cpu" and isinstance(v, bool))
    out = {"made_by": "bench/video_fixture_ref.py" + (" --ours-only (a DRAFT: no reference)" if args.ours_only else ""),
           "versions": versions, "configs": CONFIGS, "all_match": all_match, "cases": cases}
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out_json} ({len(cases)} cases); all match: {all_match}")
    sys.exit(1 if all_match is False else 0)


if __name__ == "__main__":
    main()

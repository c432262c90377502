"""Decoded frames of real test clips, for bench/video_fixture_ref.py to run transformers' video processor on
where PyAV is not (it runs HERE: PyAV and scikit-image's photographs, the `dev` extra).

    python bench/video_fixture_frames.py OUT_DIR

Three clips of tests/videodata.py (pans across a photograph), each of a different codec, container, size
and frame rate, decoded whole with service/media/video.py (every frame: transformers samples them
itself). Writes OUT_DIR/<name>.npz per clip: `frames` (uint8 [n, H, W, 3]), `fps` (the header's rate) and
`source` (the clip's tests/videodata.clip arguments, JSON, from which tests/media/test_video.py makes the
same clip again). About 3 MB in all.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

import numpy as np  # noqa: E402

from service.media.video import VideoLimits, decode_frames, read_header  # noqa: E402
from tests import videodata  # noqa: E402

# name -> tests/videodata.clip arguments. Sizes, rates and lengths chosen so that the fixture's configs
# sample odd and even frame counts and resize both down and up (bench/video_fixture_ref.py's CONFIGS).
CLIPS = {
    "h264_mp4_160x120_8fps": dict(codec="libx264", container="mp4", width=160, height=120, fps=8, frames=24),
    "vp9_webm_200x150_12fps": dict(codec="libvpx-vp9", container="webm", width=200, height=150, fps=12, frames=31),
    "mpeg4_mkv_96x128_25fps": dict(codec="mpeg4", container="matroska", width=96, height=128, fps=25, frames=30),
}


def decode_clip(source: dict) -> tuple[np.ndarray, float]:
    """Every frame of the clip `source` describes, with our decode, and its header's frame rate."""
    blob = videodata.clip(**source)
    header = read_header(blob, VideoLimits())
    return decode_frames(blob, header, list(range(header.frames)), VideoLimits()), header.fps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, source in CLIPS.items():
        frames, fps = decode_clip(source)
        path = args.out_dir / f"{name}.npz"
        np.savez_compressed(path, frames=frames, fps=np.float64(fps), source=np.array(json.dumps(source)))
        print(f"{path}: {frames.shape} at {fps:g} fps, frames sha256 {hashlib.sha256(frames.tobytes()).hexdigest()[:16]}, "
              f"{path.stat().st_size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()

"""vLLM 0.33's own video loading against the encoder's frame sampling (docs/vllm.md, 'Video'): for a video
forwarded with `uuid` = key, vLLM decodes the video itself for its grid and its frame timestamps while the
encoder cache supplies the embeddings, so both must sample the same frames of the same source fps.

vLLM runs in a subprocess on its own install (tests/support/vllm_env.py) with OpenCV, its default video decoder:
its MediaConnector.fetch_video, as its chat parser calls it for a Qwen3-VL model (video_processor
"Qwen3VLVideoProcessor", which picks its `qwen3_vl` loader), on data URLs of real clips (tests/support/videodata.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.media.params import VideoLimits, VideoParams
from service.media.video import read_header, sample_indices, timestamps

av = pytest.importorskip("av", reason="PyAV makes the clips (a base dependency)")

# (codec, container, frames, fps): the encoder tests' three clips, an odd sample count at 30 fps, and a
# clip long enough that fps, not min_frames, decides (100 frames at 25 fps: 8 samples)
CLIPS = [("libx264", "mp4", 24, 8), ("libvpx-vp9", "webm", 24, 8), ("mpeg4", "avi", 24, 8),
         ("libx264", "mp4", 61, 30), ("libvpx-vp9", "webm", 100, 25)]

VLLM_SIDE = r"""
import base64, json, sys
from tests.support import videodata as vd
from vllm.multimodal.media.connector import MediaConnector

clips, settings = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, media_io_kwargs in settings.items():
    connector = MediaConnector(media_io_kwargs=media_io_kwargs)
    rows = []
    for codec, container, frames, fps in clips:
        url = "data:video/mp4;base64," + base64.b64encode(vd.clip(codec, container, frames=frames, fps=fps)).decode()
        decoded, meta = connector.fetch_video(url, video_processor="Qwen3VLVideoProcessor").media
        rows.append({"shape": list(decoded.shape), "total": meta["total_num_frames"], "fps": meta["fps"],
                     "indices": meta["frames_indices"], "backend": meta["video_backend"]})
    out[name] = rows
print(json.dumps(out))
"""

# What docs/vllm.md prescribes: --media-io-kwargs '{"video": {"fps": F, "min_frames": m, "max_frames": M}}'
# from the checkpoint's video_preprocessor_config.json (here transformers' defaults, and a checkpoint at 1 fps);
# and what it warns against: the generic loader, and a checkpoint's fps left to vLLM's default.
PRESCRIBED = {"video": {"fps": 2.0, "min_frames": 4, "max_frames": 768}}
SETTINGS = {"prescribed": PRESCRIBED, "defaults": {}, "one_fps": {"video": {**PRESCRIBED["video"], "fps": 1.0}},
            "generic_loader": {"video": {"video_backend": "opencv"}}}


@pytest.fixture(scope="module")
def vllm_loaded():
    from tests.support.vllm_env import vllm_video_env

    env = vllm_video_env()
    done = subprocess.run([sys.executable, "-c", VLLM_SIDE, json.dumps(CLIPS), json.dumps(SETTINGS)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _encoder(codec, container, frames, fps, params: VideoParams):
    from tests.support import videodata as vd

    header = read_header(vd.clip(codec, container, frames=frames, fps=fps), VideoLimits())
    return header, sample_indices(header.frames, header.fps, params)


@pytest.mark.parametrize("setting,params", [("prescribed", VideoParams()), ("defaults", VideoParams()),
                                            ("one_fps", VideoParams(fps=1.0))])
def test_vllms_loader_samples_the_encoders_frames(vllm_loaded, setting, params):
    """The same frame indices, the same source fps (so the same prompt timestamps) and the same decoded
    frame size (so the same clip size and grid) as the encoder's frames_indices for each clip."""
    for clip, got in zip(CLIPS, vllm_loaded[setting]):
        header, indices = _encoder(*clip, params)
        assert got["backend"] == "opencv", got  # OpenCV decodes; the qwen3_vl loader samples
        assert got["indices"] == indices, (clip, got)
        assert (got["total"], got["fps"]) == (header.frames, header.fps), (clip, got)
        assert got["shape"] == [len(indices), header.height, header.width, 3], (clip, got)
        t = params.temporal_patch_size
        assert timestamps(got["indices"], got["fps"], t) == timestamps(indices, header.fps, t)


def test_what_breaks_the_agreement(vllm_loaded):
    """vLLM's generic loader (`video_backend: opencv`) samples VideoMediaIO's num_frames (32) uniformly, not
    by fps: every frame of a 24-frame clip; and vLLM's loader reads no checkpoint's fps: a checkpoint at
    1 fps needs --media-io-kwargs to say so."""
    generic = [got["indices"] for got in vllm_loaded["generic_loader"]]
    ours = [_encoder(*clip, VideoParams())[1] for clip in CLIPS]
    assert generic[0] == list(range(24)) and ours[0] == [0, 5, 9, 14, 18, 23]
    assert all(g != o for g, o in zip(generic, ours))
    one_fps = [_encoder(*clip, VideoParams(fps=1.0))[1] for clip in CLIPS]
    assert [got["indices"] for got in vllm_loaded["defaults"]] != one_fps

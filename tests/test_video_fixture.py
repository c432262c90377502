"""tests/support/fixtures/make_video_frames.py and make_video_reference.py, the video reference's two halves:
the second runs where there is no PyAV and none of this project's dependencies (a GPU machine with transformers and
torchvision), so it may import only the standard library, numpy, torch, transformers and torchvision, and
our modules only what needs numpy, torch and PIL; run here with every other package refused, its half
without transformers (--ours-only) runs end to end, and its reference half fails clearly without torchvision.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "support" / "fixtures"
REF = FIXTURES / "make_video_reference.py"

# The top-level names of every dependency this project declares, and PyAV and the test tools, but for the
# four the reference machine has (numpy, torch, PIL, transformers): refused in the script's process.
REFUSED = ["av", "fastapi", "uvicorn", "pydantic", "pydantic_settings", "multipart", "simplejpeg", "prometheus_client",
           "httpx", "msgspec", "pybase64", "httptools", "uvloop", "swagger_ui_bundle", "safetensors", "cupy",
           "mooncake", "skimage", "yaml", "hypothesis", "rich", "matplotlib", "torchvision", "transformers"]
BLOCKER = """
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {refused!r}:
            raise ImportError(f"No module named {{name!r}} (refused by the test)")
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _imported(path: Path, *, at_import: bool = False) -> set[str]:
    """Modules `path` imports, but none under `if TYPE_CHECKING:` (annotations, never run); at_import: only
    those importing it runs (none inside a function: media/video.py's PyAV, for one, is the decoder's)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)) or (
                at_import and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            skip |= {id(n) for n in ast.walk(node) if n is not node or isinstance(node, ast.If)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module)
    return out


def test_the_reference_script_imports_only_the_stdlib_numpy_torch_transformers_torchvision():
    allowed = set(sys.stdlib_module_names) | {"numpy", "torch", "transformers", "torchvision", "service"}
    names = _imported(REF)
    assert {n.split(".")[0] for n in names} <= allowed, names
    # ... and importing our modules it imports, to the bottom, only numpy, torch and PIL besides the stdlib
    # (what the script then calls is run with everything else refused, below).
    ours, seen = [n for n in names if n.startswith("service.")], set()
    while ours:
        name = ours.pop()
        if name in seen:
            continue
        seen.add(name)
        path = ROOT / (name.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / name.replace(".", "/") / "__init__.py"
        for dep in _imported(path, at_import=True):
            if dep.startswith("service"):
                ours.append(dep)
            else:
                assert dep.split(".")[0] in set(sys.stdlib_module_names) | {"numpy", "torch", "PIL"}, (name, dep)
    assert {"service.media.video", "service.media.video_preprocess", "service.media.preprocess"} <= seen


@pytest.fixture(scope="module")
def frames_dir(tmp_path_factory):
    pytest.importorskip("av", reason="PyAV decodes the clips (a base dependency)")
    out = tmp_path_factory.mktemp("video-frames")
    subprocess.run([sys.executable, str(FIXTURES / "make_video_frames.py"), str(out)], check=True,
                   capture_output=True, timeout=300)
    return out


def _run_ref(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER.format(refused=REFUSED), str(REF), *args],
                          capture_output=True, text=True, timeout=300, cwd="/")


def test_the_frames_script_writes_three_clips_of_a_few_megabytes(frames_dir):
    import numpy as np

    files = sorted(frames_dir.glob("*.npz"))
    assert [f.stem for f in files] == ["h264_mp4_160x120_8fps", "mpeg4_mkv_96x128_25fps", "vp9_webm_200x150_12fps"]
    assert sum(f.stat().st_size for f in files) < 4e6
    with np.load(files[2]) as z:
        assert z["frames"].shape == (31, 150, 200, 3) and z["frames"].dtype == np.uint8 and float(z["fps"]) == 12.0
        assert json.loads(str(z["source"]))["codec"] == "libvpx-vp9"


def test_our_half_runs_with_only_numpy_torch_and_pil(frames_dir, tmp_path):
    out = tmp_path / "draft.json"
    done = _run_ref(str(frames_dir), str(out), "--ours-only")
    assert done.returncode == 0, done.stderr
    draft = json.loads(out.read_text())
    assert draft["all_match"] is None and "DRAFT" in draft["made_by"] and len(draft["cases"]) == 9
    assert all(c["reference"] is None and c["match"] is None for c in draft["cases"])
    grids = {(c["clip"], c["config"]): c["ours"]["video_grid_thw"] for c in draft["cases"]}
    assert grids[("h264_mp4_160x120_8fps", "limits")] == [5, 6, 8]  # 9 frames (odd: padded), 120x160 down to 96x128
    assert grids[("mpeg4_mkv_96x128_25fps", "limits")] == [2, 10, 8]  # 4 frames, 128x96 up to 160x128
    assert grids[("mpeg4_mkv_96x128_25fps", "native")] == [2, 8, 6]  # at its size: not resampled


def test_the_reference_half_without_torchvision_says_what_it_needs(frames_dir, tmp_path):
    done = _run_ref(str(frames_dir), str(tmp_path / "ref.json"))
    assert done.returncode == 2 and not (tmp_path / "ref.json").exists()
    assert "torchvision backend" in done.stderr and "--ours-only" in done.stderr, done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    done = _run_ref(str(empty), str(tmp_path / "ref.json"), "--ours-only")
    assert done.returncode == 2 and "run tests/support/fixtures/make_video_frames.py" in done.stderr, done.stderr

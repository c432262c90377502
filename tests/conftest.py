import fcntl
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps
from transformers import Qwen3VLForConditionalGeneration

from tests.support import imagedata as data
from tests.support.checkpoints import PilProcessor, make_full_checkpoint
from tests.support.processes import IMAGES

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# Processes the tests start, directly or through the service: servers, decode workers, the forkserver.
_OURS = ("-m service", "multiprocessing.forkserver", "multiprocessing.resource_tracker", "dockerd")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny full Qwen3-VL checkpoint (text + vision, sharded, custom pixel limits) saved by transformers."""
    return make_full_checkpoint(tmp_path_factory.mktemp("tiny-qwen3vl"))


@pytest.fixture(scope="session")
def reference(tiny_checkpoint):
    """transformers' processor + vision tower on the tiny checkpoint for every image of
    tests/processes.IMAGES: name -> (grid_thw, [tokens, 48*3]). One session-wide: the one-process and the
    supervised server tests compare with the same values."""
    blobs = [data.valid_images()[n] for n in IMAGES]
    pil = [ImageOps.exif_transpose(Image.open(io.BytesIO(b))) for b in blobs]
    inputs = PilProcessor.from_pretrained(tiny_checkpoint)(images=pil, return_tensors="pt")
    visual = Qwen3VLForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).model.visual.eval()
    with torch.no_grad():
        out = visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    full = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    refs, offset = {}, 0
    for name, grid in zip(IMAGES, inputs["image_grid_thw"].tolist()):
        n = grid[0] * grid[1] * grid[2] // 4
        refs[name] = (grid, full[offset : offset + n])
        offset += n
    return refs


def _mooncake_import_error() -> str:
    """'' when Mooncake's client imports here, else the import's last line. In a child process: a failed
    import of an extension module would stay failed in this one after the libraries are installed."""
    done = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=120)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"status {done.returncode}"])[-1]


@pytest.fixture(scope="session")
def mooncake_master_binary() -> Path:
    """`mooncake_master`, once Mooncake's client imports here; otherwise the test is skipped saying why.
    The wheel's library links libibverbs even for TCP, which a fresh Debian machine lacks: there, as root
    with apt-get, Debian's libibverbs1 and ibverbs-providers are installed first (after an apt-get update
    if the install fails without one), once per session."""
    why = _mooncake_import_error()
    if "libibverbs" in why and os.geteuid() == 0 and shutil.which("apt-get"):
        # One install at a time: the suite's workers (pytest-xdist) may all get here at once, and apt-get
        # refuses to run beside itself.
        with open("/tmp/qve-tests-apt.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _mooncake_import_error():
                env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
                install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "libibverbs1",
                           "ibverbs-providers"]
                if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
                    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=900)
                    subprocess.run(install, env=env, capture_output=True, timeout=900)
        why = _mooncake_import_error()
    if why:
        pytest.skip(f"Mooncake's client does not import here ({why}): pip install 'qwen3vl-encoder-service[mooncake]'"
                    " and, on Debian, apt-get install libibverbs1 ibverbs-providers")
    found = Path(sys.executable).parent / "mooncake_master"
    if not found.exists():
        found = Path(shutil.which("mooncake_master") or found)
    if not found.exists():
        pytest.skip("Mooncake's client imports, but its mooncake_master is not on PATH nor beside this Python")
    return found


def _start_ticks(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks since boot


def _ppid(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return None


def _ours_to_outlive(pid: str) -> bool:
    """This process or a descendant: those end with it (e.g. the forkserver of in-process servers)."""
    me, seen = str(os.getpid()), 0
    while pid not in (None, "0", "1") and seen < 64:
        if pid == me:
            return True
        pid, seen = _ppid(pid), seen + 1
    return False


_ROOT = str(Path(__file__).resolve().parents[1])


def _in_this_checkout(pid: str) -> bool:
    """Started from this checkout (the tests start everything with it as the working directory). Other
    checkouts on the same machine (another worktree's tests or servers) are not this run's business."""
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False
    return cwd == _ROOT or cwd.startswith(_ROOT + os.sep)


def _leftovers(since_ticks: int) -> list[str]:
    """Processes like ours started during this session that are still alive and no longer ours."""
    found = []
    for pid in (p.name for p in Path("/proc").iterdir() if p.name.isdigit()):
        if _ours_to_outlive(pid) or not _in_this_checkout(pid):
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        start = _start_ticks(pid)
        if start is not None and start >= since_ticks and any(o in cmd for o in _OURS):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(f"{pid}: {cmd[:160]}")
    return found


def pytest_sessionstart(session):
    # The servers the tests start must get Ctrl-C as under a terminal. A run started as a background job
    # of a non-interactive shell (`pytest ... &`) has SIGINT ignored, and its children inherit that: the
    # Ctrl-C tests' servers then drain on SIGINT, re-raise it into SIG_IGN and exit 0 instead of 130.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.platform.startswith("linux"):
        session.config._qve_start_ticks = _start_ticks(str(os.getpid()))


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a process the tests started outlives them (a leak the next run or CI inherits).
    Waits a little first: a server told to stop may take a moment to exit. Checked by the run's main
    process only: while one worker (pytest-xdist) finishes, the others' servers still run; once every
    worker has exited, what one leaked is an orphan, no longer a descendant of the main process."""
    since = getattr(session.config, "_qve_start_ticks", None)
    if since is None or hasattr(session.config, "workerinput"):
        return
    deadline = time.monotonic() + 20
    while (left := _leftovers(since)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        print("\nprocesses started by the tests are still running:\n  " + "\n  ".join(left), file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# The kinds of tests, by where they live and what they need (pyproject.toml declares the markers):
#   tests/unit/    one module of service/ (or kernels/), mirroring its path; tests/system/: the product as a
#                  whole (real processes, the packaging, containers); tests/support/: helpers, no tests
#   gpu            needs a CUDA GPU (skipped without one): the kernels' tests and the *_cuda.py files
#   docker         needs a Docker engine (the compose stacks)
_GPU_FILES = ("tests/unit/kernels/",)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve().relative_to(Path(_ROOT)).as_posix()
        if path.startswith("tests/system/"):
            item.add_marker(pytest.mark.system)
        if path.startswith(_GPU_FILES) or path.endswith("_cuda.py"):
            item.add_marker(pytest.mark.gpu)

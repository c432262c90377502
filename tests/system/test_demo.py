"""`make demo` on a fresh clone: a tiny random checkpoint, the encoder and the LM consumer on it, one chat
answer printed, and nothing left running or on disk. (It runs with this checkout's virtualenv: the
install itself is what every other test of the suite already depends on.)"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.live import without_outer_make

ROOT = Path(__file__).resolve().parents[2]


def _processes_in(folder: Path) -> list[str]:
    """Processes whose working directory or command line is under `folder`."""
    found = []
    for pid in (p.name for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(pid) != os.getpid() and (cwd.startswith(str(folder)) or str(folder) in cmd):
            found.append(f"{pid}: {cmd[:160]}")
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find what is left running")
def test_make_demo_on_a_fresh_clone_answers_and_leaves_nothing(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    venv = Path(sys.executable).parent.parent  # this checkout's .venv (make skips the install: its stamps exist)
    assert (venv / ".installed-serve").exists(), "run through `make test`, which installs the virtualenv"
    # The clone's pyproject.toml gets this checkout's mtime: its fresh one is newer than the stamps, and make
    # would install into this venv again (its editable install then pointing at the clone) before the demo.
    mine = (ROOT / "pyproject.toml").stat()
    if mine.st_mtime_ns > (venv / ".installed-serve").stat().st_mtime_ns:  # (make would reinstall even so)
        pytest.fail("this checkout's pyproject.toml is newer than its virtualenv: run `make install` first (the "
                    "demo's make would install into the venv, pointing its editable install at the clone)")
    os.utime(clone / "pyproject.toml", ns=(mine.st_atime_ns, mine.st_mtime_ns))
    t0 = time.monotonic()
    done = subprocess.run(["make", "-C", str(clone), "demo", f"VENV={venv}", f"ARGS=--workdir {tmp_path / 'work'}"],
                          capture_output=True, text=True, timeout=900,
                          env={**without_outer_make(), "TMPDIR": str(tmp_path)})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "==> installing" not in out, out  # the venv was used as it was
    answer = next(line for line in out.splitlines() if "chat answered:" in line)
    assert '"' in answer and "completion_tokens" in answer, answer  # a generated text and OpenAI's usage counts
    assert "RANDOM weights" in out and "1 cached answer" in out, out  # the consumer's image came from the store
    stored = [line for line in out.splitlines() if "encoder_cache.safetensors" in line]
    assert stored and (tmp_path / "work" / "store").is_dir(), out
    assert list((tmp_path / "work" / "store").glob("*/encoder_cache.safetensors")), "no entry in the store"
    print(f"make demo on a fresh clone: {time.monotonic() - t0:.1f} s")
    assert _processes_in(tmp_path) == [], "the demo left processes running"

"""vLLM (0.33 and 0.34, VERSIONS) beside this project's venv, for tests that drive vLLM's own code on the CPU
(its connector calls, its hasher and image loader; no engine runs). vLLM pins torch 2.14 and transformers < 5.21, which the venv does not have: installing it there
would break every other test. So it goes, without its dependencies, into a directory of its own, with
the few packages its connector modules, its config and its Request import that the venv lacks; a test
runs vLLM's side in a subprocess whose PYTHONPATH puts that directory first (`vllm_env`), on the venv's
torch and transformers (what the connector modules use of them works there).

The directory is kept under ~/.cache (a machine installs once; ~30 s with the 336 MB wheel downloaded,
then nothing) and written whole or not at all (installed beside it, then renamed).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# The vLLM releases the shipped connector and the drop-in are tested against (docs/vllm.md names them).
VERSIONS = ("0.33.0", "0.34.0")
VLLM = f"vllm=={VERSIONS[0]}"
# NOTE: found by importing vllm.distributed.ec_transfer.ec_connector.{base,example_connector,factory},
# vllm.config, vllm.v1.request and vllm.v1.core.sched.output beside the venv; the pins are vLLM 0.33's
# own where it has them, else the versions that worked here; 0.34 takes the same. blake3: their hasher's
# default, for the tests of vLLM's keys.
_SMALL = ["psutil==7.2.2", "pyzmq==27.3.0", "cbor2==6.3.0", "openai-harmony==0.0.8", "openai==3.57.0",
          "sniffio==1.3.1", "cachetools==8.0.2", "cloudpickle==3.1.3", "py-cpuinfo==9.0.0", "xgrammar==0.2.8",
          "apache-tvm-ffi==0.1.11", "partial-json-parser==0.2.1.1.post7", "llguidance==1.7.6"]
PACKAGES = [VLLM, *_SMALL]


def packages(version: str) -> list[str]:
    return [f"vllm=={version}", *_SMALL, "blake3==1.0.11"]

# vLLM's default video decoder (its `opencv` codec; vLLM requires opencv-python-headless >= 4.13), for the
# video-loading test only: its own directory beside vLLM's, so the connector tests' install stays as it is.
OPENCV = ["opencv-python-headless==5.0.0.93"]

_FOUND: dict[str, object] = {}


def side_dir(name: str = VLLM) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "qwen3vl-encoder" / name.replace("==", "-")


def install_side(target: Path, packages: list[str] = PACKAGES) -> str:
    """Install `packages` into `target` unless there already; '' or why it failed (pip's last lines)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    stamp = target / ".complete"
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (another test run on this machine may be installing it now)
        if stamp.exists() and stamp.read_text().split() == packages:
            return ""
        tmp = target.parent / f"{target.name}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                               "--no-deps", "--no-compile", "--target", str(tmp), *packages],
                              capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            return " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:]) or f"pip exited {done.returncode}"
        (tmp / ".complete").write_text("\n".join(packages))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return ""


def vllm_env(version: str = VERSIONS[0]) -> dict[str, str]:
    """The environment of a subprocess that imports vLLM `version` (and this checkout's `service`); skips
    the calling test, saying why, where vLLM cannot be installed here. (A vLLM that installs and then does
    not import fails the test in that subprocess: no missing capability, but a broken set-up.)"""
    if version not in _FOUND:
        wanted = packages(version)
        target = side_dir(wanted[0])
        why = install_side(target, wanted)
        root = str(Path(__file__).resolve().parents[2])
        _FOUND[version] = why or {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), root]),
                                  "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if isinstance(_FOUND[version], str):
        pytest.skip(f"vLLM {version} cannot be installed here ({_FOUND[version]})")
    return dict(_FOUND[version])


def vllm_video_env() -> dict[str, str]:
    """vllm_env() with OpenCV on the path too, so vLLM's video loader decodes as vLLM serving does; skips
    the calling test, saying why, where either cannot be installed here."""
    env = vllm_env()
    if "opencv" not in _FOUND:
        target = side_dir(OPENCV[0])
        _FOUND["opencv"] = install_side(target, OPENCV) or str(target)
    if not os.path.isdir(str(_FOUND["opencv"])):
        pytest.skip(f"OpenCV (vLLM's video decoder) cannot be installed here ({_FOUND['opencv']})")
    env["PYTHONPATH"] = os.pathsep.join([str(_FOUND["opencv"]), env["PYTHONPATH"]])
    return env

"""SGLang (0.5.23 and 0.5.22, VERSIONS) beside this project's venv, for tests that drive SGLang's own language
side on the CPU against the service's SGLang encoder protocol: its receiver, its allow-listed unpickler and its
Qwen-VL processor (tests/support/sglang_side.py; no engine runs). SGLang pins torch 2.14, transformers 5.19
and CUDA kernel packages, which the venv does not have: installing it there would break every other test.
So, as vLLM (tests/support/vllm_env.py), it goes without its dependencies into a directory of its own, and
runs in a subprocess on the venv's torch 2.13 and transformers 5.25 (the receiver and the Qwen-VL processor
import and build on them, and so SGLang's own transformers pin is not installed) with PYTHONPATH:

- tests/support/sglang_stubs: a torchvision stand-in (SGLang and transformers import torchvision at load; the
  registry's torchvision needs a CUDA torch);
- sglang-<version>: the wheel alone;
- sglang-deps: what SGLang imports at load that the venv lacks (one directory for both versions);
- this checkout (its `service`).

The directories are kept under ~/.cache/qwen3vl-encoder (a machine installs once, some seconds to a minute
with the downloads, most of them triton's; then nothing) and written whole or not at all (vllm_env's
installer).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.vllm_env import install_side, side_dir

# The SGLang releases the SGLang drop-in is tested against.
VERSIONS = ("0.5.23", "0.5.22")
# NOTE: found by importing sglang.srt.disaggregation.encoder.receiver, sglang.srt.managers.io_struct,
# sglang.srt.utils.common and the Qwen-VL processor (import_processors, get_mm_processor) beside the venv until
# nothing was missing; the pins are SGLang 0.5.23's own where it has them, else the versions that worked
# here, and 0.5.22 takes the same. triton (~1 GB installed): sglang.srt.utils imports it at load, and the CPU
# torch does not bring it. pyzmq: the side's receiving sockets, whatever the venv has.
DEPS = ["pyzmq==27.3.0", "triton==3.9.0", "orjson==3.13.0", "psutil==7.2.2", "ipython==9.19.1",
        "traitlets==5.16.1", "dill==0.4.1", "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.1",
        "compressed-tensors==0.18.0", "loguru==0.7.3", "gguf==0.19.0", "openai==2.8.0", "distro==1.9.0",
        "sniffio==1.3.1", "partial-json-parser==0.2.1.1.post7", "einops==0.8.2"]
STUBS = Path(__file__).resolve().parent / "sglang_stubs"

_FOUND: dict[str, object] = {}


def _installed(name: str, packages: list[str]) -> Path | str:
    """The directory `name` holding `packages`, installed if need be; or why pip could not."""
    if name not in _FOUND:
        target = side_dir(name)
        _FOUND[name] = install_side(target, packages) or target
    return _FOUND[name]


def sglang_env(version: str = VERSIONS[0]) -> dict[str, str]:
    """The environment of a subprocess (on sys.executable) that imports SGLang `version` (and this checkout's
    `service`); skips the calling test, saying why, where SGLang cannot be installed here. (An SGLang that
    installs and then does not import fails the test in that subprocess: no missing capability, but a
    broken set-up.)"""
    deps = _installed("sglang-deps", DEPS)
    wheel = _installed(f"sglang-{version}", [f"sglang=={version}"])
    for got in (deps, wheel):
        if isinstance(got, str):
            pytest.skip(f"SGLang {version} cannot be installed here ({got})")
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(wheel), str(deps), root]),
            "PYTHONUNBUFFERED": "1",
            # NOTE: the address SGLang's language side advertises to the encoder (prefill_host, receive_url)
            # and binds its PULL sockets on. Loopback, which the service admits by default; SGLang's own
            # default is the first NIC's address.
            "SGLANG_HOST_IP": "127.0.0.1"}

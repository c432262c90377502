"""The CPU compose stack in a real Docker engine (`make compose-test`; skipped in the plain test run).

Builds docker/Dockerfile.cpu, brings up docker/docker-compose.cpu.yml (encoder + LM consumer sharing a
tmpfs store) on a tiny checkpoint, sends a chat request with a photograph to the consumer, and checks
the answer's tokens equal transformers' monolithic Qwen3-VL. Where no engine can run it is skipped with
the reason. What it needs, in order of preference:
  * an engine: DOCKER_HOST or the default socket; else, as root with `dockerd` installed, one started
    here on a private socket (no iptables, no bridge: the stack uses host networking on 127.0.0.1);
  * `docker compose` (v2);
  * a base image: BASE_IMAGE, or python:3.11-slim-bookworm if present or pullable; else, as root with
    `debootstrap`, a Debian bookworm minbase with python3 imported as qve-base:bookworm.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests import imagedata as data
from tests.checkpoints import make_full_checkpoint
from tests.lm_reference import MAX_TOKENS, chat_messages as _messages, monolithic as _monolithic

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker" / "docker-compose.cpu.yml"
LOG = Path(os.environ.get("QVE_COMPOSE_LOG", ROOT / "docker" / "compose-test.log"))

pytestmark = pytest.mark.skipif(os.environ.get("QVE_COMPOSE_TEST") != "1",
                                reason="the compose stack runs with `make compose-test` (QVE_COMPOSE_TEST=1)")


def _log(msg: str) -> None:
    with LOG.open("a") as f:
        f.write(msg.rstrip() + "\n")
    print(msg, flush=True)


def _run(cmd: list[str], env: dict, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    _log(f"$ {' '.join(cmd)}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    _log((r.stdout + r.stderr)[-20000:])
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd[:3]} exited {r.returncode}; see {LOG}")
    return r


def _engine(env: dict):
    """(env with a reachable engine, dockerd process we started or None), or pytest.skip with the reason."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH: install Docker (or Debian's docker.io) to run the compose stack")
    if subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0:
        return env, None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker engine is reachable and none can be started here (needs root and dockerd)")
    run = Path(tempfile.mkdtemp(prefix="qve-dockerd-"))
    sock = run / "docker.sock"
    log = (run / "dockerd.log").open("w")
    proc = subprocess.Popen(["dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none",
                             "--storage-driver=overlay2", "--host", f"unix://{sock}", "--exec-root", str(run / "exec"),
                             "--pidfile", str(run / "docker.pid"), "--data-root", "/var/lib/qve-compose-test"],
                            stdout=log, stderr=subprocess.STDOUT)
    env = {**env, "DOCKER_HOST": f"unix://{sock}"}
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            pytest.skip(f"dockerd could not start here: {(run / 'dockerd.log').read_text()[-500:]}")
        time.sleep(0.5)
    return env, proc


def _base_image(env: dict) -> str:
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    for image in ("python:3.11-slim-bookworm", "qve-base:bookworm"):
        if subprocess.run(["docker", "image", "inspect", image], env=env, capture_output=True).returncode == 0:
            return image
    if subprocess.run(["docker", "pull", "python:3.11-slim-bookworm"], env=env, capture_output=True,
                      timeout=300).returncode == 0:
        return "python:3.11-slim-bookworm"
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip("no base image: python:3.11-slim-bookworm cannot be pulled and debootstrap is not available")
    rootfs = Path(tempfile.mkdtemp(prefix="qve-rootfs-"))
    try:
        _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
              str(rootfs), "http://deb.debian.org/debian"], env, timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", "qve-base:bookworm"], stdin=tar.stdout, env=env, check=True,
                       capture_output=True, timeout=600)
        tar.wait()
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return "qve-base:bookworm"


def _unused_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing listens on now (all held while they are picked).
    NOTE: the one place the tests pick ports and release them (the others bind port 0 and read the port
    the server reports): the compose file names its ports before anything starts (the encoder's --port,
    the consumer's --encoder-url, both healthchecks), with host networking. A port taken meanwhile fails
    `up` with "address already in use" in the log."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def test_compose_stack_answers_like_monolithic_transformers(tmp_path):
    LOG.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QVE_")}
    env, dockerd = _engine(env)
    if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True).returncode != 0:
        pytest.skip("`docker compose` (v2) is not installed")
    model = make_full_checkpoint(tmp_path / "model")
    for p in [tmp_path, *model.rglob("*"), model]:  # the containers run as uid 10001
        p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
    wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0*cp311*.whl")) if Path("/opt/wheels").is_dir() else []
    copied = []
    for w in wheels:  # PyTorch's CPU index may be unreachable; a local CPU wheel then serves
        shutil.copy(w, ROOT / "docker" / "wheels" / w.name)
        copied.append(ROOT / "docker" / "wheels" / w.name)
    enc_port, lm_port = _unused_ports(2)
    env.update(MODEL_DIR=str(model), ENCODER_PORT=str(enc_port), LM_PORT=str(lm_port), BASE_IMAGE=_base_image(env),
               COMPOSE_PROJECT_NAME=f"qve-test-{enc_port}")
    if copied:
        env["TORCH_INDEX_URL"] = ""
    if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
        env["CA_BUNDLE"] = "/etc/ssl/certs/ca-certificates.crt"
    compose = ["docker", "compose", "-f", str(COMPOSE)]
    try:
        t0 = time.monotonic()
        _run([*compose, "build"], env, timeout=1800)
        _log(f"# build: {time.monotonic() - t0:.0f} s")
        t0 = time.monotonic()
        _run([*compose, "up", "-d", "--wait", "--wait-timeout", "600"], env, timeout=700)
        _log(f"# up and healthy: {time.monotonic() - t0:.0f} s")
        _run([*compose, "ps"], env, timeout=60)
        blobs = [data.photo("astronaut.png", max_side=400)]
        r = httpx.post(f"http://127.0.0.1:{lm_port}/v1/chat/completions", timeout=300,
                       json={"messages": _messages(blobs, "describe the image"), "max_tokens": MAX_TOKENS,
                             "return_token_ids": True})
        _log(f"# chat answer {r.status_code}: {r.text[:2000]}")
        assert r.status_code == 200, r.text
        _, expected = _monolithic(model, blobs, "describe the image")
        _log(f"# transformers monolithic tokens: {expected}")
        assert r.json()["choices"][0]["token_ids"] == expected
        _log("# PASS: the compose stack's answer equals transformers' monolithic generation")
    finally:
        _run([*compose, "logs", "--no-color"], env, timeout=120, check=False)
        _run([*compose, "down", "-v"], env, timeout=300, check=False)
        for c in copied:
            c.unlink(missing_ok=True)
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(60)

"""The compose stacks in a real Docker engine (`make compose-test`; skipped in the plain test run).

Builds docker/Dockerfile.cpu (the plain CPU image, and MOONCAKE=1's) and, on a tiny checkpoint, brings up
  * docker/docker-compose.cpu.yml (encoder + LM consumer sharing a tmpfs store, host networking on
    127.0.0.1): a chat request with a photograph to the consumer answers transformers' monolithic
    Qwen3-VL's greedy tokens;
  * docker/docker-compose.mooncake.yml (a Mooncake master, encoder-a, encoder-b and the LM consumer, each
    its own container on a private bridge network): both encoders' segments are in the pool, the
    photograph encoded on encoder-a is `cached: true` with the same `store_key` on encoder-b, and the
    consumer (asking encoder-b, reading encoder-a's segment) answers transformers' tokens too.
Where no engine can run it is skipped with the reason. What it needs, in order of preference:
  * an engine: DOCKER_HOST or the default socket; else, as root (with Debian's docker.io, installed here
    with apt where it is missing, as a fresh CI machine has it), one started here on a private socket (no iptables, no default bridge: the CPU stack uses host networking on
    127.0.0.1; the Mooncake stack's own bridge network and its published loopback ports work without);
  * `docker compose` (v2): Debian 12's docker-compose is 1.29, which rejects the compose files (a
    top-level `name:`, build secrets); v2 comes from Debian trixie's `docker-compose` package unpacked
    with `dpkg-deb -x` (COMPOSE_V2_HINT, docs/operations.md); as root with apt it is fetched that way for
    the run alone (QVE_COMPOSE_V2_FETCH=0: not);
  * a base image: BASE_IMAGE, or python:3.11-slim-bookworm if present or pullable; else, as root with
    `debootstrap`, a Debian bookworm minbase with python3 imported as qve-base:bookworm.
Both stacks run in one engine (the module's `compose_env`), so the second build reuses the first's layers.

Everything the tests create is released by an ExitStack, whatever ends them (a pass, a failure, a
skip): the engine, the base image's root, the copied wheel and a fetched compose v2 by
`_compose_engine`'s after the module's last test, each stack (its containers, network, volumes) by its
test's own; each resource registers its release there before it is created or started. An engine
started here lives in two fresh folders (/tmp/qve-dockerd-*: socket, state, containerd, config;
/var/lib/qve-compose-test-*: images, on disk rather than a tmpfs /tmp), has its containers removed, is
stopped with the containerd it started, and both folders are deleted; the next run starts from scratch.
In an engine that was already running only the compose projects are taken down (their images stay).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import yaml

from service.config import Settings
from tests.support import imagedata as data
from tests.support.checkpoints import make_full_checkpoint
from tests.support.live import data_url
from tests.support.lm_reference import MAX_TOKENS, chat_messages as _messages, monolithic as _monolithic

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_CPU = ROOT / "docker" / "docker-compose.cpu.yml"
COMPOSE_MOONCAKE = ROOT / "docker" / "docker-compose.mooncake.yml"
LOG = Path(os.environ.get("QVE_COMPOSE_LOG", ROOT / "docker" / "compose-test.log"))

# Only the stack itself waits for `make compose-test`; the clean-up test below runs in `make test`.
COMPOSE_TEST = pytest.mark.skipif(os.environ.get("QVE_COMPOSE_TEST") != "1",
                                  reason="the compose stack runs with `make compose-test` (QVE_COMPOSE_TEST=1)")
# Where `docker compose` v2 comes from on Debian 12 (FACTS: bookworm offers only compose 1.29).
COMPOSE_V2_HINT = ("Debian 12's docker-compose is 1.29, which rejects the compose files (top-level `name:`, build "
                   "secrets); take v2 from Debian trixie's docker-compose package: `dpkg-deb -x docker-compose_2.*.deb "
                   "/tmp/compose && mkdir -p ~/.docker/cli-plugins && cp /tmp/compose/usr/libexec/docker/cli-plugins/"
                   "docker-compose ~/.docker/cli-plugins/`; as root with apt, make compose-test fetches it for the "
                   "run alone unless QVE_COMPOSE_V2_FETCH=0 (docs/operations.md)")
# dockerd makes these itself whatever its flags say (its plugin directory); removed again if it made them.
DOCKERD_RUN_DIRS = (Path("/run/docker"), Path("/run/docker/plugins"))
# Where dockerd finds a containerd already running, it uses that one rather than starting its own.
SYSTEM_CONTAINERD = Path("/run/containerd/containerd.sock")


_LOGS_BEGUN: set[Path] = set()


def _log(msg: str) -> None:
    """Into LOG and onto stdout. One log per session: its first line replaces what an earlier run left, and
    says when this one began (each stack's lines end with its own time)."""
    if LOG not in _LOGS_BEGUN:
        _LOGS_BEGUN.add(LOG)
        LOG.write_text(f"# tests/system/test_compose.py, begun {datetime.now(timezone.utc):%Y-%m-%d %H:%M:%S} UTC "
                       f"on {os.cpu_count()} CPU cores\n")
    with LOG.open("a") as f:
        f.write(msg.rstrip() + "\n")
    print(msg, flush=True)


def _run(cmd: list[str], env: dict, timeout: float, check: bool = True, quiet: bool = False,
         cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run `cmd` (from the repository root), it and its output in the log (`quiet`: only the command, for
    output the caller logs what it needs of)."""
    _log(f"$ {shlex.join(cmd)}")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if not quiet or r.returncode != 0:
        _log((r.stdout + r.stderr)[-20000:])
    if check and r.returncode != 0:
        raise AssertionError(f"{cmd[:3]} exited {r.returncode}; see {LOG}")
    return r


def _mounts_under(paths: list[Path]) -> list[str]:
    """Mount points at or below any of `paths`, deepest first (mountinfo escapes spaces as \040)."""
    roots = [os.path.realpath(p) for p in paths]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == r or point.startswith(r + "/") for r in roots):
            points.append(point)
    return sorted(points, key=lambda m: m.count("/"), reverse=True)


def _remove(path: Path) -> None:
    """Delete a folder this test made. Mounts left in it (a killed dockerd's overlays, a failed debootstrap's
    /proc and /sys) are detached first: rmtree would otherwise descend into them and delete what they show."""
    for point in _mounts_under([path]):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=60)
    left = _mounts_under([path])
    assert not left, f"cannot unmount {left}: {path} is left in place rather than deleted through them"
    shutil.rmtree(path)  # no ignore_errors: a folder that cannot be removed is a leak, reported


def _commands() -> dict[int, str]:
    """{pid: command line} of the live processes. Zombies are left out: they hold nothing, and an
    orphan's is reaped (or not) by PID 1, not by this test."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rpartition(")")[2].split()[0] == "Z":
                continue
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # it exited while being read
            continue
        if cmd:  # kernel threads have none
            out[int(proc.name)] = cmd
    return out


def _program(cmd: str) -> str:
    return cmd.split()[0].rpartition("/")[2]


def _processes_naming(paths: list[Path]) -> dict[int, str]:
    """The live processes whose command line names one of `paths`: an engine's dockerd, its containerd
    and shims all name its private folders."""
    return {pid: cmd for pid, cmd in _commands().items() if any(str(p) in cmd for p in paths)}


def _engine_processes(folders: list[Path]) -> dict[int, str]:
    """Of those, the engine's own programs (dockerd, containerd, containerd-shim-*): the only ones ever
    signalled here; anything else naming the folders is reported, not killed."""
    return {pid: cmd for pid, cmd in _processes_naming(folders).items()
            if _program(cmd) == "dockerd" or _program(cmd).startswith("containerd")}


def _end_engine_processes(folders: list[Path], timeout: float) -> None:
    """SIGTERM the engine's processes left, then SIGKILL those still there after `timeout` seconds.
    Looked up afresh before each signal, so a pid that exited and was reused is never signalled."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _engine_processes(folders):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _engine_processes(folders):
            time.sleep(0.2)


def _rmdir_if_empty(path: Path) -> None:
    if path.is_dir() and not any(path.iterdir()):  # one that holds anything is another engine's too
        path.rmdir()


def _reap(proc: subprocess.Popen) -> None:
    if proc.poll() is None:  # Popen knows whether its pid is still its own
        proc.kill()
    proc.wait(30)


def _stop_engine(proc: subprocess.Popen, env: dict, folders: list[Path]) -> None:
    """Stop an engine this test started, leaving none of its containers or processes."""
    if proc.poll() is None:
        # The engine is private, so each of its containers is this test's. Removing them first means
        # nothing runs on under a containerd-shim if dockerd has to be killed below.
        with contextlib.suppress(subprocess.TimeoutExpired):  # an engine that hangs is stopped all the same
            ids = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True, text=True,
                                 timeout=60).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", "-v", *ids], env=env, capture_output=True, timeout=300)
        proc.terminate()  # dockerd stops the containerd it started, then exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    _end_engine_processes(folders, timeout=20)  # a containerd or shim that outlived a killed dockerd
    left = _processes_naming(folders)
    assert not left, f"processes of the engine this test started are still running: {left}"


def _engine(env: dict, release: contextlib.ExitStack) -> dict:
    """env with a reachable engine, or pytest.skip with the reason. An engine started here is released by
    `release` (stopped, its folders deleted), on every path out, the skips below included."""
    reachable = shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0
    if reachable:
        return env
    # A fresh CI machine has no engine (at most the client): install Debian's docker.io where this is root with apt.
    why = _apt_install("docker.io") if shutil.which("docker") is None or shutil.which("dockerd") is None else ""
    if shutil.which("docker") is None:
        pytest.skip(f"no docker client on PATH and docker.io could not be installed ({why}): install Docker (or "
                    "Debian's docker.io) to run the compose stack")
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker engine is reachable and none can be started here (needs root and dockerd"
                    + (f"; {why}" if why else "") + ")")
    run = Path(tempfile.mkdtemp(prefix="qve-dockerd-"))
    release.callback(_remove, run)
    data = Path(tempfile.mkdtemp(prefix="qve-compose-test-", dir="/var/lib"))
    release.callback(_remove, data)
    for d in DOCKERD_RUN_DIRS:  # outer first, so that the inner one is removed first
        if not d.exists():
            release.callback(_rmdir_if_empty, d)
    # A config file of its own: the host's /etc/docker/daemon.json stays out, and the trust key dockerd
    # writes (by default /etc/docker/key.json) goes into the run folder.
    (run / "daemon.json").write_text(json.dumps({"deprecated-key-path": str(run / "key.json")}))
    log = release.enter_context((run / "dockerd.log").open("w"))
    proc = subprocess.Popen(["dockerd", "--config-file", str(run / "daemon.json"), "--iptables=false",
                             "--ip6tables=false", "--bridge=none", "--storage-driver=overlay2",
                             "--host", f"unix://{run / 'docker.sock'}", "--exec-root", str(run / "exec"),
                             "--pidfile", str(run / "docker.pid"), "--data-root", str(data)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    env = {**env, "DOCKER_HOST": f"unix://{run / 'docker.sock'}"}
    release.callback(_stop_engine, proc, env, [run, data])
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.skip(f"dockerd could not start here: {(run / 'dockerd.log').read_text()[-500:]}")
        time.sleep(0.5)
    return env


def _compose_v2_missing(env: dict) -> str | None:
    """Why `docker compose` v2 cannot run the stack, or None when it can."""
    if subprocess.run(["docker", "compose", "version"], env=env, capture_output=True, timeout=60).returncode != 0:
        return f"`docker compose` (v2) is not installed. {COMPOSE_V2_HINT}"
    return None


def _fetch_compose_v2(env: dict, release: contextlib.ExitStack) -> dict:
    """Unless QVE_COMPOSE_V2_FETCH=0: Debian trixie's docker-compose package (v2) fetched and unpacked into a
    folder of this run (/tmp/qve-compose-v2-*), used by this run's docker only (DOCKER_CONFIG): the
    system's packages, apt's own lists and caches and ~/.docker stay as they are; the folder is deleted at
    the end. env unchanged where it cannot be done (not root, no apt-get): the skip then says how."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return env
    work = Path(tempfile.mkdtemp(prefix="qve-compose-v2-"))
    release.callback(_remove, work)
    (work / "lists" / "partial").mkdir(parents=True)
    (work / "debs").mkdir()
    (work / "sources.list").write_text("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] "
                                       "http://deb.debian.org/debian trixie main\n")
    apt = ["apt-get", "-q", "-o", f"Dir::Etc::SourceList={work / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
           "-o", f"Dir::State::Lists={work / 'lists'}", "-o", f"Dir::Cache={work / 'cache'}"]
    _run([*apt, "update"], env, timeout=600)
    _run([*apt, "download", "docker-compose"], env, timeout=600, cwd=work / "debs")
    (deb,) = (work / "debs").glob("docker-compose_*.deb")
    _run(["dpkg-deb", "-x", str(deb), str(work / "unpacked")], env, timeout=300)
    plugins = work / "config" / "cli-plugins"
    plugins.mkdir(parents=True)
    shutil.copy(work / "unpacked" / "usr" / "libexec" / "docker" / "cli-plugins" / "docker-compose", plugins)
    return {**env, "DOCKER_CONFIG": str(work / "config")}


def _base_image(env: dict, release: contextlib.ExitStack) -> str:
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    for image in ("python:3.11-slim-bookworm", "qve-base:bookworm"):
        if subprocess.run(["docker", "image", "inspect", image], env=env, capture_output=True).returncode == 0:
            return image
    if subprocess.run(["docker", "pull", "python:3.11-slim-bookworm"], env=env, capture_output=True,
                      timeout=300).returncode == 0:
        return "python:3.11-slim-bookworm"
    # NOTE: a fresh CI machine has no debootstrap: installed here as docker.io is (a fresh-clone run found
    # the stacks skipped for the want of it).
    why = _apt_install("debootstrap") if shutil.which("debootstrap") is None else ""
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        pytest.skip("no base image: python:3.11-slim-bookworm cannot be pulled and debootstrap is not available"
                    + (f" ({why})" if why else ""))
    rootfs = Path(tempfile.mkdtemp(prefix="qve-rootfs-"))
    release.callback(_remove, rootfs)
    _run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm",
          str(rootfs), "http://deb.debian.org/debian"], env, timeout=1200)
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    release.callback(_reap, tar)  # a tar still writing into an import that failed
    with tar.stdout:  # closed here too, so a failed import leaves tar no reader (it stops on EPIPE)
        subprocess.run(["docker", "import", "-", "qve-base:bookworm"], stdin=tar.stdout, env=env, check=True,
                       capture_output=True, timeout=600)
    assert tar.wait(600) == 0, "tar of the debootstrap root failed"
    return "qve-base:bookworm"


def _unused_ports(n: int) -> list[int]:
    """`n` distinct loopback ports nothing listens on now (all held while they are picked).
    NOTE: the one place the tests pick ports and release them (the others bind port 0 and read the port
    the server reports): a compose file names its host ports before anything starts (the CPU stack's
    --port, --encoder-url and healthchecks, with host networking; the Mooncake stack's published ports).
    A port taken meanwhile fails `up` with "address already in use" in the log."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@contextlib.contextmanager
def _compose_engine(workdir: Path) -> Iterator[dict]:
    """The environment both stacks run in: an engine answering (one started here where none is reachable),
    `docker compose` v2, a base image (BASE_IMAGE), the tiny checkpoint (MODEL_DIR) and the local CPU torch
    wheel where one lies here; or pytest.skip with the reason. Everything it creates is released on leaving
    (the ExitStack), however it is left: each resource registers its release there before it exists."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QVE_")}
    t0 = time.monotonic()
    with contextlib.ExitStack() as release:
        env = _engine(env, release)
        missing = _compose_v2_missing(env)
        if missing and os.environ.get("QVE_COMPOSE_V2_FETCH") != "0":
            env = _fetch_compose_v2(env, release)
            missing = _compose_v2_missing(env)
        if missing:
            pytest.skip(missing)
        model = make_full_checkpoint(workdir / "model")
        for p in [*model.rglob("*"), model]:  # the containers run as uid 10001
            p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
        wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0*cp311*.whl")) if Path("/opt/wheels").is_dir() else []
        for w in wheels:  # PyTorch's CPU index may be unreachable; a local CPU wheel then serves
            copy = ROOT / "docker" / "wheels" / w.name
            release.callback(copy.unlink, missing_ok=True)
            shutil.copy(w, copy)
        env.update(MODEL_DIR=str(model), BASE_IMAGE=_base_image(env, release))
        if wheels:
            env["TORCH_INDEX_URL"] = ""
        if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
            env["CA_BUNDLE"] = "/etc/ssl/certs/ca-certificates.crt"
        _log(f"# engine, compose v2, base image {env['BASE_IMAGE']} and checkpoint ready: {time.monotonic() - t0:.0f} s")
        yield env


@pytest.fixture(scope="module")
def compose_env(tmp_path_factory):
    """One engine for both stacks: the second build reuses the first one's layers (base image, torch, the
    dependencies), which were most of a build here. Released after the module's last test."""
    with _compose_engine(tmp_path_factory.mktemp("compose")) as env:
        yield env


def _stack_up(compose_file: Path, env: dict, release: contextlib.ExitStack, **variables: int) -> list[str]:
    """Build `compose_file`'s images and start its stack, every service healthy, as a project named after
    the file and its lowest port; its logs (into LOG) and `down -v` are registered in `release` first. Returns the
    `docker compose` command that names the stack; `variables` (its ports) are added to `env`."""
    env.update({k: str(v) for k, v in variables.items()},
               COMPOSE_PROJECT_NAME=f"qve-{compose_file.stem.rpartition('.')[2]}-{min(variables.values())}")
    compose = ["docker", "compose", "--ansi", "never", "-f", str(compose_file)]  # (a log without escapes)
    release.callback(_run, [*compose, "down", "-v"], env, timeout=300, check=False)
    release.callback(_run, [*compose, "logs", "--no-color"], env, timeout=120, check=False)
    t0 = time.monotonic()
    _run([*compose, "build"], env, timeout=1800)
    _log(f"# build: {time.monotonic() - t0:.0f} s")
    t0 = time.monotonic()
    _run([*compose, "up", "-d", "--wait", "--wait-timeout", "600"], env, timeout=700)
    _log(f"# up and healthy: {time.monotonic() - t0:.0f} s")
    _run([*compose, "ps"], env, timeout=60)
    return compose


def _chat_answers_like_monolithic(lm_port: int, model: Path) -> None:
    """A chat request with a photograph to the consumer on `lm_port`: its greedy tokens are transformers'."""
    blobs = [_photo()]
    r = httpx.post(f"http://127.0.0.1:{lm_port}/v1/chat/completions", timeout=300,
                   json={"messages": _messages(blobs, "describe the image"), "max_tokens": MAX_TOKENS,
                         "return_token_ids": True})
    _log(f"# chat answer {r.status_code}: {r.text[:2000]}")
    assert r.status_code == 200, r.text
    _, expected = _monolithic(model, blobs, "describe the image")
    _log(f"# transformers monolithic tokens: {expected}")
    assert r.json()["choices"][0]["token_ids"] == expected


def _photo() -> bytes:
    return data.photo("astronaut.png", max_side=400)


@COMPOSE_TEST
def test_compose_stack_answers_like_monolithic_transformers(compose_env):
    t0 = time.monotonic()
    _log("# ---- docker/docker-compose.cpu.yml: the encoder and the LM consumer, one tmpfs store")
    env = dict(compose_env)
    # What the stack creates is released here (last created, first released), however the test ends.
    with contextlib.ExitStack() as release:
        enc_port, lm_port = _unused_ports(2)
        _stack_up(COMPOSE_CPU, env, release, ENCODER_PORT=enc_port, LM_PORT=lm_port)
        _chat_answers_like_monolithic(lm_port, Path(env["MODEL_DIR"]))
        _log(f"# PASS: the compose stack's answer equals transformers' monolithic generation "
             f"({time.monotonic() - t0:.0f} s, the stack's build included)")


def _service_settings(compose_file: Path, service: str) -> Settings:
    """What `serve` reads from a service's command in `compose_file` (its defaults interpolated)."""
    from service.__main__ import build_parser

    argv = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(a)) for a in yaml.safe_load(compose_file.read_text())
            ["services"][service]["command"]]
    flags = vars(build_parser().parse_args(argv))
    assert flags.pop("command") == "serve"
    return Settings(**flags)


def _pool_metrics(compose: list[str], env: dict) -> dict[str, float]:
    """The Mooncake master's own gauges (its /metrics, on its loopback: read inside its container), and its
    one-line summary into the log."""
    code = ("import urllib.request as u; g = lambda p: u.urlopen('http://127.0.0.1:9003' + p, timeout=4).read()"
            ".decode(); print(g('/metrics/summary').split(' | Requests')[0]); print(g('/metrics'))")
    out = _run([*compose, "exec", "-T", "master", "python", "-c", code], env, timeout=60, quiet=True).stdout
    _log(f"# pool: {out.splitlines()[0]}")
    return {k: float(v) for k, _, v in (line.partition(" ") for line in out.splitlines()) if k.startswith("master_")}


def _encode(port: int, blob: bytes) -> dict:
    r = httpx.post(f"http://127.0.0.1:{port}/encode", timeout=300,
                   json={"images": [{"type": "image_url", "image_url": {"url": data_url(blob)}}]})
    _log(f"# /encode on 127.0.0.1:{port}: {r.status_code} {r.text[:1000]}")
    assert r.status_code == 200, r.text
    (item,) = r.json()["items"]
    return item


def _sample(port: int, sample: str) -> float:
    """One sample of an encoder's /metrics, e.g. `qve_images_total{outcome="encoded"}` (0 where it has
    none: a labelled counter appears once it is first counted)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(sample + " "))


@COMPOSE_TEST
def test_mooncake_stack_shares_entries_across_encoders_and_answers_like_monolithic_transformers(compose_env):
    t0 = time.monotonic()
    _log("# ---- docker/docker-compose.mooncake.yml: a Mooncake master, encoder-a, encoder-b, the LM consumer")
    env = dict(compose_env)
    with contextlib.ExitStack() as release:
        a_port, b_port, lm_port = _unused_ports(3)
        compose = _stack_up(COMPOSE_MOONCAKE, env, release, ENCODER_A_PORT=a_port, ENCODER_B_PORT=b_port,
                            LM_PORT=lm_port)
        # Both encoders joined the pool: its capacity is their two segments.
        segments = [_service_settings(COMPOSE_MOONCAKE, s).mooncake_segment_bytes for s in ("encoder-a", "encoder-b")]
        assert _pool_metrics(compose, env)["master_total_capacity_bytes"] == sum(segments)
        # The photograph, encoded on encoder-a, is a hit on encoder-b, which encodes nothing.
        first = _encode(a_port, _photo())
        assert first["cached"] is False and first["store_key"].endswith("@id:" + first["key"])
        again = _encode(b_port, _photo())
        assert again["cached"] is True and again["store_key"] == first["store_key"]
        assert _pool_metrics(compose, env)["master_key_count"] >= 2  # the value and its companion
        # The consumer asks encoder-b (another hit) and reads the entry from encoder-a's segment.
        _chat_answers_like_monolithic(lm_port, Path(env["MODEL_DIR"]))
        assert _sample(b_port, 'qve_images_total{outcome="encoded"}') == 0
        assert _sample(b_port, 'qve_images_total{outcome="cached"}') == 2
        _log(f"# PASS: the Mooncake stack's entries are shared across encoders and its answer equals "
             f"transformers' monolithic generation ({time.monotonic() - t0:.0f} s, the stack's build included)")


_INSTALL_TRIED: dict[str, str] = {}  # (once per session) package -> what installing it answered


def _apt_install(package: str) -> str:
    """Install a Debian package (docker.io, debootstrap) where this is root with apt: a fresh CI machine has
    neither. '' when it is installed afterwards, else why not. Services the package would start are not
    started (a policy-rc.d that refuses them for the install's length): the tests start their own engine."""
    if package in _INSTALL_TRIED:
        return _INSTALL_TRIED[package]
    answer = ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        answer = "not root with apt-get"
    else:
        policy = Path("/usr/sbin/policy-rc.d")
        placed = not policy.exists()
        if placed:
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
        try:
            env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
            cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:  # a fresh machine's package lists may be empty
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                answer = f"apt-get install {package} failed: {done.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            answer = f"apt-get install {package} took over 10 minutes"
        finally:
            if placed:
                policy.unlink()
    _INSTALL_TRIED[package] = answer
    return answer


@pytest.mark.parametrize("outcome", ["skip", "failure", "dockerd killed"])
def test_a_compose_test_ending_after_it_started_dockerd_leaves_no_process_or_folder(outcome, tmp_path, monkeypatch):
    """Issue 20: `make compose-test` started dockerd, then skipped (no compose v2) outside its clean-up, and
    dockerd, containerd, /tmp/qve-dockerd-* and /var/lib/qve-compose-test stayed. Here the stack tests'
    engine (`_compose_engine`, which their fixture enters) is set up, with an engine of its own, up to its
    compose v2 check; the check, once that engine answers, skips, or fails, or kills dockerd with SIGKILL
    and fails (then its data root stays mounted and its containerd may outlive it: the clean-up must still
    detach and end them). Afterwards none of the engine's processes or folders is left."""
    tools = ("docker", "dockerd", "containerd")
    why = _apt_install("docker.io") if any(shutil.which(t) is None for t in tools) else ""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        pytest.skip("the compose test starts an engine of its own only as root with Debian's docker.io installed "
                    f"(apt-get install docker.io); here: {'not root' if os.geteuid() else 'no ' + ', '.join(missing)}"
                    + (f" ({why})" if why else ""))
    # DOCKER_HOST on a socket nobody listens on: the stack tests then start their own engine, as on a
    # machine with docker.io installed and no daemon running. Its log goes to tmp_path, not the committed one.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'nobody.sock'}")
    monkeypatch.setenv("QVE_COMPOSE_V2_FETCH", "0")  # the check below stands in for compose v2: nothing fetched
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "LOG", tmp_path / "compose-test.log")
    seen = {}

    def compose_v2_check(env: dict) -> str:
        run = Path(env["DOCKER_HOST"].removeprefix("unix://")).parent
        info = subprocess.run(["docker", "info", "--format", "{{.DockerRootDir}}"], env=env, capture_output=True,
                              text=True, timeout=30)
        seen.update(run=run, data=Path(info.stdout.strip()), processes=_processes_naming([run]))
        if outcome == "dockerd killed":
            (dockerd,) = [pid for pid, cmd in seen["processes"].items() if _program(cmd) == "dockerd"]
            os.kill(dockerd, signal.SIGKILL)
            raise AssertionError("forced: dockerd killed")
        if outcome == "failure":
            raise AssertionError("forced: a failure after dockerd started")
        return "forced: `docker compose` v2 made to look missing"

    monkeypatch.setattr(this, "_compose_v2_missing", compose_v2_check)
    made_by_dockerd = [*DOCKERD_RUN_DIRS, Path("/etc/docker/key.json")]
    absent_before = [p for p in made_by_dockerd if not p.exists()]

    raised = pytest.skip.Exception if outcome == "skip" else AssertionError
    with pytest.raises(raised, match="forced"), this._compose_engine(tmp_path):
        pass

    # It got as far as an engine of its own, answering: its dockerd and the containerd that started.
    names = sorted(_program(cmd) for cmd in seen["processes"].values())
    assert names == (["dockerd"] if SYSTEM_CONTAINERD.exists() else ["containerd", "dockerd"]), seen["processes"]
    assert seen["run"].parent == Path(tempfile.gettempdir()) and seen["run"].name.startswith("qve-dockerd-")
    assert seen["data"].parent == Path("/var/lib") and seen["data"].name.startswith("qve-compose-test-")
    # And nothing of it is left: no process, no mount, no folder.
    assert _processes_naming([seen["run"], seen["data"]]) == {}
    assert _mounts_under([seen["run"], seen["data"]]) == []
    assert not seen["run"].exists() and not seen["data"].exists()
    if not any(_program(cmd) == "dockerd" for cmd in _commands().values()):
        # (while another engine runs, another checkout's test say, these may be its own)
        assert [p for p in absent_before if p.exists()] == []

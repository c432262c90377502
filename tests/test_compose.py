"""The CPU compose stack in a real Docker engine (`make compose-test`; skipped in the plain test run).

Builds docker/Dockerfile.cpu, brings up docker/docker-compose.cpu.yml (encoder + LM consumer sharing a
tmpfs store) on a tiny checkpoint, sends a chat request with a photograph to the consumer, and checks
the answer's tokens equal transformers' monolithic Qwen3-VL. Where no engine can run it is skipped with
the reason. What it needs, in order of preference:
  * an engine: DOCKER_HOST or the default socket; else, as root with `dockerd` installed, one started
    here on a private socket (no iptables, no bridge: the stack uses host networking on 127.0.0.1);
  * `docker compose` (v2): Debian 12's docker-compose is 1.29, which rejects the compose files (a
    top-level `name:`, build secrets); v2 comes from Debian trixie's `docker-compose` package unpacked
    with `dpkg-deb -x` (COMPOSE_V2_HINT, docs/operations.md);
  * a base image: BASE_IMAGE, or python:3.11-slim-bookworm if present or pullable; else, as root with
    `debootstrap`, a Debian bookworm minbase with python3 imported as qve-base:bookworm.

Everything the test creates is released in one place, the test's ExitStack, whatever ends it (a pass,
a failure, a skip): each resource registers its release there before it is created or started. An
engine started here lives in two fresh folders (/tmp/qve-dockerd-*: socket, state, containerd, config;
/var/lib/qve-compose-test-*: images, on disk rather than a tmpfs /tmp), has its containers removed, is
stopped with the containerd it started, and both folders are deleted; the next run starts from scratch.
In an engine that was already running only the compose project is taken down (its images stay there).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
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

# Only the stack itself waits for `make compose-test`; the clean-up test below runs in `make test`.
COMPOSE_TEST = pytest.mark.skipif(os.environ.get("QVE_COMPOSE_TEST") != "1",
                                  reason="the compose stack runs with `make compose-test` (QVE_COMPOSE_TEST=1)")
# Where `docker compose` v2 comes from on Debian 12 (FACTS: bookworm offers only compose 1.29).
COMPOSE_V2_HINT = ("Debian 12's docker-compose is 1.29, which rejects the compose files (top-level `name:`, build "
                   "secrets); take v2 from Debian trixie's docker-compose package: `dpkg-deb -x docker-compose_2.*.deb "
                   "/tmp/compose && mkdir -p ~/.docker/cli-plugins && cp /tmp/compose/usr/libexec/docker/cli-plugins/"
                   "docker-compose ~/.docker/cli-plugins/` (docs/operations.md)")
# dockerd makes these itself whatever its flags say (its plugin directory); removed again if it made them.
DOCKERD_RUN_DIRS = (Path("/run/docker"), Path("/run/docker/plugins"))
# Where dockerd finds a containerd already running, it uses that one rather than starting its own.
SYSTEM_CONTAINERD = Path("/run/containerd/containerd.sock")


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
    if shutil.which("docker") is None:
        pytest.skip("no docker client on PATH: install Docker (or Debian's docker.io) to run the compose stack")
    if subprocess.run(["docker", "info"], env=env, capture_output=True, timeout=30).returncode == 0:
        return env
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.skip("no Docker engine is reachable and none can be started here (needs root and dockerd)")
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


def _base_image(env: dict, release: contextlib.ExitStack) -> str:
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
    the server reports): the compose file names its ports before anything starts (the encoder's --port,
    the consumer's --encoder-url, both healthchecks), with host networking. A port taken meanwhile fails
    `up` with "address already in use" in the log."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@COMPOSE_TEST
def test_compose_stack_answers_like_monolithic_transformers(tmp_path):
    LOG.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("QVE_")}
    # The one place where what this test creates is released (last created, first released), however
    # the test ends; every resource below is registered here before it exists.
    with contextlib.ExitStack() as release:
        env = _engine(env, release)
        missing = _compose_v2_missing(env)
        if missing:
            pytest.skip(missing)
        model = make_full_checkpoint(tmp_path / "model")
        for p in [tmp_path, *model.rglob("*"), model]:  # the containers run as uid 10001
            p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
        wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0*cp311*.whl")) if Path("/opt/wheels").is_dir() else []
        for w in wheels:  # PyTorch's CPU index may be unreachable; a local CPU wheel then serves
            copy = ROOT / "docker" / "wheels" / w.name
            release.callback(copy.unlink, missing_ok=True)
            shutil.copy(w, copy)
        enc_port, lm_port = _unused_ports(2)
        env.update(MODEL_DIR=str(model), ENCODER_PORT=str(enc_port), LM_PORT=str(lm_port),
                   BASE_IMAGE=_base_image(env, release), COMPOSE_PROJECT_NAME=f"qve-test-{enc_port}")
        if wheels:
            env["TORCH_INDEX_URL"] = ""
        if Path("/etc/ssl/certs/ca-certificates.crt").is_file():
            env["CA_BUNDLE"] = "/etc/ssl/certs/ca-certificates.crt"
        compose = ["docker", "compose", "-f", str(COMPOSE)]
        release.callback(_run, [*compose, "down", "-v"], env, timeout=300, check=False)
        release.callback(_run, [*compose, "logs", "--no-color"], env, timeout=120, check=False)
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


_INSTALL_TRIED: dict[str, str] = {}  # (once per session) what installing docker.io answered


def _install_docker_io() -> str:
    """Install Debian's docker.io where this is root with apt (a fresh CI machine has only the client's
    name on it, if that): '' when it is there afterwards, else why not. Its services are not started
    (a policy-rc.d that refuses them for the install's length): the tests start their own engine."""
    if "answer" in _INSTALL_TRIED:
        return _INSTALL_TRIED["answer"]
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
            cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io"]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:  # a fresh machine's package lists may be empty
                subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                answer = f"apt-get install docker.io failed: {done.stderr.strip()[-300:]}"
        except subprocess.TimeoutExpired:
            answer = "apt-get install docker.io took over 10 minutes"
        finally:
            if placed:
                policy.unlink()
    _INSTALL_TRIED["answer"] = answer
    return answer


@pytest.mark.parametrize("outcome", ["skip", "failure", "dockerd killed"])
def test_a_compose_test_ending_after_it_started_dockerd_leaves_no_process_or_folder(outcome, tmp_path, monkeypatch):
    """Issue 20: `make compose-test` started dockerd, then skipped (no compose v2) outside its clean-up, and
    dockerd, containerd, /tmp/qve-dockerd-* and /var/lib/qve-compose-test stayed. Here the compose test
    itself runs, with an engine of its own, up to its compose v2 check; the check, once that engine
    answers, skips, or fails, or kills dockerd with SIGKILL and fails (then its data root stays mounted
    and its containerd may outlive it: the clean-up must still detach and end them). Afterwards none of
    the engine's processes or folders is left."""
    tools = ("docker", "dockerd", "containerd")
    why = _install_docker_io() if any(shutil.which(t) is None for t in tools) else ""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        pytest.skip("the compose test starts an engine of its own only as root with Debian's docker.io installed "
                    f"(apt-get install docker.io); here: {'not root' if os.geteuid() else 'no ' + ', '.join(missing)}"
                    + (f" ({why})" if why else ""))
    # DOCKER_HOST on a socket nobody listens on: the compose test then starts its own engine, as on a
    # machine with docker.io installed and no daemon running. Its log goes to tmp_path, not the committed one.
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'nobody.sock'}")
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
    with pytest.raises(raised, match="forced"):
        this.test_compose_stack_answers_like_monolithic_transformers(tmp_path)

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

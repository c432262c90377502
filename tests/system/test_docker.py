"""Deployment files, checked by parsing (no Docker engine runs where the tests do).

docker/Dockerfile, docker/docker-compose.yml and .dockerignore must agree with each other and with the
code: every CLI flag and QVE_* variable they use is a real setting with a valid value, the store path
and port are the same everywhere, the store is shared RAM that the consumer can only read, and the
service is published on the host's loopback only. The CPU stacks' files (docker/Dockerfile.cpu,
docker/docker-compose.cpu.yml, docker/docker-compose.mooncake.yml) are checked against the code the same
way, and so are the Makefile and .ci/run.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from service.config import Settings
from tests.support.live import without_outer_make

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "docker-compose.yml"


# ---- parsing helpers -------------------------------------------------------------------------------
def dockerfile(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") or (not buf and not line.strip()):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        instr, _, args = full.partition(" ")
        out.append((instr.upper(), args.strip()))
    return out


def instr(name: str) -> list[str]:
    return [args for i, args in dockerfile() if i == name]


def exec_form(name: str) -> list[str]:
    (args,) = instr(name)[-1:]  # the last one is the one in force
    assert args.startswith("["), f"{name} should use the exec (JSON) form so signals reach python"
    return json.loads(args)


def arg_default(name: str) -> str:
    for a in instr("ARG"):
        key, _, value = a.partition("=")
        if key == name:
            return value
    raise AssertionError(f"no ARG {name} in the Dockerfile")


def interpolate(value):
    """Compose's ${VAR:-default} with VAR unset, as on a machine with no .env file."""
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        assert m.group(2) is not None, f"${{{m.group(1)}}} has no default: the file does not work without a .env"
        return m.group(2)

    return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", sub, value)


def flag_pairs(argv: list[str]) -> dict[str, str | None]:
    """--name value / --name=value / bare --name -> {name: value or None}."""
    out, i = {}, 0
    while i < len(argv):
        tok = argv[i]
        assert tok.startswith("--"), f"unexpected positional argument {tok!r} in {argv}"
        name, eq, value = tok[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            else:
                value = None
        out[name] = value
        i += 1
    return out


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.partition("=")[::2] for e in env)
    return {k: str(interpolate(v)) for k, v in env.items()}


def mounts(service: dict) -> list[dict]:
    """Volume mounts in compose's long syntax, whichever syntax the file uses."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            v = {"type": "volume", "source": parts[0], "target": parts[1], "read_only": "ro" in parts[2:]}
        out.append(v)
    return out


def size_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)b?", text.strip().lower())
    assert m, f"cannot read size {text!r}"
    return int(m.group(1)) * 1024 ** "_kmg".index(m.group(2) or "_")


def healthcheck_code(test: list[str]) -> str:
    """The Python source of a healthcheck `python -c CODE`; asserts that it is one."""
    assert test[:2] == ["python", "-c"], f"healthchecks use the image's python (no curl in it), got {test}"
    compile(test[2], "<healthcheck>", "exec")
    return test[2]


def url_in(code: str) -> str:
    (url,) = re.findall(r"https?://[^'\"\s]+", code)
    return url


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("QVE_"):
            monkeypatch.delenv(k)
    return monkeypatch


def encoder_argv(services) -> list[str]:
    enc = services["encoder"]
    assert enc.get("entrypoint") in (None, exec_form("ENTRYPOINT"))
    return [interpolate(a) for a in enc.get("command", exec_form("CMD"))]


def store_path() -> str:
    return flag_pairs(exec_form("CMD"))["store"]


def container_port() -> int:
    (expose,) = instr("EXPOSE")
    return int(expose.split("/")[0])


# ---- the Dockerfile --------------------------------------------------------------------------------
def test_dockerfile_base_is_cuda12_with_python():
    (base,) = instr("FROM")
    image = arg_default("BASE_IMAGE") if base == "${BASE_IMAGE}" else base
    assert re.search(r"cuda12\.\d+", image), image
    assert image.startswith("pytorch/pytorch:") or "cudnn-runtime" in image, image


def test_dockerfile_installs_gpu_extra_and_keeps_the_base_torch():
    runs = " ".join(instr("RUN"))
    assert re.search(r"pip install [^&]*\"\.\[gpu\]\"", runs), "the image must install the project with .[gpu]"
    # The pin that stops pip from replacing the base image's CUDA torch applies to every install.
    for m in re.finditer(r"pip install ([^&]*)", runs):
        assert "--constraint" in m.group(1), m.group(0)


def test_dockerfile_copies_what_the_package_needs_and_dockerignore_keeps_it():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    copied = set()
    for c in instr("COPY"):
        args = [a for a in c.split() if not a.startswith("--")]
        copied.update(a.rstrip("/") for a in args[:-1])
    needed = {"pyproject.toml"}
    find = project["tool"]["setuptools"]["packages"]["find"]
    for name in (p.rstrip("*") for p in find["include"]):  # a package at the root, or the folder `where` holding it
        (where,) = [w for w in find.get("where", ["."]) if (ROOT / w / name).is_dir()]
        needed.add(name if where == "." else where)
    if "readme" in project["project"]:
        needed.add(project["project"]["readme"])
    assert needed <= copied, f"the Dockerfile does not COPY {sorted(needed - copied)}"
    for path in needed:
        assert (ROOT / path).exists(), f"{path} is copied into the image but missing from the repository"

    ignore = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [p.lstrip("/") for p in ignore if p and not p.startswith("#")]
    assert {".venv", ".git"} <= set(ignore)
    for path in needed:
        for pat in ignore:
            pat = pat.removeprefix("**/")
            assert not (fnmatch.fnmatch(path, pat) or path.startswith(pat + "/")), f".dockerignore {pat!r} drops {path}"


def test_dockerfile_runs_as_a_non_root_user_matching_the_store_volume(compose):
    user = instr("USER")[-1]
    assert user.split(":")[0] not in ("root", "0"), user
    uid = arg_default("APP_UID")
    assert any("--uid ${APP_UID}" in r and user in r for r in instr("RUN")), "USER must be the user created with APP_UID"
    (opts,) = [v["driver_opts"]["o"] for v in compose["volumes"].values()]
    assert f"uid={uid}" in opts.split(","), "the tmpfs store volume must be writable by the image's user"


def test_dockerfile_entrypoint_cmd_use_real_settings(clean_env):
    assert exec_form("ENTRYPOINT") == ["python", "-m", "service", "serve"]
    flags = flag_pairs(exec_form("CMD"))
    assert flags["host"] == "0.0.0.0"  # inside the container only ...
    assert Settings.model_fields["host"].default == "127.0.0.1"  # ... the service's own default stays loopback
    check_serve_argv(exec_form("CMD"))


def test_dockerfile_port_and_healthcheck_agree():
    port = container_port()
    assert int(flag_pairs(exec_form("CMD"))["port"]) == port
    (hc,) = instr("HEALTHCHECK")
    options, _, cmd = hc.partition(" CMD ")
    assert "--start-period" in options, "loading the model takes a while; give it a start period"
    url = url_in(healthcheck_code(json.loads(cmd)))
    assert urlsplit(url).port == port and urlsplit(url).path == "/health"


def test_dockerfile_env_names_settings_and_agrees_with_cmd(clean_env):
    env = {}
    for line in instr("ENV"):
        env.update(re.findall(r"\b(QVE_\w+)=(\S+)", line))
    for name, value in env.items():
        assert name.removeprefix("QVE_").lower() in Settings.model_fields, name
        clean_env.setenv(name, value)
    Settings()  # valid values
    # `docker run IMAGE --flags` replaces CMD: the environment must then say what CMD said.
    for flag, value in flag_pairs(exec_form("CMD")).items():
        assert env.get("QVE_" + flag.replace("-", "_").upper()) == value, f"ENV and CMD disagree on --{flag}"


# ---- docker-compose.yml ----------------------------------------------------------------------------
def check_serve_argv(argv: list[str]) -> None:
    """`serve` accepts these arguments, each is a Settings field, and the values validate together."""
    from service.__main__ import build_parser

    build_parser().parse_args(["serve", *argv])  # exits (fails the test) on an unknown flag or bad choice
    check_settings_flags(flag_pairs(argv))


def check_settings_flags(flags: dict[str, str | None]) -> None:
    """Every flag is a Settings field (bool flags may be --no-x), and the values validate together."""
    values = {}
    for name, value in flags.items():
        field = name.replace("-", "_")
        if value is None:  # a boolean switch
            field, value = (field[3:], False) if field.startswith("no_") else (field, True)
        assert field in Settings.model_fields, f"--{name} is not a setting (service/config.py)"
        values[field] = value
    Settings(**values)


def test_compose_has_encoder_and_consumer(services):
    assert {"encoder", "consumer"} <= set(services)
    for svc in ("encoder", "consumer"):
        build = services[svc].get("build")
        assert build and (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert services["encoder"]["image"] == services["consumer"]["image"], "the consumer runs the encoder's image"


def test_compose_store_is_one_tmpfs_volume_shared_read_only(compose, services):
    store = store_path()
    (enc,) = [m for m in mounts(services["encoder"]) if m["target"] == store]
    (con,) = [m for m in mounts(services["consumer"]) if m["target"] == store]
    assert enc["type"] == con["type"] == "volume" and enc["source"] == con["source"]
    assert not enc.get("read_only") and con.get("read_only") is True
    opts = compose["volumes"][enc["source"]]["driver_opts"]
    assert opts["type"] == "tmpfs" and opts["device"] == "tmpfs"
    tmpfs_size = size_bytes(dict(o.partition("=")[::2] for o in opts["o"].split(","))["size"])
    capacity = int(environment(services["encoder"])["QVE_STORE_CAPACITY_BYTES"])
    assert capacity < tmpfs_size, "the store's LRU capacity must fit in its tmpfs, or writes fail before eviction"


def test_compose_encoder_reserves_a_gpu(services):
    devices = services["encoder"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) and (d.get("count") == "all" or d.get("count", 0) >= 1)
        for d in devices
    )
    assert environment(services["encoder"]).get("QVE_DEVICE", "auto").startswith(("cuda", "auto"))
    # Room for the pixel arenas of the most API processes the default starts (8), and some to spare.
    arenas = 8 * Settings.model_fields["arena_bytes"].default
    assert size_bytes(services["encoder"]["shm_size"]) >= arenas + 512 * 1024**2


def test_compose_publishes_on_host_loopback_only(services):
    published = []
    for name, svc in services.items():
        for p in svc.get("ports", []):
            if isinstance(p, dict):
                host_ip, target = p.get("host_ip"), int(p["target"])
            else:
                parts = str(p).split(":")
                assert len(parts) == 3, f"{name}: {p!r} binds every interface; use 127.0.0.1:HOST:CONTAINER"
                host_ip, target = parts[0], int(parts[2].split("/")[0])
            assert host_ip == "127.0.0.1", f"{name} publishes {p!r} beyond loopback"
            published.append((name, target))
    assert published == [("encoder", container_port()), ("consumer", consumer_args(services)["port"])]


def test_compose_consumer_waits_for_a_healthy_encoder(services):
    enc, con = services["encoder"], services["consumer"]
    assert con["depends_on"]["encoder"]["condition"] == "service_healthy"
    test = enc["healthcheck"]["test"]
    assert test[0] == "CMD" and not enc["healthcheck"].get("disable")
    url = url_in(healthcheck_code(test[1:]))
    assert urlsplit(url).port == container_port() and urlsplit(url).path in ("/health", "/ready")
    # The consumer is an HTTP server too: healthy once its model is loaded.
    url = url_in(healthcheck_code(con["healthcheck"]["test"][1:]))
    assert urlsplit(url).port == consumer_args(services)["port"] and urlsplit(url).path == "/ready"


def test_compose_encoder_settings_are_real(services, clean_env):
    check_serve_argv(encoder_argv(services))
    env = environment(services["encoder"])
    for name, value in env.items():
        if name.startswith("QVE_"):
            assert name.removeprefix("QVE_").lower() in Settings.model_fields, f"{name} is not a setting"
            clean_env.setenv(name, value)
    s = Settings()  # the values validate as the service would read them
    assert str(s.store_capacity_bytes) == env["QVE_STORE_CAPACITY_BYTES"]


def consumer_args(services) -> dict:
    """The consumer's command parsed by the real CLI (`python -m service consume ...`)."""
    from service.__main__ import build_parser

    con = services["consumer"]
    assert con["entrypoint"] == ["python", "-m", "service", "consume"]
    return vars(build_parser().parse_args(["consume", *(interpolate(a) for a in con["command"])]))


def test_compose_consumer_is_the_lm_consumer_on_the_encoders_store_and_model(services):
    args = consumer_args(services)
    url = urlsplit(args["encoder_url"])
    assert url.hostname == "encoder" and url.port == container_port()
    assert str(args["store"]) == store_path()
    env = environment(services["encoder"])
    (enc_model,) = [m for m in mounts(services["encoder"]) if m["target"] == env["QVE_MODEL"]]
    (con_model,) = [m for m in mounts(services["consumer"]) if m["target"] == str(args["model"])]
    assert enc_model["source"] == con_model["source"] and enc_model["read_only"] and con_model["read_only"]
    assert args["device"].startswith("cuda") and services["consumer"]["deploy"]["resources"]["reservations"]["devices"]


# ---- Makefile and .ci/run --------------------------------------------------------------------------
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def make_dry_run(*targets: str) -> list[str]:
    env = without_outer_make()
    r = subprocess.run(["make", "-n", "-B", *targets], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@needs_make
def test_make_test_installs_pinned_torch_first_then_runs_pytest():
    lines = make_dry_run("test")
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project_line = next(i for i, line in enumerate(lines) if '-e ".[dev]"' in line)
    assert torch_line < project_line, "torch must be installed before the project, or pip fetches a CUDA build"
    assert "-m pytest" in lines[-1]


@needs_make
def test_make_run_and_serve_tiny_use_the_real_cli():
    (run,) = [line for line in make_dry_run("run") if "-m service" in line]
    assert run.split("-m service", 1)[1].split()[0] == "serve"
    (tiny,) = [line for line in make_dry_run("serve-tiny") if "-m service" in line]
    check_serve_argv(tiny.split("-m service serve", 1)[1].split())


@needs_make
def test_make_run_installs_only_what_serving_needs_and_make_test_adds_the_dev_extras():
    run = make_dry_run("run")
    installs = [line for line in run if "pip install" in line]
    assert any(line.endswith("pip install --no-compile -e .") for line in installs), installs
    assert not any("[dev]" in line or "[loadtest]" in line for line in run), "make run must not install dev extras"
    assert any(line.startswith("echo ") and "installing" in line for line in run)  # it says what it is doing
    test = make_dry_run("test")
    assert test.index(next(line for line in test if line.endswith("pip install --no-compile -e ."))) < test.index(
        next(line for line in test if line.endswith('pip install --no-compile -e ".[dev]"')))
    (try_,) = [line for line in make_dry_run("try") if "-m service" in line]
    assert try_.split("-m service", 1)[1].split()[:3] == ["try", "--url", "http://127.0.0.1:8080"]


def test_the_serving_install_decodes_videos():
    """The API takes videos, but PyAV was only in a `video` extra: a video on `make run`'s install answered a
    500 (`No module named 'av'`). It is a base dependency, and no extra names it again."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()  # noqa: E731
    assert "av" in [name(r) for r in project["dependencies"]], project["dependencies"]
    for extra, requirements in project.get("optional-dependencies", {}).items():
        assert "av" not in [name(r) for r in requirements], extra


@needs_make
def test_make_loadtest_installs_only_the_loadtest_extra_on_the_serving_install():
    # The dev extras (pytest, schemathesis, scikit-image, scipy) took ~55 s on a fresh clone; the load
    # tool needs only `rich` and `matplotlib` on top of serving.
    lines = make_dry_run("loadtest")
    installs = [line for line in lines if "pip install" in line]
    assert not any("[dev]" in line for line in lines), installs
    serve = next(i for i, line in enumerate(lines) if line.endswith("pip install --no-compile -e ."))
    extra = next(i for i, line in enumerate(lines) if line.endswith('pip install --no-compile -e ".[loadtest]"'))
    assert serve < extra and lines[extra + 1] == "touch .venv/.installed-loadtest"
    assert lines[-1].split()[1:] == ["-m", "service", "loadtest", "--url", "http://127.0.0.1:8080"]


@needs_make
def test_make_install_byte_compiles_the_venv_once_its_packages_are_in():
    # Where PYTHONDONTWRITEBYTECODE is set (the development and CI machines), nothing else would: every process
    # compiled torch and transformers again, and a tiny server took 22 s to be ready instead of 9.7.
    lines = make_dry_run("test")
    compiles = [i for i, line in enumerate(lines) if "compileall.compile_dir" in line]
    serve = next(i for i, line in enumerate(lines) if line.endswith("pip install --no-compile -e ."))
    dev = next(i for i, line in enumerate(lines) if line.endswith('pip install --no-compile -e ".[dev]"'))
    stamps = [next(i for i, line in enumerate(lines) if line == f"touch .venv/.installed-{s}") for s in ("serve", "dev")]
    assert len(compiles) == 2 and serve < compiles[0] < stamps[0] < dev < compiles[1] < stamps[1], lines
    if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():  # this run's venv is the one make made
        import importlib.util

        import torch
        import transformers.modeling_utils as modeling_utils

        for module in (torch, modeling_utils):
            assert Path(importlib.util.cache_from_source(module.__file__)).is_file(), f"{module.__name__} not compiled"


@needs_make
def test_make_install_stamps_follow_pyproject(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    serve, dev = tmp_path / ".venv" / ".installed-serve", tmp_path / ".venv" / ".installed-dev"
    serve.write_text("")
    os.utime(tmp_path / "pyproject.toml", (1_000_000, 1_000_000))
    os.utime(serve, (2_000_000, 2_000_000))
    env = without_outer_make()

    def up_to_date(target: str) -> bool:
        return subprocess.run(["make", "-q", target], cwd=tmp_path, env=env, timeout=60).returncode == 0

    assert up_to_date("install-serve") and not up_to_date("install")  # serving installed, the dev extras not
    dev.write_text("")
    os.utime(dev, (3_000_000, 3_000_000))
    assert up_to_date("install-serve") and up_to_date("install")
    os.utime(serve, (500_000, 500_000))  # pyproject.toml changed after the last install
    assert not up_to_date("install-serve") and not up_to_date("install")


def test_ci_run_is_the_readme_test_command_and_propagates_failure(tmp_path):
    ci = ROOT / ".ci" / "run"
    text = ci.read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    commands = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[-2:] == ["make test", "make compose-test"]  # the README's test command, then the stack
    assert os.access(ci, os.X_OK), ".ci/run must be executable (git update-index --chmod=+x .ci/run)"

    # Run a copy with a `make` that fails: the script must run it from the repo root and fail too.
    (tmp_path / "repo" / ".ci").mkdir(parents=True)
    shutil.copy(ci, tmp_path / "repo" / ".ci" / "run")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "make").write_text('#!/bin/sh\necho "$PWD $*" > "$FAKE_LOG"\nexit 3\n')
    (fake / "make").chmod(0o755)
    log = tmp_path / "make.log"
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log)}
    r = subprocess.run(["bash", str(tmp_path / "repo" / ".ci" / "run")], cwd=tmp_path, env=env, timeout=60)
    assert r.returncode != 0
    assert log.read_text().split() == [str((tmp_path / "repo").resolve()), "test"]  # stopped at the first failure



# ---- the CPU stack (docker/docker-compose.cpu.yml; run for real by `make compose-test`) --------------
COMPOSE_CPU = ROOT / "docker" / "docker-compose.cpu.yml"


def test_cpu_compose_runs_the_real_cli_on_loopback_with_one_shared_store(clean_env):
    from service.__main__ import build_parser

    svc = yaml.safe_load(COMPOSE_CPU.read_text())["services"]
    compose = yaml.safe_load(COMPOSE_CPU.read_text())
    enc_argv = [str(interpolate(a)) for a in svc["encoder"]["command"]]
    con_argv = [str(interpolate(a)) for a in svc["consumer"]["command"]]
    enc, con = vars(build_parser().parse_args(enc_argv)), vars(build_parser().parse_args(con_argv))
    assert enc.pop("command") == "serve" and con["command"] == "consume"
    enc.pop("log_level", None)
    s = Settings(**enc)
    # Host networking: what is reachable is what binds, and both bind the loopback only.
    assert svc["encoder"]["network_mode"] == svc["consumer"]["network_mode"] == "host"
    assert s.host == con["host"] == "127.0.0.1" and s.device == "cpu"
    assert urlsplit(con["encoder_url"]).port == s.port and urlsplit(con["encoder_url"]).hostname == "127.0.0.1"
    assert str(con["store"]) == str(s.store) and str(con["model"]) == s.model
    (enc_store,) = [m for m in mounts(svc["encoder"]) if m["target"] == str(s.store)]
    (con_store,) = [m for m in mounts(svc["consumer"]) if m["target"] == str(s.store)]
    assert enc_store["source"] == con_store["source"] and con_store.get("read_only") and not enc_store.get("read_only")
    opts = compose["volumes"][enc_store["source"]]["driver_opts"]
    tmpfs_size = size_bytes(dict(o.partition("=")[::2] for o in opts["o"].split(","))["size"])
    for name, value in environment(svc["encoder"]).items():
        clean_env.setenv(name, value)
    assert Settings().store_capacity_bytes < tmpfs_size, "the store's LRU capacity must fit in its tmpfs"
    assert svc["consumer"]["depends_on"]["encoder"]["condition"] == "service_healthy"
    for name, port in (("encoder", s.port), ("consumer", con["port"])):
        url = url_in(healthcheck_code([interpolate(a) for a in svc[name]["healthcheck"]["test"][1:]]))
        assert urlsplit(url).port == port and urlsplit(url).path == "/ready"


def test_files_named_in_the_docker_files_exist():
    # Issue 20: Dockerfile.cpu's comments sent readers to docker/compose_test.py, which never existed.
    # Every repository file named in docker/ (a relative path: absolute ones live inside the image).
    for f in sorted((ROOT / "docker").glob("*")):
        if f.is_file() and (f.name.startswith("Dockerfile") or f.suffix == ".yml"):
            named = re.findall(r"(?<![\w/.-])([\w.-][\w./-]*\.(?:py|yml|sh|md|txt|toml))\b", f.read_text())
            assert named or f.suffix == ".yml", f"{f.name} names no file at all: the pattern is wrong"
            missing = [n for n in named if not (ROOT / n).is_file()]
            assert not missing, f"docker/{f.name} names {missing}, which are not files of the repository"


# ---- the Mooncake stack (docker/docker-compose.mooncake.yml; run for real by `make compose-test`) -------
COMPOSE_MOONCAKE = ROOT / "docker" / "docker-compose.mooncake.yml"
DOCKERFILE_CPU = ROOT / "docker" / "Dockerfile.cpu"


@pytest.fixture(scope="module")
def mooncake_services() -> dict:
    return yaml.safe_load(COMPOSE_MOONCAKE.read_text())["services"]


def lease_ms(value: str) -> float:
    """mooncake_master's --default_kv_lease_ttl: milliseconds, or a number with ms, s, m or h."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", value)
    assert m, f"mooncake_master does not read {value!r} as a duration"
    return float(m.group(1)) * {None: 1, "ms": 1, "s": 1e3, "m": 60e3, "h": 3600e3}[m.group(2)]


def published(svc: dict) -> list[tuple[str, int]]:
    """(host address, container port) of each port a service publishes (compose's long syntax)."""
    return [(p["host_ip"], int(p["target"])) for p in svc.get("ports", [])]


def test_mooncake_image_is_the_cpu_image_with_the_projects_mooncake_extra(mooncake_services):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("mooncake-transfer-engine-non-cuda") for r in extras["mooncake"])
    (built,) = [name for name, svc in mooncake_services.items() if "build" in svc]
    build = mooncake_services[built]["build"]
    assert (COMPOSE_MOONCAKE.parent / build["context"]).resolve() == ROOT
    assert (COMPOSE_MOONCAKE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE_CPU
    assert build["args"]["MOONCAKE"] == "1"
    assert {svc["image"] for svc in mooncake_services.values()} == {mooncake_services[built]["image"]}
    cpu = yaml.safe_load(COMPOSE_CPU.read_text())["services"]
    assert mooncake_services[built]["image"] != cpu["encoder"]["image"], "the plain CPU image has no Mooncake"
    # The Dockerfile installs the extra (not a second pin of the wheel) and the libraries it links, only
    # with MOONCAKE=1, declared after every layer the two images share.
    steps = dockerfile(DOCKERFILE_CPU)
    at = steps.index(("ARG", "MOONCAKE=0"))
    (run,) = [args for i, args in steps[at:] if i == "RUN" and "mooncake" in args]
    assert '[ "$MOONCAKE" = 1 ]' in run and 'pip install --no-build-isolation ".[mooncake]"' in run
    assert re.search(r"apt-get install [^&]*\blibibverbs1 ibverbs-providers\b", run)
    assert "import mooncake.store" in run  # a library still missing fails the build, not the first start
    assert not any(i in ("COPY", "ADD") for i, _ in steps[at:]), "layers after MOONCAKE are not shared"


def test_mooncake_compose_runs_the_real_cli_each_service_its_own_container_on_one_private_network(
        mooncake_services, clean_env):
    from service.__main__ import build_parser

    svc = mooncake_services
    assert set(svc) == {"master", "encoder-a", "encoder-b", "consumer"}
    networks = yaml.safe_load(COMPOSE_MOONCAKE.read_text())["networks"]
    assert networks == {"pool": {"driver": "bridge"}}  # one network of the project's own, not the host's
    for name, s in svc.items():
        assert "network_mode" not in s and s["networks"] == ["pool"], f"{name} must be on the private network only"

    # The master: RPC on its own namespace's interfaces, metrics on its loopback; nothing published.
    assert svc["master"]["entrypoint"] == ["mooncake_master"]
    master = dict(str(interpolate(a)).removeprefix("--").partition("=")[::2] for a in svc["master"]["command"])
    assert master["rpc_address"] == "0.0.0.0" and master["metrics_host"] == "127.0.0.1"
    assert published(svc["master"]) == []
    url = url_in(healthcheck_code(svc["master"]["healthcheck"]["test"][1:]))
    assert urlsplit(url).port == int(master["metrics_port"]) and urlsplit(url).path == "/health"

    store = f"mooncake://master:{master['rpc_port']}"
    encoders = {}
    for name in ("encoder-a", "encoder-b"):
        argv = [str(interpolate(a)) for a in svc[name]["command"]]
        flags = vars(build_parser().parse_args(argv))
        assert flags.pop("command") == "serve"
        flags.pop("log_level", None)
        s = encoders[name] = Settings(**flags)
        # Peers reach it by its service name (Docker's DNS): the address it advertises to the pool.
        assert s.store == store and s.mooncake_local_host == name and s.mooncake_segment_bytes > 0
        assert s.host == "0.0.0.0" and s.device == "cpu"  # its own namespace; published on loopback below
        assert published(svc[name]) == [("127.0.0.1", s.port)]
        assert svc[name]["depends_on"]["master"]["condition"] == "service_healthy"
        url = url_in(healthcheck_code(svc[name]["healthcheck"]["test"][1:]))
        assert urlsplit(url).port == s.port and urlsplit(url).path == "/ready"
        # docs/multihost.md: an entry /encode answered must outlive the minimum residency's lease.
        assert lease_ms(master["default_kv_lease_ttl"]) >= s.store_min_residency_s * 1000
    assert encoders["encoder-a"].model == encoders["encoder-b"].model, "one model: one namespace, shared entries"

    con = vars(build_parser().parse_args([str(interpolate(a)) for a in svc["consumer"]["command"]]))
    assert con["command"] == "consume" and con["store"] == store and con["mooncake_local_host"] == "consumer"
    enc = urlsplit(con["encoder_url"])
    assert enc.hostname in encoders and enc.port == encoders[enc.hostname].port
    assert str(con["model"]) == encoders[enc.hostname].model and con["host"] == "0.0.0.0"
    assert published(svc["consumer"]) == [("127.0.0.1", con["port"])]
    assert {k: v["condition"] for k, v in svc["consumer"]["depends_on"].items()} == {
        "master": "service_healthy", enc.hostname: "service_healthy"}
    url = url_in(healthcheck_code(svc["consumer"]["healthcheck"]["test"][1:]))
    assert urlsplit(url).port == con["port"] and urlsplit(url).path == "/ready"
    # Every service reads the same checkpoint, read-only.
    models = {name: [m for m in mounts(s) if m["target"] == "/models/model"] for name, s in svc.items() if name != "master"}
    assert all(len(m) == 1 and m[0]["read_only"] for m in models.values())
    assert len({m[0]["source"] for m in models.values()}) == 1

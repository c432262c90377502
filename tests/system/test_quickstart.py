"""`qwen3vl-encoder try` (service/quickstart.py), and the README's quick start run as written against
a tiny server: the commands are read out of README.md, so an example that stops working fails here."""

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.store.format import read_embeddings
from tests.support.live import ServiceProcess, refused_port, without_outer_make

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # the project's venv: `.venv/bin` in the README


def env(**extra) -> dict:
    base = {k: v for k, v in without_outer_make().items() if not k.upper().startswith("QVE_")}
    return {**base, "PYTHONPATH": str(ROOT), **extra}  # this tree's code, whichever tree the venv installed


def test_try_without_a_server_says_so_in_one_line():
    with refused_port() as port:
        r = subprocess.run([sys.executable, "-m", "service", "try", "--url", f"http://127.0.0.1:{port}"], cwd=ROOT,
                           env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"error: no server at http://127.0.0.1:{port} (connection refused); start one "
                                     "with `make run` or `.venv/bin/qwen3vl-encoder serve`"]


def test_try_names_a_missing_image(tmp_path):
    r = subprocess.run([sys.executable, "-m", "service", "try", "--image", str(tmp_path / "dog.jpg")], cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [f"error: cannot read {tmp_path / 'dog.jpg'}: No such file or directory"]


@pytest.mark.parametrize("flag", ["--video", "--image"], ids=["--video", "a video given as --image"])
def test_try_posts_a_video(tiny_server, tmp_path, flag):
    """`try` took images only: a newcomer's clip could not be tried. `--video FILE` posts it as a video_url
    part, and so does `--image` with a file whose bytes are a video container's."""
    from tests.support import videodata

    server, store = tiny_server
    clip = tmp_path / "clip.bin"  # (no suffix to go by: the bytes say what it is)
    clip.write_bytes(videodata.clip(frames=8, fps=4, width=64, height=48))
    r = subprocess.run([sys.executable, "-m", "service", "try", "--url", server.url, flag, str(clip)], cwd=ROOT,
                       env=env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    fields = parse_try(r.stdout)
    assert fields["modality"] == "video" and re.fullmatch(r"\d+ frames sampled, at \d+(\.\d+)? fps", fields["frames"]), fields
    assert read_embeddings(store, fields["key"]).modality == "video"


# ---- the README --------------------------------------------------------------------------------------
def readme_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def quick_start_block() -> str:
    """The block the README marks as run by this test."""
    text = (ROOT / "README.md").read_text()
    marker = "<!-- quick-start: tests/system/test_quickstart.py runs this block as written -->\n```bash\n"
    assert marker in text, "README.md lost its quick-start block (or its marker)"
    return text.split(marker, 1)[1].split("```", 1)[0]


def commands(block: str) -> list[str]:
    """Shell commands of a block: one per line, a heredoc with its lines; comment lines dropped."""
    out, lines = [], iter(block.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if (m := re.search(r"<<'(\w+)'", line)) is not None:
            body = []
            for more in lines:
                body.append(more)
                if more == m.group(1):
                    break
            line = "\n".join([line, *body])
        out.append(line)
    return out


def parse_try(stdout: str) -> dict:
    """`try`'s answer: {'key': ..., 'shape': ..., 'cached': ..., 'file': ...}."""
    fields = dict(re.findall(r"^  (\w+) +(.*)$", stdout, flags=re.M))
    assert {"key", "shape", "cached", "file", "model"} <= set(fields), stdout
    return fields


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp / "store"),
                             "--decode-workers", "1"], tmp / "server.log")
    try:
        yield server, tmp / "store"
    finally:
        assert server.stop()


def run_as_written(command: str, port: int, **extra_env) -> subprocess.CompletedProcess:
    """The README's command with two substitutions only: this server's port for 8080, and this venv's
    bin directory for `.venv/bin` (the README's venv is the one `make` creates in the checkout)."""
    command = command.replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace(".venv/bin/", f"{VENV_BIN}/")
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=env(**extra_env), capture_output=True, text=True,
                          timeout=180)


def test_readme_examples_name_the_venv_and_existing_files():
    for block in readme_blocks():
        for cmd in commands(block):
            words = cmd.split()
            assert words[0] not in ("python", "python3", "pip", "qwen3vl-encoder"), f"bare {words[0]}: {cmd}"
            for path in re.findall(r"@([\w./-]+)|open\(\"([\w./-]+)\"", cmd):
                name = next(p for p in path if p)
                assert (ROOT / name).is_file(), f"{cmd!r} names {name}, which does not exist"


def test_readme_quick_start_runs_as_written(tiny_server):
    server, store = tiny_server
    assert (VENV_BIN / "qwen3vl-encoder").exists(), "the README's console script is not installed in the venv"
    cmds = commands(quick_start_block())
    assert len(cmds) == 3, cmds

    # 1. `qwen3vl-encoder try`: no --url; like `serve`, it reads QVE_PORT (here: this server's port).
    assert cmds[0].split()[:2] == [".venv/bin/qwen3vl-encoder", "try"]
    r = run_as_written(cmds[0], server.port, QVE_PORT=str(server.port))
    assert r.returncode == 0, r.stderr
    first = parse_try(r.stdout)
    key = first["key"]
    assert key.startswith("sha256+") and first["cached"] == "false"
    assert first["model"] == "preset:tiny:seed0 on cpu (float32)"
    emb = read_embeddings(store, key)
    n = emb.main.shape[0]
    t, h, w = emb.grid_thw
    assert n == t * h * w // 4 and list(emb.main.shape) == [n, 48] and len(emb.deepstack) == 2
    assert first["shape"] == f"[{n}, 144] float32 ({n} tokens, grid_thw [{t}, {h}, {w}])"
    assert first["file"] == str(store.absolute() / key / "encoder_cache.safetensors")

    # 2. curl, multipart: the same bytes, so the same content key, now a cache hit.
    r = run_as_written(cmds[1], server.port)
    assert r.returncode == 0, r.stderr
    (item,) = json.loads(r.stdout)["items"]
    assert (item["key"], item["cached"], item["shape"], item["path"]) == (
        key, True, [n, 144], f"{key}/encoder_cache.safetensors")

    # 3. the venv's Python posting JSON with a uuid: stored under that uuid.
    r = run_as_written(cmds[2], server.port)
    assert r.returncode == 0, r.stderr
    (item,) = ast.literal_eval(r.stdout.strip())["items"]
    assert (item["key"], item["cached"], item["shape"], item["grid_thw"]) == ("cat-1", False, [n, 144], [t, h, w])
    assert read_embeddings(store, "cat-1").main.equal(emb.main)  # same image, same embeddings


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_readme_make_try_runs_the_same_command(tiny_server):
    server, _ = tiny_server
    (cmd,) = [c for b in readme_blocks() for c in commands(b) if c.startswith("make try")]
    # The Makefile's recipe as written; only its install step is skipped (the venv is this one) and the
    # server's URL is this server's (the Makefile's URL variable, which the environment sets).
    r = run_as_written(f"{cmd} PY={sys.executable} SERVE_STAMP=", server.port, URL=server.url)
    assert r.returncode == 0, r.stdout + r.stderr
    answer = parse_try(r.stdout)
    assert answer["key"].startswith("sha256+") and answer["cached"] in ("true", "false")
    assert Path(answer["file"]).is_file() and re.fullmatch(r"\[\d+, 144\] float32 .*", answer["shape"])


def test_the_readme_curl_says_why_when_it_fails():
    """Issue 20: `curl -s` printed nothing at all when the server was not there. The README's curl now
    says so and exits non-zero (and, with --fail-with-body, a 4xx prints its JSON error and fails too)."""
    (curl,) = [c for c in commands(quick_start_block()) if c.startswith("curl ")]
    if shutil.which("curl") is None:
        pytest.skip("no curl here")
    with refused_port() as port:
        r = run_as_written(curl, port)
    assert r.returncode != 0 and "curl: (7)" in r.stderr, (r.returncode, r.stderr)

"""`qwen3vl-encoder try` (service/quickstart.py), and the README's quick start run as written against
a tiny server: the commands are read out of README.md, so an example that stops working fails here."""

import ast
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service.quickstart import EXAMPLE_IMAGE
from service.store.format import read_embeddings
from tests.support.live import ServiceProcess, refused_port, without_outer_make

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent  # the project's venv: `.venv/bin` in the README
CAT = EXAMPLE_IMAGE.read_bytes()


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


def _example_answers(page: Path) -> list[dict]:
    """The /encode answers a page shows as examples (its ```json blocks holding "items")."""
    blocks = re.findall(r"```json\n(.*?)```", page.read_text(), flags=re.S)
    return [json.loads(b) for b in blocks if '"items"' in b]


def test_the_example_answers_are_what_the_service_answers_for_cat_jpg(tiny_server):
    """The README's example answer for cat.jpg on `make run` (the qwen3-vl-2b preset on the CPU) had another
    key than the server gives, and neither it nor docs/api.md's had `modality`. Each is checked here against a
    real answer: its fields, and (the README's) its key, computed as the server computes it (shown for the
    tiny preset against a real tiny server, then for the 2B preset, which needs no model to compute)."""
    import hashlib

    from service.media.params import PreprocessParams
    from service.presets import preset_vision_config
    from service.store.keys import content_key, key_salt

    server, _ = tiny_server
    blob = EXAMPLE_IMAGE.read_bytes()
    (real,) = httpx.post(server.url + "/encode", files=[("image", ("cat.jpg", blob, "image/jpeg"))],
                         timeout=60).json()["items"]
    digest = hashlib.sha256(blob).digest()
    key = lambda preset: content_key(key_salt(f"preset:{preset}:seed0", PreprocessParams(), "torch.float32").encode(),  # noqa: E731
                                     digest)
    assert real["key"] == key("tiny")  # the way the server keys a preset's images, on the CPU
    vision = preset_vision_config("qwen3-vl-2b")
    width = vision.out_hidden_size * (1 + len(vision.deepstack_visual_indexes))
    n = real["num_tokens"]  # (the tiny preset preprocesses as the 2B one does: Qwen3-VL's defaults)
    expected = {**real, "key": key("qwen3-vl-2b"), "shape": [n, width], "cached": False,
                "path": f"{key('qwen3-vl-2b')}/encoder_cache.safetensors"}
    (readme,) = _example_answers(ROOT / "README.md")
    assert readme == {"items": [expected]}
    (api,) = _example_answers(ROOT / "docs" / "api.md")
    assert api == {"items": [{**expected, "key": "cat-1", "path": "cat-1/encoder_cache.safetensors"}]}


def test_waiting_for_a_starting_server_writes_one_access_line_per_status(tmp_path):
    """`make try` against a server still starting polled /ready twice a second, and the server's log had an
    access line for every poll (~30 while a model loaded); a liveness probe adds one every few seconds for
    ever. Now a probe's line is written when its status changes: the first 503, then the 200."""
    server = ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / "store"),
                             "--decode-workers", "1", "--log-level", "info"], tmp_path / "server.log", wait=False)
    try:
        server.wait_ready(bound_only=True)
        polls = 0
        while httpx.get(server.url + "/ready", timeout=10).status_code == 503:  # starting: each poll a 503
            polls += 1
            time.sleep(0.05)
        assert polls >= 3, "the server was ready before it could be polled while starting"
        for _ in range(5):
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        assert httpx.post(server.url + "/encode", timeout=60, files=[("image", ("cat.jpg", CAT, "image/jpeg"))]
                          ).status_code == 200
    finally:
        assert server.stop()
    lines = server.log.read_text().splitlines()
    ready = [line for line in lines if '"GET /ready HTTP' in line]
    health = [line for line in lines if '"GET /health HTTP' in line]
    status = lambda line: re.search(r'HTTP/[\d.]+" (\d{3})', line).group(1)  # noqa: E731
    assert [status(line) for line in ready] == ["503", "200"], ready
    assert [status(line) for line in health] == ["200"], health
    assert sum('"POST /encode HTTP' in line for line in lines) == 1  # every other request is logged as before


def lm_start_block() -> str:
    text = (ROOT / "README.md").read_text()
    marker = "<!-- lm-start: tests/system/test_quickstart.py runs this block as written -->\n```bash\n"
    assert marker in text, "README.md lost its LM block (or its marker)"
    return text.split(marker, 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_readme_lm_block_runs_as_written(tmp_path):
    """The README had no chat request a newcomer could paste (docs/operations.md's posted `@request.json`, a
    file nobody had), and did not say how to get a checkpoint for `consume`. Its block is run here: `demo
    --workdir`'s checkpoint (written as the demo writes it, in its folder), then `serve` and `consume` with
    the README's arguments, then the chat request as written."""
    import shlex

    from service.__main__ import build_parser
    from service.demo import CHECKPOINT
    from service.lm.tiny import write_tiny_checkpoint

    demo, serve, consume, chat = commands(lm_start_block())
    work = "/tmp/qve"
    local = lambda cmd: shlex.split(cmd.split("#", 1)[0].replace(work, str(tmp_path)).rstrip(" &"))[1:]  # noqa: E731
    args = build_parser().parse_args(local(demo))
    assert args.command == "demo" and args.workdir == tmp_path
    assert serve.endswith("&") and consume.endswith("&")
    write_tiny_checkpoint(args.workdir / CHECKPOINT)  # what demo --workdir keeps there
    assert f"--model {work}/{CHECKPOINT}" in serve and f"--model {work}/{CHECKPOINT}" in consume
    encoder = ServiceProcess(local(serve), tmp_path / "serve.log")
    try:
        consumer = ServiceProcess([*local(consume), "--encoder-url", encoder.url], tmp_path / "consume.log")
        try:
            r = run_as_written(chat.replace("127.0.0.1:8090", f"127.0.0.1:{consumer.port}"), consumer.port)
        finally:
            assert consumer.stop()
    finally:
        assert encoder.stop()
    assert r.returncode == 0, r.stdout + r.stderr
    choice = ast.literal_eval(r.stdout.strip())
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["role"] == "assistant", choice
    assert list((tmp_path / "store").glob("*/encoder_cache.safetensors")), "the image did not go through the store"


def test_docs_post_no_files_that_do_not_exist():
    """`-d @FILE` (a body read from a file) in a page's shell examples names a file of the repository."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for name in re.findall(r"(?:-d|--data(?:-binary)?) @([\w./-]+)", block):
                assert (ROOT / name).is_file(), f"{page.name} posts @{name}, which does not exist"

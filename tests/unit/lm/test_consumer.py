"""service/lm/consumer.py, the example LM-side consumer: against the real service (tiny model, in
process) for its exit statuses 0/1/2, and its `check` as a pure function."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from PIL import Image

from service.lm import consumer
from service.config import Settings
from service.engine.loader import load_model
from service.media.preprocess import grid_for, smart_resize
from service.store.format import StoredEmbeddings, read_embeddings
from tests.support import imagedata as data
from tests.support.live import live_server, refused_port

LINE_RE = re.compile(
    r"^(?P<name>\S+): key=(?P<key>\S+) grid_thw=\((?P<t>\d+), (?P<h>\d+), (?P<w>\d+)\) "
    r"main=\[(?P<n>\d+), (?P<hidden>\d+)\] deepstack_levels=(?P<levels>\d+) dtype=(?P<dtype>\w+) "
    r"cached=(?P<cached>True|False) (?P<verdict>OK|MISMATCH)$"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, store, params) of one live service for the module; images differ per test, so no test sees
    another's cache. params: the model's preprocess parameters, to compute the expected grids."""
    store = tmp_path_factory.mktemp("consumer") / "store"
    settings = Settings(model="tiny", device="cpu", store=store, max_pixels=256 * 256, decode_workers=1,
                        max_wait_ms=20)
    # max_pixels takes effect in load_model (it sets the model's preprocess params), so load with it.
    model = load_model(settings)
    assert model.params.max_pixels == 256 * 256
    with live_server(settings, model) as (url, _app):
        yield url, store, model.params


def _lines(text: str) -> dict[str, re.Match]:
    found = {}
    for line in text.splitlines():
        m = LINE_RE.match(line)
        if m:
            found[m["name"]] = m
    return found


def _assert_consistent(m: re.Match, store: Path, image: bytes, params) -> StoredEmbeddings:
    """The printed line agrees with the stored file, with the image's size under Qwen3-VL's resize
    rule (the service's limits), and with its token arithmetic (tiny model)."""
    t, h, w, n = int(m["t"]), int(m["h"]), int(m["w"]), int(m["n"])
    assert m["verdict"] == "OK" and m["dtype"] == "float32"
    assert re.fullmatch(r"sha256\+[0-9a-f]{64}", m["key"])
    width, height = Image.open(io.BytesIO(image)).size
    assert (t, h, w) == grid_for(*smart_resize(height, width, params), params)
    assert n == t * h * w // 4 > 0
    assert int(m["hidden"]) == 48 and int(m["levels"]) == 2  # the tiny model's out_hidden and deepstack taps
    emb = read_embeddings(store, m["key"])
    assert list(emb.main.shape) == [n, 48] and tuple(emb.grid_thw) == (t, h, w) and len(emb.deepstack) == 2
    assert torch.isfinite(emb.main).all() and emb.main.abs().sum() > 0
    return emb


def test_real_image_files(server, tmp_path, capsys):
    url, store, params = server
    images = data.valid_images()
    paths = []
    for name in ("coffee.png", "rgba.png"):
        (tmp_path / name).write_bytes(images[name])
        paths.append(str(tmp_path / name))

    assert consumer.main([*paths, "--url", url, "--store", str(store)]) == 0
    out = capsys.readouterr()
    found = _lines(out.out)
    assert set(found) == {"coffee.png", "rgba.png"}, out.out
    assert found["coffee.png"]["key"] != found["rgba.png"]["key"]
    for name, m in found.items():
        assert m["cached"] == "False"
        _assert_consistent(m, store, images[name], params)
    # coffee.png, 600x400, is scaled down under max_pixels (rgba.png, 96x80, is scaled up to min_pixels).
    coffee = found["coffee.png"]
    assert (int(coffee["h"]), int(coffee["w"])) == (12, 18) and int(coffee["n"]) == 54  # 192x288 px
    assert "  - " not in out.out and out.err == ""

    # The same files again: answered from the store, same keys, still consistent.
    assert consumer.main([*paths, "--url", url, "--store", str(store), "--wait-ready", "5"]) == 0
    again = _lines(capsys.readouterr().out)
    assert {k: m["key"] for k, m in again.items()} == {k: m["key"] for k, m in found.items()}
    assert all(m["cached"] == "True" and m["verdict"] == "OK" for m in again.values())


def test_synthetic_image_when_no_files_given(server, capsys):
    url, store, params = server
    png = consumer.synthetic_png()
    assert png == consumer.synthetic_png()  # deterministic
    img = Image.open(io.BytesIO(png))
    assert img.format == "PNG" and img.size == (320, 224) and img.mode == "RGB"
    assert img.getpixel((120, 84)) == (230, 60, 40)  # inside the disc

    assert consumer.main(["--url", url, "--store", str(store)]) == 0
    found = _lines(capsys.readouterr().out)
    assert set(found) == {"synthetic.png"}
    _assert_consistent(found["synthetic.png"], store, png, params)


# ---- exit status 1 ---------------------------------------------------------------------------------
def test_mismatch_between_answer_and_store_exits_1(server, monkeypatch, tmp_path, capsys):
    url, store, params = server
    real_encode = consumer.encode

    def lying_encode(client, name, blob):
        item = real_encode(client, name, blob)
        return {**item, "num_tokens": item["num_tokens"] + 1}

    monkeypatch.setattr(consumer, "encode", lying_encode)
    f = tmp_path / "a.png"
    f.write_bytes(data.encode(data.textured_rgb(80, 64, seed=101), "PNG"))
    assert consumer.main([str(f), "--url", url, "--store", str(store)]) == 1
    out = capsys.readouterr().out
    (m,) = _lines(out).values()
    assert m["verdict"] == "MISMATCH"
    assert re.search(r"^  - num_tokens \d+ != t\*h\*w/4 = \d+$", out, re.M)
    assert re.search(r"^  - main shape \[\d+, 48\] != \[\d+, 48\]$", out, re.M)


def test_wrong_store_exits_1(server, tmp_path, capsys):
    url, _store, _params = server
    f = tmp_path / "b.png"
    f.write_bytes(data.encode(data.textured_rgb(72, 56, seed=102), "PNG"))
    empty = tmp_path / "elsewhere"
    assert consumer.main([str(f), "--url", url, "--store", str(empty)]) == 1
    out = capsys.readouterr().out
    assert re.search(rf"^b\.png: key sha256\+[0-9a-f]{{64}} is not in the store at {re.escape(str(empty))}", out, re.M)


def test_refused_image_exits_1_and_the_others_still_run(server, tmp_path, capsys):
    url, store, params = server
    bad = tmp_path / "notes.png"
    bad.write_bytes(b"hello, this is definitely not an image\n")
    good = tmp_path / "good.png"
    good_png = data.encode(data.textured_rgb(64, 64, seed=103), "PNG")
    good.write_bytes(good_png)
    assert consumer.main([str(bad), str(good), "--url", url, "--store", str(store)]) == 1
    out = capsys.readouterr()
    assert re.search(r"/encode refused notes\.png: HTTP 4\d\d: ", out.err)
    found = _lines(out.out)
    assert set(found) == {"good.png"}
    _assert_consistent(found["good.png"], store, good_png, params)


# ---- exit status 2 ---------------------------------------------------------------------------------
def test_unreachable_service_exits_2(tmp_path, capsys):
    with refused_port() as port:  # nothing listens there
        url = f"http://127.0.0.1:{port}"
        assert consumer.main(["--url", url, "--store", str(tmp_path), "--timeout", "5"]) == 2
    out = capsys.readouterr()
    assert f"cannot reach the encoder service at {url}" in out.err and out.out == ""


def test_not_ready_in_time_exits_2(tmp_path, capsys):
    with refused_port() as port:
        assert consumer.main(["--url", f"http://127.0.0.1:{port}", "--store", str(tmp_path), "--wait-ready", "0.3"]) == 2
    assert "was not ready within 0.3 s" in capsys.readouterr().err


# ---- check() as a pure function -------------------------------------------------------------------
def _fixture_pair(tmp_path, n=6, hidden=8, levels=2, grid=(1, 2, 12), dtype=torch.float32):
    ec = torch.arange(n * hidden * (1 + levels), dtype=dtype).view(n, hidden * (1 + levels))
    parts = list(torch.split(ec, hidden, dim=1))
    emb = StoredEmbeddings(main=parts[0], deepstack=parts[1:], grid_thw=grid,
                           metadata={"out_hidden_size": str(hidden), "deepstack_levels": str(levels)})
    key = "k1"
    (tmp_path / key).mkdir(parents=True)
    (tmp_path / key / "encoder_cache.safetensors").write_bytes(b"x")
    item = {"key": key, "grid_thw": list(grid), "num_tokens": n, "shape": [n, hidden * (1 + levels)],
            "dtype": str(dtype).removeprefix("torch."), "path": f"{key}/encoder_cache.safetensors", "cached": False}
    return item, emb


def test_check_consistent(tmp_path):
    item, emb = _fixture_pair(tmp_path)
    assert consumer.check(item, emb, tmp_path) == []
    item, emb = _fixture_pair(tmp_path / "bf", dtype=torch.bfloat16)
    assert consumer.check(item, emb, tmp_path / "bf") == []


def test_check_wrong_num_tokens(tmp_path):
    item, emb = _fixture_pair(tmp_path)
    item["num_tokens"] = 7
    problems = consumer.check(item, emb, tmp_path)
    assert "num_tokens 7 != t*h*w/4 = 6" in problems
    assert "main shape [6, 8] != [7, 8]" in problems
    assert "answered shape [6, 24] != [7, 8*(1+2)]" in problems
    assert len(problems) == 3


def test_check_wrong_answered_shape(tmp_path):
    item, emb = _fixture_pair(tmp_path)
    item["shape"] = [6, 16]
    assert consumer.check(item, emb, tmp_path) == ["answered shape [6, 16] != [6, 8*(1+2)]"]


def test_check_wrong_stored_shapes(tmp_path):
    item, emb = _fixture_pair(tmp_path)
    emb.main = torch.zeros(5, 8)
    problems = consumer.check(item, emb, tmp_path)
    assert "main shape [5, 8] != [6, 8]" in problems
    assert "deepstack shapes [[6, 8], [6, 8]] != main [5, 8]" in problems
    assert len(problems) == 2

    item, emb = _fixture_pair(tmp_path / "d")
    emb.deepstack = emb.deepstack[:1]  # a tap missing vs the metadata
    problems = consumer.check(item, emb, tmp_path / "d")
    assert "1 deepstack tensors, metadata says 2" in problems
    assert "answered shape [6, 24] != [6, 8*(1+1)]" in problems


def test_check_wrong_grid_dtype_and_path(tmp_path):
    item, emb = _fixture_pair(tmp_path)
    emb.grid_thw = (1, 4, 6)
    assert consumer.check(item, emb, tmp_path) == ["stored grid_thw [1, 4, 6] != answered [1, 2, 12]"]

    item, emb = _fixture_pair(tmp_path / "x")
    item["dtype"] = "bfloat16"
    assert consumer.check(item, emb, tmp_path / "x") == ["stored dtype torch.float32 != answered bfloat16"]

    item["dtype"] = "float32"
    item["path"] = "k1/missing.safetensors"
    assert consumer.check(item, emb, tmp_path / "x") == [
        f"answered path 'k1/missing.safetensors' is not a file under {tmp_path / 'x'}"
    ]
    item["path"] = "k1"  # exists, but a directory
    assert consumer.check(item, emb, tmp_path / "x") == [f"answered path 'k1' is not a file under {tmp_path / 'x'}"]

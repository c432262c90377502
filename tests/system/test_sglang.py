"""SGLang's encoder protocol served by the real service (`serve --sglang-version`), with SGLang's own language-side
code as the client where it matters: its MMReceiverHTTP sends the parts and its receivers and Qwen-VL processor
take what comes back (tests/support/sglang_side.py, on SGLang installed beside the venv: sglang_env.py).
The endpoint's own behaviour in process, with plain ZMQ sockets: tests/unit/api/sglang/test_serve.py."""

import asyncio
import io
import pickle

import httpx
import pytest
import zmq

from tests.support import imagedata as data
from tests.support.live import ServiceProcess, data_url

pytestmark = pytest.mark.system


def _serve(tmp_path, *extra: str, name: str = "server") -> ServiceProcess:
    return ServiceProcess(["serve", "--model", "tiny", "--device", "cpu", "--store", str(tmp_path / f"{name}-store"),
                           "--max-pixels", str(256 * 256), "--decode-workers", "1", "--sglang-version", "0.5.23",
                           *extra], tmp_path / f"{name}.log")


class _Frame0(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch":
            return name
        return {"EmbeddingData": type("EmbeddingData", (), {}), "Modality": lambda v: v}[name]


def test_ranks_registering_at_any_api_process_get_every_part(tmp_path):
    """Two API processes on one socket: the part's /encode and each rank's registration arrive on connections
    of their own, so in either process; every rank gets every part, which ever process registered it."""
    server = _serve(tmp_path, "--api-processes", "2", "--sglang-push-timeout-s", "5")
    ctx = zmq.Context()
    try:
        ranks = [ctx.socket(zmq.PULL) for _ in range(2)]
        ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in ranks]
        item = data_url(data.photo("rocket.jpg", 120), "image/jpeg")
        req_ids = [f"r{i}_local_part_0" for i in range(12)]

        async def one(req_id: str):
            # a client each: a connection each, as SGLang's tokenizer and its ranks' side loops are
            async def post(path, body):
                async with httpx.AsyncClient(timeout=60) as c:
                    return await c.post(server.url + path, json=body)
            encode = asyncio.ensure_future(post("/sglang/encode", {
                "mm_items": [item], "num_parts": 1, "part_idx": 0, "req_id": req_id, "modality": "IMAGE",
                "prefill_host": "127.0.0.1", "embedding_port": None}))
            regs = await asyncio.gather(*(post("/sglang/scheduler_receive_url", {
                "req_id": req_id, "receive_count": 2, "receive_url": f"127.0.0.1:{p}", "modality": "IMAGE"})
                for p in ports))
            return [r.status_code for r in regs], (await encode).status_code

        async def run():
            return await asyncio.gather(*(one(r) for r in req_ids))

        assert asyncio.run(run()) == [([200, 200], 200)] * len(req_ids)
        for sock in ranks:
            got = []
            while sock.poll(5000) and len(got) < len(req_ids):
                frames = sock.recv_multipart()
                got.append(vars(_Frame0(io.BytesIO(frames[0])).load())["req_id"])
            assert sorted(got) == sorted(req_ids)
    finally:
        ctx.destroy(linger=0)
        assert server.stop()

"""A stand-in for SGLang's language side (0.5.23 or 0.5.22: tests/support/sglang_env.py's VERSIONS), for tests
that drive SGLang's own receiving code against the service's SGLang encoder protocol (`--encoder-urls`).
`SglangSide` runs this file as a subprocess on SGLang's environment (tests/support/sglang_env.py) and sends it
one call at a time. No engine, tokenizer manager or scheduler runs: what runs is SGLang's code between them
and the encoder, built as SGLang's own unit tests build it.

- `tokenizer`: the zmq_to_tokenizer backend. `MMReceiverHTTP.recv_mm_data` (it posts /encode with its own
  PULL socket's port, receives the parts, and hands them to the Qwen-VL processor's get_validated_mm_data).
- `scheduler`: the zmq_to_scheduler backend (SGLang's default for Qwen3-VL). The tokenizer's
  `send_encode_request` (the /encode dispatch, `embedding_port: null`, in its thread), then `ranks` simulated
  TP ranks, each a `WaitingZmqRequest` that posts its /scheduler_receive_url registration and is polled as
  the scheduler polls it each tick, until every rank is SUCCESS or FAIL (or `timeout`).
- `unpickle`: SGLang's allow-listed `safe_pickle_loads` on a hand-written frame.
- `reject_missing`: the tokenizer manager's answer when recv_mm_data gave nothing.
- `version`.

Each reply is one line `@@ <json>` on stdout (SGLang may log there too); a call that raises answers
{"error": "Type: message"}. The multimodal items SGLang built are written to `out` as float32 .npy files
(item<i>.npy; rank<r>_item<i>.npy for the scheduler) so that a test compares them with its own reference.

Not a test module: the test process imports only `SglangSide` (no SGLang); the subprocess runs `main`.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.side import SideProcess, serve



class SglangSide(SideProcess):
    """One SGLang-side process. `call(op, **args)` -> its reply (a dict); see `main` for the ops."""

    WHAT = "SGLang-side"

    def __init__(self, env: dict[str, str], log: Path):
        super().__init__(__file__, env, log)


def _jsonable(value):
    """Frame and processor values as JSON: tensors as lists, dtypes as 'torch.bfloat16', enums by name."""
    import enum

    import torch

    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def main() -> None:
    import asyncio
    import base64
    import threading
    import time
    from types import SimpleNamespace

    import numpy as np
    import sglang
    import torch
    import zmq
    import zmq.asyncio
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.disaggregation.encoder.receiver import (
        MMReceiverHTTP,
        WaitingMMRequestStatus,
        WaitingZmqRequest,
        _aggregate_embedding_part,
        _ReceiveRegistrationRunner,
    )
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.multimodal_processor import get_mm_processor, import_processors
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.common import safe_pickle_loads
    from sglang.srt.utils.hf_transformers_utils import get_processor
    from sglang.srt.utils.network import get_local_ip_auto, get_zmq_socket_on_host

    processors = {}

    def publish_language_side(checkpoint, backend, urls):
        """The process-wide config of a `--language-only --encoder-urls ... --encoder-transfer-backend backend`
        server (SGLang re-publishes last-wins, so each call states its own)."""
        args = ServerArgs(model_path=checkpoint, device="cpu", language_only=True,
                          encoder_urls=list(urls) or ["http://127.0.0.1:1"], encoder_transfer_backend=backend)
        publish(args, role="tokenizer")
        return args

    def mm_processor(checkpoint, backend, urls):
        """SGLang's multimodal processor for `checkpoint` (QwenVLImageProcessor for Qwen3-VL), as the language
        side builds it; without its preprocessing process pool, which precomputed embeddings never use."""
        args = publish_language_side(checkpoint, backend, urls)
        if checkpoint not in processors:
            model_config = ModelConfig.from_server_args(args)
            import_processors("sglang.srt.multimodal.processors")
            processors[checkpoint] = get_mm_processor(model_config.hf_config, args, get_processor(checkpoint),
                                                      "default", model_config=model_config, skip_mm_pool=True)
        return processors[checkpoint]

    class Recording:
        """The processor, noting what the receiver hands get_validated_mm_data (grids, video timestamps),
        which its output no longer carries."""

        def __init__(self, processor):
            self._processor, self.calls = processor, []

        def __getattr__(self, name):
            return getattr(self._processor, name)

        def get_validated_mm_data(self, prompt, embeddings, **meta):
            self.calls.append({"rows": {m.name: list(e.shape) for m, e in embeddings.items()},
                               "meta": {k: _jsonable(v) for k, v in meta.items() if v is not None}})
            return self._processor.get_validated_mm_data(prompt, embeddings, **meta)

    def receiver(urls, backend, timeout):
        """MMReceiverHTTP as SGLang's unit tests make it (no server args, no bootstrap server)."""
        r = MMReceiverHTTP.__new__(MMReceiverHTTP)
        r.context = zmq.asyncio.Context()
        r.encode_urls = list(urls)
        r.host = r.hostname = get_local_ip_auto()  # SGLANG_HOST_IP, as the language side reads it
        r.recv_timeout = r.wait_timeout = timeout
        r.model_type = "qwen3_vl"
        r.encoder_transfer_backend = backend
        return r

    def request(prompt, images, videos):
        obj = GenerateReqInput(text=prompt, image_data=list(images) or None, video_data=list(videos) or None)
        obj.normalize_batch_and_arguments()
        obj.need_wait_for_mm_inputs = True  # as the tokenizer manager marks a request it dispatches
        return obj

    def report(output, out, prefix=""):
        """What the processor built: per item its modality, rows, offsets and model-specific fields (the
        rows themselves to out/<prefix>item<i>.npy, as float32)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        items = []
        for i, item in enumerate(output.mm_items):
            emb = item.precomputed_embeddings
            np.save(out / f"{prefix}item{i}.npy", emb.float().numpy())
            extra = {k: _jsonable(v) for k, v in item.model_specific_data.items()}
            items.append({"modality": item.modality.name, "shape": list(emb.shape), "dtype": str(emb.dtype),
                          "offsets": _jsonable(item.offsets), "file": f"{prefix}item{i}.npy",
                          "grid": extra.get("image_grid_thw", extra.get("video_grid_thw")),
                          "video_timestamps": extra.get("video_timestamps"), "model_specific": extra})
        ids = list(output.input_ids)
        return {"items": items, "input_ids": ids, "input_ids_len": len(ids),
                "mrope_positions_shape": None if output.mrope_positions is None else list(output.mrope_positions.shape),
                "mrope_position_delta": _jsonable(output.mrope_position_delta)}

    def tokenizer(urls, checkpoint, prompt, images=(), videos=(), out=".", timeout=60.0):
        """recv_mm_data as the tokenizer manager awaits it (`prompt` is its mm_processor_input: the text).
        {"ok": false} where it gave None (the tokenizer manager's 503, see reject_missing); else what the
        processor built. Both carry `received`: per get_validated_mm_data call, the rows per modality and the
        meta (img_grid_thw, video_grid_thw, video_timestamps) SGLang assembled from the frames; empty when
        nothing was assembled (an error frame, a failed /encode, a refused pickle), not when the processor
        refused the rows (its reason is then in the log)."""
        processor = Recording(mm_processor(checkpoint, "zmq_to_tokenizer", urls))
        r = receiver(urls, "zmq_to_tokenizer", timeout)
        t0 = time.monotonic()
        try:
            output = asyncio.run(r.recv_mm_data(request(prompt, images, videos), processor, prompt))
        finally:
            r.context.destroy(linger=0)
        base = {"seconds": round(time.monotonic() - t0, 3), "received": processor.calls}
        if output is None:
            return {"ok": False, **base}
        return {"ok": True, **base, **report(output, out)}

    def scheduler(urls, checkpoint, prompt, images=(), videos=(), ranks=2, out=".", timeout=60.0, shared=True):
        """The zmq_to_scheduler path with `ranks` TP ranks in this process, each polled as a scheduler tick
        polls it (`timeout`: its SGLANG_ENCODER_RECV_TIMEOUT). `shared`: each rank receives on one PULL socket
        of its own, drained by SGLang's _drain_scheduler_embeddings (what a serving rank does); else each
        WaitingZmqRequest binds a socket for the request. Reply: rid, num_items_assigned (the tokenizer's split
        over `urls`), dispatch {returned: the /encode calls came back, errors: [{error_msg, error_code}] of a
        non-200 /encode}, and per rank: status (SUCCESS / FAIL / TIMEOUT), error_msg, error_code,
        embedding_port (its receive_url's port), received, and on SUCCESS what the processor built
        (out/rank<r>_item<i>.npy)."""
        processor = mm_processor(checkpoint, "zmq_to_scheduler", urls)
        tok = receiver(urls, "zmq_to_scheduler", timeout)
        obj = request(prompt, images, videos)
        dispatched, dispatch_errors = threading.Event(), []
        encode = tok.encode

        async def noted_encode(*args, **kwargs):
            try:
                return await encode(*args, **kwargs)
            finally:
                dispatched.set()

        tok.encode = noted_encode
        ready = tok.send_encode_request(obj, on_dispatch_error=dispatch_errors.append)
        if ready is None:
            return {"error": "SGLang did not dispatch the request (no multimodal items, or no encoder URL)"}
        context = zmq.Context()
        waiting, rank_receivers, runners, recorders = [], [], [], []

        def start_rank(rank):
            # What reaches a rank: the tokenized request with the tokenizer's item split and URL snapshot (the
            # fields of TokenizedGenerateReqInput that the receive path reads; Qwen-VL rebuilds from the text).
            recv_req = SimpleNamespace(rid=obj.rid, input_text=prompt, input_ids=None, mm_inputs=None,
                                       num_items_assigned=obj.num_items_assigned, encoder_urls=obj.encoder_urls,
                                       need_wait_for_mm_inputs=True)
            recorders.append(Recording(processor))
            runners.append(_ReceiveRegistrationRunner(f"encoder-receive-registration-{rank}"))
            port = None
            if shared:
                rank_receivers.append(receiver(urls, "zmq_to_scheduler", timeout))
                port, rank_receivers[-1].scheduler_recv_socket = get_zmq_socket_on_host(context, zmq.PULL,
                                                                                        host=tok.hostname)
            w = WaitingZmqRequest(rid=obj.rid, recv_req=recv_req, mm_processor=recorders[-1],
                                  encoder_urls=obj.encoder_urls, model_type="qwen3_vl", host_name=tok.hostname,
                                  receive_count=ranks, zmq_context=None if shared else context,
                                  embedding_port=port, registration_runner=runners[-1])
            if shared:
                rank_receivers[-1].waiting_by_rid = {w.rid: w}
            waiting.append(w)
            w.send_encode_request()  # its /scheduler_receive_url registration, on the runner's loop

        def tick(applied):
            for err in dispatch_errors[applied:]:  # EncoderDispatchErrorReq, as _process_waiting_requests takes it
                for w in waiting:
                    w._fail_and_release(err.error_msg, err.error_code)
            for i, w in enumerate(waiting):
                if shared:
                    rank_receivers[i]._drain_scheduler_embeddings()
                w._try_recv_mm_data()
            return len(dispatch_errors)

        try:
            for rank in range(ranks):
                start_rank(rank)
            ready.set()  # (the tokenizer sets it once the request is on its way to the scheduler)
            deadline, applied = time.monotonic() + timeout, 0
            while any(w.status == WaitingMMRequestStatus.PENDING for w in waiting) and time.monotonic() < deadline:
                applied = tick(applied)
                time.sleep(0.005)
            for w in waiting:
                if w.status == WaitingMMRequestStatus.PENDING:
                    w.status = WaitingMMRequestStatus.TIMEOUT
            dispatched.wait(min(10.0, max(0.0, deadline - time.monotonic())))
            replies = []
            for rank, w in enumerate(waiting):
                reply = {"rank": rank, "status": w.status.name, "error_msg": w.error_msg, "error_code": w.error_code,
                         "embedding_port": w.embedding_port, "received": recorders[rank].calls}
                if w.status == WaitingMMRequestStatus.SUCCESS:
                    reply |= report(w.recv_req.mm_inputs, out, f"rank{rank}_")
                replies.append(reply)
            errors = [{"error_msg": e.error_msg, "error_code": e.error_code} for e in dispatch_errors]
            return {"rid": obj.rid, "num_items_assigned": {m.name: n for m, n in obj.num_items_assigned.items()},
                    "dispatch": {"returned": dispatched.is_set(), "errors": errors}, "ranks": replies}
        finally:
            for w in waiting:
                w.release_resources()
                w.close_recv_socket()
            for r in rank_receivers:
                r.scheduler_recv_socket.close(linger=0)
            for runner in runners:
                runner.loop.call_soon_threadsafe(runner.loop.stop)
            context.destroy(linger=0)
            tok.context.destroy(linger=0)

    def unpickle(frames_b64, out=None):
        """safe_pickle_loads on frame 0: the object's class path and __dict__; with a frame 1, the tensor the
        receiver rebuilds from it (shape, dtype; its rows to the file `out` as float32 .npy) and the meta it
        aggregates (get_mm_extra_meta)."""
        frames = [base64.b64decode(f) for f in frames_b64]
        obj = safe_pickle_loads(frames[0])
        reply = {"class": f"{type(obj).__module__}.{type(obj).__qualname__}",
                 "dict": _jsonable(vars(obj)) if hasattr(obj, "__dict__") else None}
        if reply["dict"] is None:
            return {**reply, "value": _jsonable(obj)}
        if len(frames) > 1:
            emb = torch.frombuffer(bytearray(frames[1]), dtype=obj.dtype).reshape(obj.shape).clone()
            obj.embedding = emb
            reply["frame1"] = {"shape": list(emb.shape), "dtype": str(emb.dtype)}
            if out is not None:
                np.save(out, emb.float().numpy())
            meta = _aggregate_embedding_part(None, obj, "qwen3_vl").get_mm_extra_meta()
            reply["meta"] = {k: _jsonable(v) for k, v in meta.items() if v is not None}
        return reply

    def reject_missing(checkpoint, backend="zmq_to_tokenizer", mm_inputs_missing=True):
        """The tokenizer manager's _reject_missing_dispatched_encoder_embedding, after recv_mm_data, on a
        request it dispatched: {"raised": true, "status_code", "detail"} (the HTTPException it raises), or
        {"raised": false}."""
        import fastapi
        from sglang.srt.managers.tokenizer_manager import _reject_missing_dispatched_encoder_embedding

        publish_language_side(checkpoint, backend, [])
        obj = request("<|vision_start|><|image_pad|><|vision_end|>", ["data:image/png;base64,AAAA"], [])
        try:
            _reject_missing_dispatched_encoder_embedding(obj, None if mm_inputs_missing else object())
        except fastapi.HTTPException as e:
            return {"raised": True, "status_code": int(e.status_code), "detail": e.detail}
        return {"raised": False}

    def version():
        return {"version": sglang.__version__}

    ops = {f.__name__: f for f in (tokenizer, scheduler, unpickle, reject_missing, version)}
    serve(ops)


if __name__ == "__main__":
    main()

"""SGLang's encoder server, as an adapter over the same encode path as /encode (api/encode.py): what an
SGLang language server started with `--language-only --encoder-urls http://HOST:PORT/sglang` calls.

    POST /sglang/encode                 one part of a request's items: encoded (or found in the store), its
                                        rows read back from the store and pushed to the language side
                                        (wire.py's message), then answered 200 null, as SGLang's encoder does
    POST /sglang/scheduler_receive_url  a tensor-parallel rank's address for a part (`zmq_to_scheduler`, the
                                        backend SGLang picks for Qwen3-VL): the part is pushed to each of its
                                        ranks (rendezvous.py finds them, whichever API process they reached)
    GET  /sglang/health                 200 while the service is healthy (SGLang drops an encoder after three
                                        failed checks of 2 s each)

A part that fails is answered in SGLang's own way: its error message pushed to the language side (which
fails that request with a 503 to its client, never a hang), and the HTTP status SGLang then reads. SGLang
never retries a part: one that finds the queue full waits for a place (--sglang-queue-wait-s) instead of
being refused. Handlers see bytes only: the rows travel from the store to the socket untouched.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from service.api import encode as encoding
from service.api.encode import Answer, ClientGone, Input
from service.api.parse import inputs_from_parts
from service.api.runtime import Runtime
from service.api.schemas import ImagePart, ImageURL, VideoPart, VideoURL
from service.api.sglang import wire
from service.api.sglang.push import Endpoint, PushFailed, Pusher
from service.api.sglang.rendezvous import PeerLink, Registrations
from service.errors import BackendError, Overloaded, RequestError, ServiceError, Unavailable, clip
from service.priority import Urgency
from service.store.format import StoreFormatError
from service.store.reader import Reader, open_reader

log = logging.getLogger(__name__)

# How long a registration nobody claimed is kept (SGLang's own encoder waits 180 s for a part's /encode).
REGISTRATION_KEEP_S = 180.0
_RETRY_FIRST_S, _RETRY_MAX_S = 0.005, 0.1  # waits between claims of a part that found the queue full


class Failure(Exception):
    """A part's answer when it failed: the HTTP status, and the message SGLang logs and fails the request with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class SglangEncoder:
    """SGLang's encoder endpoints of one serving process."""

    def __init__(self, rt: Runtime, link: PeerLink | None = None):
        s = rt.settings
        self.rt = rt
        self.pusher = Pusher(s.sglang_allowed_hosts, s.sglang_push_timeout_s)
        self.registrations = Registrations(link, REGISTRATION_KEEP_S)
        self._reader: Reader | None = None

    # ---- the endpoints ---------------------------------------------------------------------------------
    async def encode(self, body: wire.EncodeBody, body_bytes: int, caller: str | None,
                     client_gone: ClientGone) -> tuple[int, Any]:
        """(status, JSON) of one part; its message pushed first (success or error), where it can be. Counted
        in /metrics with /encode's requests, by status."""
        status, answer = await self._encode(body, body_bytes, caller, client_gone)
        self.rt.metrics.requests.labels(status=str(status)).inc()
        return status, answer

    async def _encode(self, body: wire.EncodeBody, body_bytes: int, caller: str | None,
                      client_gone: ClientGone) -> tuple[int, Any]:
        part = (body.req_id, body.num_parts, body.part_idx)
        try:
            self._check_caller(caller)
            modality = body.modality.upper()
            if body.part_idx >= body.num_parts:
                raise RequestError(f"part_idx {body.part_idx} is not below num_parts {body.num_parts}")
            if modality not in ("IMAGE", "VIDEO"):
                raise RequestError(f"modality {clip(body.modality)!r}: this encoder takes IMAGE and VIDEO parts")
            to = (None if body.embedding_port is None
                  else self.pusher.endpoint(body.prefill_host, body.embedding_port, "prefill_host"))
        except RequestError as e:  # (nothing is pushed: where to is not known, or not allowed)
            return _error(e.status, e.message, body.req_id)
        try:
            frames = await self._encoded(body, body_bytes, modality, client_gone)
            if frames is None:
                return 499, None  # SGLang gave up on the part and closed the connection: nobody to push to
        except Failure as f:
            await self._deliver(to, body.req_id, wire.error_frames(*part, modality, f.message, f.status), quietly=True)
            return _error(f.status, f.message, body.req_id)
        try:
            await self._deliver(to, body.req_id, frames)
        except Failure as f:
            return _error(f.status, f.message, body.req_id)
        return 200, None

    def register(self, body: wire.RegisterBody, caller: str | None) -> tuple[int, Any]:
        try:
            self._check_caller(caller)
            self.pusher.parse_receive_url(body.receive_url)
        except RequestError as e:
            return _error(e.status, e.message, body.req_id)
        self.registrations.register(body.req_id, body.receive_count, body.receive_url)
        return 200, None

    async def health(self) -> tuple[int, Any]:
        status, body = await self.rt.health()
        if status == 200 and not self.rt.ready:
            return 503, {"status": "starting"}
        return status, body

    def close(self) -> None:
        self.pusher.close()
        if self._reader is not None:
            self._reader.close()

    # ---- one part ------------------------------------------------------------------------------------
    def _check_caller(self, caller: str | None) -> None:
        if caller is None or not self.pusher.allowed(caller):
            raise RequestError(f"the caller {caller!r} is not in --sglang-allowed-hosts", code="forbidden")

    async def _encoded(self, body: wire.EncodeBody, body_bytes: int, modality: str,
                       client_gone: ClientGone) -> list | None:
        """The success message of the part (None: SGLang left); Failure for anything that failed."""
        try:
            inputs = await self._inputs(body, body_bytes, modality == "VIDEO", client_gone)
            if inputs is None:
                return None
            for attempt in range(2):
                answers = await self._encode_waiting(inputs, client_gone)
                if answers is None:
                    return None
                try:
                    data = await asyncio.to_thread(self._read_rows, answers)
                    break
                except KeyError:  # evicted since it was answered (past its residency): encoded again, once
                    if attempt:
                        raise Unavailable("the part's entries were evicted before they could be sent twice in a row; "
                                          "the store is too small for the load (--store-capacity-bytes)")
        except ServiceError as e:
            raise Failure(e.status, e.message) from None
        first = answers[0].stored
        rows = sum(a.stored.shape[0] for a in answers)
        stamps = [list(a.stored.video.timestamps) for a in answers] if modality == "VIDEO" else None
        return wire.success_frames(body.req_id, body.num_parts, body.part_idx, modality,
                                   [list(a.stored.grid_thw) for a in answers], first.dtype, (rows, first.shape[1]),
                                   data, stamps)

    async def _inputs(self, body: wire.EncodeBody, body_bytes: int, video: bool,
                      client_gone: ClientGone) -> list[Input] | None:
        s = self.rt.settings
        if len(body.mm_items) > s.max_images_per_request:
            raise RequestError(f"{len(body.mm_items)} items in one part; the limit is {s.max_images_per_request} "
                               "(--max-images-per-request)")
        parts, hashes = [], []
        for i, item in enumerate(body.mm_items):
            url, content_hash = _item(i, item)
            parts.append(VideoPart(video_url=VideoURL(url=url)) if video else ImagePart(image_url=ImageURL(url=url)))
            hashes.append(content_hash)
        inputs = await inputs_from_parts(self.rt, parts, body_bytes, client_gone)
        if inputs is None:
            return None
        for i, (inp, want) in enumerate(zip(inputs, hashes)):
            inp.name = f"mm_items[{i}]"
            if want is not None and want.removeprefix("sha256:").lower() != hashlib.sha256(inp.data).hexdigest():
                raise RequestError(f"mm_items[{i}]: its content_hash {clip(want)!r} is not the SHA-256 of its bytes")
        return inputs

    async def _encode_waiting(self, inputs: list[Input], client_gone: ClientGone) -> list[Answer] | None:
        """encode(), waiting for a queue place (or the engines' start) while --sglang-queue-wait-s allows. SGLang
        sends no priority (0) and no deadline: --default-deadline-ms applies, from here."""
        loop = asyncio.get_running_loop()
        urgency = Urgency.at_arrival(time.monotonic(), default_deadline_ms=self.rt.settings.default_deadline_ms)
        give_up = loop.time() + self.rt.settings.sglang_queue_wait_s
        pause = _RETRY_FIRST_S
        while True:
            try:
                await self.rt.require_ready()
                return await encoding.encode(self.rt, inputs, client_gone, urgency=urgency)
            except (Overloaded, Unavailable) as e:
                if (isinstance(e, Unavailable) and e.code != "unavailable") or loop.time() + pause > give_up:
                    raise
            await asyncio.sleep(pause)
            if await client_gone():
                return None
            pause = min(pause * 2, _RETRY_MAX_S)

    def _read_rows(self, answers: list[Answer]) -> bytes | bytearray | memoryview:
        """The items' rows, in order, read back from the store (a thread: file or Mooncake reads)."""
        if self._reader is None:
            s = self.rt.settings
            self._reader = (open_reader(s.store, local_host=s.mooncake_local_host, protocol=s.mooncake_protocol,
                                        timeout_s=s.mooncake_timeout_s) if s.store_is_mooncake else open_reader(s.store))
        try:
            rows = [self._reader.read_data(a.stored) for a in answers]
            return rows[0] if len(rows) == 1 else b"".join(rows)  # (one item, the most common part: no copy)
        except StoreFormatError as e:
            log.error("%s", e)
            raise BackendError("a stored entry changed before it could be sent; the server's log has it") from None

    async def _deliver(self, to: Endpoint | None, req_id: str, frames: list, quietly: bool = False) -> None:
        """Push the message to the part's destination (`to`), or to each rank registered for it, within
        --sglang-push-timeout-s from now; Failure (unless `quietly`: an error message that cannot be delivered is
        only logged) if any push fails."""
        deadline = asyncio.get_running_loop().time() + self.rt.settings.sglang_push_timeout_s
        try:
            if to is not None:
                await self.pusher.push(to, frames, deadline)
                return
            urls, whole = await self.registrations.urls(req_id, deadline)
            if not whole:  # (SGLang fails every rank of a part whose /encode is not a 200)
                raise Failure(504, f"{len(urls)} ranks registered for {clip(req_id)} within "
                                   f"{self.rt.settings.sglang_push_timeout_s:g} s (--sglang-push-timeout-s), fewer "
                                   "than it named")
            ends = [self.pusher.parse_receive_url(u) for u in urls]
            outcomes = await asyncio.gather(*(self.pusher.push(e, frames, deadline) for e in ends),
                                            return_exceptions=True)
            failed = next((o for o in outcomes if isinstance(o, BaseException)), None)
            if failed is not None:
                raise failed
        except PushFailed as e:
            if not quietly:
                raise Failure(502, str(e)) from None
            log.warning("the error message of %s was not delivered: %s", clip(req_id), e)
        except Failure as f:
            if not quietly:
                raise
            log.warning("the error message of %s was not delivered: %s", clip(req_id), f.message)


def _item(i: int, item: str | dict) -> tuple[str, str | None]:
    """(url, content_hash) of one of SGLang's mm_items: a URL, or a dict with one. A URL as SGLang's client
    gave it: a data URL, an http(s) URL (fetched from --allowed-url-hosts only), or bare base64."""
    content_hash = None
    if isinstance(item, dict):
        extra = sorted(set(item) - wire.ITEM_KEYS)
        if extra:
            raise RequestError(f"mm_items[{i}] has {', '.join(map(repr, extra))}: per-item preprocessing that this "
                               "encoder does not apply", code="unsupported_parameter")
        url, content_hash = item.get("url"), item.get("content_hash")
        if not isinstance(url, str) or not (content_hash is None or isinstance(content_hash, str)):
            raise RequestError(f"mm_items[{i}] needs a `url` string (and a `content_hash` string, if any)")
    else:
        url = item
    if url.startswith(("data:", "http://", "https://")):
        return url, content_hash
    if url.startswith("file:") or url.startswith("/") or "." in url[-6:]:
        raise RequestError(f"mm_items[{i}] names a file ({clip(url)!r}): this encoder reads no files of its host; "
                           "send the image as a data URL or base64, or an http(s) URL from --allowed-url-hosts")
    return "data:;base64," + url, content_hash  # (SGLang's clients may send bare base64)


def _error(status: int, message: str, req_id: str | None) -> tuple[int, dict]:
    return status, {"status": "error", "message": message, "req_id": req_id}

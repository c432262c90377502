"""Encode orchestration, behind the HTTP layer: keys, claims, decode, submit, and waiting for the answers.

`encode(rt, inputs, client_gone)` takes parsed inputs (bytes, an optional uuid, where they were fetched
from, image or video) and answers one `Answer` per input, in order, or None if the client went away first. It never
sees an HTTP request: app.py parses, calls it, and maps its answers and ServiceErrors to HTTP. One path
for every kind of process: the engine host (engine/host.py) decides hits, coalescing and admission,
whether it runs in this process or in an engine process (api/runtime.py says how it is reached).

Per request:
    keys     each image's key (its uuid or a content hash) and header tokens, in one thread hop; a video's
             from its container header (no frame decoded): its sampled frames, clip size and so its tokens
    admit    one Claim per distinct key, all in flight at once: Hit | Pending (joined) | Grant
    decode   each granted image decoded, then submitted under its grant; the first failure, or the client
             leaving, answers the request at once and gives back every grant (a decode still running
             gives its pixels back when it ends, and submits nothing)
    encode   every Pending answered (or the client gone: everything of the request given back)
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple

from service.api.runtime import Decoded, Runtime
from service.engine.client import Pending
from service.engine.messages import Grant, Hit
from service.errors import at_index, BackendError, DeadlineExceeded, ImageError, KeyConflict, ServiceError, VideoError
from service.media import video as media_video
from service.media.images import ImageHeader, check_complexity, header_tokens, read_header
from service.media.video_preprocess import plan_video
from service.priority import Urgency
from service.store.format import StoredItem
from service.store.keys import content_key, validate_key, video_salt

log = logging.getLogger(__name__)


@dataclass
class Input:
    """One image or video of a request, as parsed (app.py)."""

    data: bytes
    uuid: str | None
    source: str | None = None  # the URL it was fetched from (errors must not echo fetched content)
    video: bool = False  # a video part (`video_url`, or a multipart `video` file)
    name: str | None = None  # what errors call it: `video part 1` (multipart); None: its JSON path, images[i]

    def called(self, i: int) -> str:
        return self.name or f"images[{i}]"


class Answer(NamedTuple):
    """One image's answer: its entry in the store, and whether it was there before this request."""

    stored: StoredItem
    cached: bool


# A request whose images are this many bytes or fewer is keyed on the event loop, not in a thread: SHA-256
# runs at about 1 GB/s, so the hash takes at most ~0.25 ms, less than the thread hop it saves (0.49 ms of
# keys for a lone 50 KB image on an idle H200 host). A header is read
# from the first bytes only. Measured after: keys 0.35 against 0.57 ms idle, 0.36 against 1.60 ms p50 under load.
INLINE_KEY_BYTES = 256 * 1024

# Whether the client has gone away (the HTTP request's `is_disconnected`): polled while a request waits.
ClientGone = Callable[[], Awaitable[bool]]


class Phases:
    """Where one request's time went, for its `Server-Timing` response header (W3C Server Timing: browsers'
    developer tools and `curl -i` show it): each `mark(name)` ends the phase `name` that began at the
    previous mark. Wall time of this request, not CPU time: concurrent requests overlap."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.spans: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.spans.append((name, now - self._last))
        self._last = now

    def header(self) -> str:
        parts = [f"{name};dur={s * 1e3:.3f}" for name, s in self.spans]
        return ", ".join(parts + [f"total;dur={(self._last - self.start) * 1e3:.3f}"])


class _Keyed(NamedTuple):
    key: str  # the store key: the client's uuid, or the content key
    sha256: str  # of the image's bytes
    header: ImageHeader | media_video.VideoHeader  # read once, here; the decode reuses it
    tokens: int  # output tokens by its header (1 when an image's header is unusable: the decode says why)
    video_bytes: int = 0  # a video: its resized frames' bytes by its header (VideoPlan.nbytes)


async def encode(rt: Runtime, inputs: list[Input], client_gone: ClientGone,
                 phases: Phases | None = None, urgency: Urgency = Urgency()) -> list[Answer] | None:
    """Answer one item per input image, in order; None if the client went away first (its queued work
    is cancelled). Raises the request's ServiceError; nothing of a failed request stays queued. The
    caller has checked `await rt.require_ready()`. `phases` gets the marks keys, admit (claims and
    queue places), decode (decoded and queued) and encode (every answer in the store). `urgency`: the
    request's priority (its turn for a decoder and a step) and deadline (504 `deadline_exceeded` once it
    passes before an image is decoded or its step starts; a cached image is still answered)."""
    try:
        return await _encode(rt, inputs, client_gone, phases or Phases(), urgency)
    except DeadlineExceeded as e:
        rt.metrics.deadline_exceeded.labels(where=getattr(e, "where", "queue")).inc()
        raise


def _at(e: BaseException, where: str) -> BaseException:
    """`e`, a DeadlineExceeded marked with where it passed (/metrics' qve_deadline_exceeded counts by it)."""
    if isinstance(e, DeadlineExceeded):
        e.where = where
    return e


async def _encode(rt: Runtime, inputs: list[Input], client_gone: ClientGone, phases: Phases,
                  urgency: Urgency) -> list[Answer] | None:
    keyed = await _keys_for(rt, inputs)
    phases.mark("keys")
    engines, decoder = rt.engines, rt.decoder
    firsts: dict[str, int] = {}  # key -> the first image with it (a key twice in one request is handled once)
    for i, k in enumerate(keyed):
        firsts.setdefault(k.key, i)

    def conflict(i: int, where: str) -> KeyConflict:
        return at_index(KeyConflict(f"{inputs[i].called(i)}: uuid {keyed[i].key!r} is already bound to other image bytes "
                                    f"({where}); a uuid must name one image: choose another uuid, or leave it out"), i)

    answers: dict[str, Answer] = {}
    waits: dict[str, Pending] = {}
    grants: dict[str, Grant] = {}  # key -> its grant, until its image is submitted
    # Set once the request is answered without its images (an error, or its client gone): a decode that ends
    # later gives its pixels back and submits nothing.
    abandoned = False

    def give_back() -> None:
        nonlocal abandoned
        abandoned = True
        for p in waits.values():
            p.result.cancel()
            engines.cancel(p.id)
        for g in grants.values():
            engines.cancel(g.id)

    # Admission happens before decode (a full engine answers 429 before any pixels exist), except on an
    # idle API process: a request that finds no other request here decodes while its claims travel, so
    # a lone image does not pay the claim's round trip before its decode. Under load nothing is decoded
    # ahead of its grant. A speculative decode whose claim is not a grant gives its pixels back.
    loop = asyncio.get_running_loop()
    early: dict[str, asyncio.Future] = {}
    def start_decode(i: int) -> Awaitable[Decoded]:
        if inputs[i].video:
            return decoder.decode_video(inputs[i].data, keyed[i].header, rt.video, urgency)
        return decoder.decode(inputs[i].data, keyed[i].header, rt.params, urgency)

    if engines.travels and rt.requests_in_flight == 0:
        early = {key: loop.create_task(start_decode(i)) for key, i in firsts.items()}
    rt.requests_in_flight += 1

    def release_when_done(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is None:  # (a failed decode holds no pixels)
            decoder.release(f.result())

    def drop_early(keep: set[str]) -> None:
        for key in [k for k in early if k not in keep]:
            early.pop(key).add_done_callback(release_when_done)

    async def decode_and_submit(key: str, grant: Grant) -> None:
        i = firsts[key]
        try:
            decoded: Decoded = await (early.pop(key, None) or start_decode(i))
        except Exception as p:
            if abandoned:
                return  # (answered already: its grant was given back)
            raise _at(_decode_failure(inputs, i, p), "decode")
        if abandoned:  # its grant was given back when the request was answered; nobody wants these pixels
            decoder.release(decoded)
            return
        try:
            submitted = await engines.submit(grant.id, key, keyed[i].sha256, decoded.geometry, decoded.pixels,
                                             urgency)
        except KeyConflict as e:
            raise conflict(i, e.message) from None
        except ServiceError as e:
            if not engines.route(key).connected:  # never reached its engine: nothing else gives the pixels back
                decoder.release(decoded)
            raise _at(e, "submit")
        finally:
            del grants[key]  # a submit uses its grant up, answered or not
        if isinstance(submitted, Hit):  # stored meanwhile (another request's identical image)
            answers[key] = Answer(submitted.item, cached=True)
        elif abandoned:  # answered while the submit travelled: its wait goes, as give_back's would have
            submitted.result.cancel()
            engines.cancel(submitted.id)
        else:
            waits[key] = submitted

    def first_error(outcomes: list) -> BaseException | None:
        return next((o for o in outcomes if isinstance(o, BaseException)), None)

    stayed = False
    try:
        claims = await asyncio.gather(*(engines.claim(k, keyed[i].sha256, keyed[i].tokens, inputs[i].video, urgency)
                                        for k, i in firsts.items()), return_exceptions=True)
        for j, ((key, i), c) in enumerate(zip(firsts.items(), claims)):
            if isinstance(c, KeyConflict):
                claims[j] = conflict(i, c.message)
            elif isinstance(c, Hit):
                answers[key] = Answer(c.item, cached=True)
            elif isinstance(c, Grant):
                grants[key] = c
            elif isinstance(c, Pending):
                waits[key] = c
        if (err := first_error(claims)) is not None:
            raise _at(err, "claim")
        phases.mark("admit")
        drop_early(keep=set(grants))
        # Each image is submitted as soon as it is decoded. The request is answered at its first failure or
        # when its client leaves, not when its slowest decode ends: its queue places are given back then
        # (clients of scan bombs that left after 5 s held the whole queue while their decodes ran).
        decoding = [_finish_alone(loop.create_task(decode_and_submit(k, g))) for k, g in list(grants.items())]
        stayed = await _done_or_disconnect(client_gone, decoding)
        if stayed:
            phases.mark("decode")
    except BaseException:
        drop_early(keep=set())  # those not submitted (a submitted one has left `early`)
        give_back()  # the request is answered with its error as a whole: nothing of it stays queued
        raise
    finally:
        rt.requests_in_flight -= 1
    if not stayed:
        drop_early(keep=set())
        give_back()
        return None
    if not await _wait_or_disconnect(client_gone, [p.result for p in waits.values()]):
        give_back()
        return None
    phases.mark("encode")
    images = rt.metrics.images
    images.labels(outcome="cached").inc(len(answers))
    for key, p in waits.items():
        answers[key] = Answer(p.result.result(), cached=False)
        images.labels(outcome="coalesced" if p.coalesced else "encoded").inc()
    return [answers[k.key] for k in keyed]


async def _keys_for(rt: Runtime, inputs: list[Input]) -> list[_Keyed]:
    """Each image's key, the SHA-256 of its bytes, its header and the tokens it declares (what admission
    counts before decode); 409 when one uuid is given to different images in one request."""
    for i, inp in enumerate(inputs):
        if not inp.data:
            raise at_index(ImageError(f"{inp.called(i)} is empty (0 bytes); send the encoded image or video file",
                                      code="empty_image"), i)
        if inp.uuid is not None:
            validate_key(inp.uuid, content_keys=False)  # a client cannot take a content key
    params, limits, salt, vllm = rt.params, rt.settings.image_limits, rt.key_salt, rt.vllm_keys
    vsalt = video_salt(salt, rt.video)
    queue_tokens = rt.settings.max_queue_tokens

    def one(i: int, inp: Input) -> _Keyed:
        digest = hashlib.sha256(inp.data).digest()
        if inp.video:
            if vllm is not None and inp.uuid is None:
                raise at_index(VideoError(
                    f"images[{i}]: a video needs a `uuid` here (--vllm-model-id): vLLM keys a video with its "
                    "loader's metadata, which this encoder does not reproduce; send the key the LM will look up "
                    "as the part's uuid", code="invalid_video"), i)
            return _video_keyed(i, inp, digest, vsalt, rt.video, rt.settings.video_limits, queue_tokens)
        header = read_header(inp.data, limits)
        if inp.uuid is not None:
            key = inp.uuid
        elif vllm is not None:  # vLLM's own key, which its LM computes for this item (a hash of the bytes)
            key = vllm.image(inp.data, converted=header.plain_rgb is False)
        else:
            key = content_key(salt, digest)
        try:
            check_complexity(header, limits)  # a scan bomb is refused here: no queue place, no decode
        except ImageError as e:
            raise _named(inp, i, e) from None
        return _Keyed(key, digest.hex(), header, header_tokens(header, params, limits))

    # Every image in one thread hop: a hop each cost an 8-image request 8 event-loop round trips through
    # the executor (~0.1-0.2 ms of a lone image's latency on an idle server). Small images (all the bytes within
    # INLINE_KEY_BYTES, no video) are keyed on the event loop: hashing 256 KB takes less than the hop.
    work = lambda: [one(i, inp) for i, inp in enumerate(inputs)]  # noqa: E731
    inline = not any(inp.video for inp in inputs) and sum(len(inp.data) for inp in inputs) <= INLINE_KEY_BYTES
    keyed = work() if inline else await asyncio.to_thread(work)
    bound: dict[str, str] = {}  # key -> the image bytes' sha256 it names in this request
    video_bytes, budget = 0, rt.settings.video_max_request_bytes
    for i, k in enumerate(keyed):
        first = k.key not in bound  # (a key twice in one request is decoded once)
        if bound.setdefault(k.key, k.sha256) != k.sha256:
            raise at_index(KeyConflict(f"{inputs[i].called(i)}: uuid {k.key!r} is also given to other image bytes earlier in "
                                       "this request; one uuid names one image"), i)
        if first and k.video_bytes:
            video_bytes += k.video_bytes
            if video_bytes > budget:
                raise at_index(VideoError(f"images[{i}]: the request's videos up to this one are {video_bytes} bytes once "
                                          f"resized; the limit is {budget} a request (--video-max-request-bytes): send "
                                          "fewer, shorter or smaller videos in one request", code="video_too_large"), i)
    return keyed


def _video_keyed(i: int, inp: Input, digest: bytes, salt: bytes, params: media_video.VideoParams,
                 limits, queue_tokens: int) -> _Keyed:
    """A video's key and tokens from its container header alone (admission before decode: a long video
    is refused or counted before any frame exists). Its VideoError, as the request's answer."""
    key = inp.uuid if inp.uuid is not None else content_key(salt, digest)
    try:
        header = media_video.read_header(inp.data, limits)
        plan = plan_video(header, params)
        if plan.tokens > queue_tokens:
            raise VideoError(f"the video becomes {plan.tokens} tokens ({len(plan.indices)} frames sampled, grid "
                                f"{list(plan.grid_thw)}), more than the queue ever holds ({queue_tokens}, "
                                "--max-queue-tokens); send a shorter clip", code="video_too_large")
        for limit, flag, where in ((limits.max_process_bytes, "--video-max-process-bytes", "a process decodes at once"),
                                   (limits.max_request_bytes, "--video-max-request-bytes", "a request")):
            if plan.nbytes > limit:
                raise VideoError(f"the video is {plan.nbytes} bytes once resized ({plan.frames} frames of "
                                 f"{plan.width}x{plan.height}); the limit is {limit} for the videos {where} ({flag}): "
                                 "send a shorter or smaller clip", code="video_too_large")
    except VideoError as e:
        raise _named(inp, i, e) from None
    return _Keyed(key, digest.hex(), header, plan.tokens, plan.nbytes)


def _named(inp: Input, i: int, p: ServiceError) -> ServiceError:
    """An image's or video's own error, named by its place in the request (and never echoing fetched content)."""
    if inp.source is not None:  # never echo fetched content (an SSRF read primitive)
        what = "video" if inp.video else "image"
        p.message = f"the content fetched from {inp.source} is not a usable {what} ({p.code}); check the URL"
    p.message = f"{inp.called(i)}: {p.message}"
    return at_index(p, i)


async def watch_client(client_gone: ClientGone, first_after_s: float = 0.0) -> None:
    """Returns once the client has gone (polled every 50 ms, the first time after `first_after_s`)."""
    await asyncio.sleep(first_after_s)
    while not await client_gone():
        await asyncio.sleep(0.05)


# Tasks that outlive the request that started them (a decode still running when its request was answered):
# held here until done, as the event loop keeps only weak references to tasks.
_finishing: set[asyncio.Task] = set()


def _finish_alone(task: asyncio.Task) -> asyncio.Task:
    """`task`, kept alive until it is done, its outcome retrieved then (never 'exception was never retrieved':
    one that fails after its request was answered has nobody to tell)."""
    _finishing.add(task)

    def done(t: asyncio.Task) -> None:
        _finishing.discard(t)
        if not t.cancelled():
            t.exception()

    task.add_done_callback(done)
    return task


async def _done_or_disconnect(client_gone: ClientGone, tasks: list[asyncio.Task]) -> bool:
    """Wait until every task is done: True; the first to fail raises its error at once, and False if the
    client went away first. Either way the tasks not done go on running (each must cope with that)."""
    pending = set(tasks)
    if not pending:
        return True
    # The first poll after 50 ms: a decode done by then (most are) costs no check of the connection.
    watcher = asyncio.create_task(watch_client(client_gone, first_after_s=0.05))
    try:
        while pending:
            done, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                return False
            pending.discard(watcher)
            for t in done:
                if (err := t.exception()) is not None:
                    raise err
        return True
    finally:
        watcher.cancel()


async def _wait_or_disconnect(client_gone: ClientGone, futures: list[asyncio.Future]) -> bool:
    """Wait for all futures; False if the client went away first."""
    gathered = asyncio.gather(*futures)
    watcher = asyncio.create_task(watch_client(client_gone))
    try:
        done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if gathered in done:
        gathered.result()  # re-raise a step failure
        return True
    gathered.cancel()
    return False


def _decode_failure(inputs: list[Input], i: int, p: BaseException) -> ServiceError:
    """The error to answer for image i whose decode raised `p` (raise it as it is: its cause is set)."""
    if isinstance(p, (ImageError, VideoError)):
        return _named(inputs[i], i, p)
    if isinstance(p, ServiceError):
        return p
    log.error("decoding %s failed: %r", inputs[i].called(i), p)
    err = BackendError(f"decoding {inputs[i].called(i)} failed ({type(p).__name__}); the server's log has the error")
    err.__cause__ = p
    return err

"""Request parsing for /encode: bodies (JSON or multipart), data URLs, and http(s) image and video URLs
fetched from allow-listed hosts. Images and videos share one list (`images`: image_url and video_url parts;
multipart: `image` and `video` file parts, in their order). Answers parsed `Input`s (None when the client
left during a fetch), or raises the ServiceError that says what was wrong.

A fetch is bounded three ways: its bytes (its item's limit while it streams, and the request's budget:
its body and everything its URLs fetch together within --max-request-bytes), its time (--url-timeout-s for
the whole fetch, name resolution included, not per read: a server dripping a byte per read never times
a read out), and its client (a fetch whose client has gone is cancelled, and so is every fetch when the
server stops: Runtime.stop_fetches, so that a fetch never holds the drain)."""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import socket
from urllib.parse import urlsplit

import httpx
import pybase64
from fastapi import Request
from pydantic import ValidationError

from service.api.encode import ClientGone, Input, watch_client
from service.api.runtime import Runtime
from service.api.schemas import EncodeRequest, ImagePart, Urgent, VideoPart, describe_invalid
from service.errors import at_index, clip, ImageError, RequestError, ServiceError, Unavailable, VideoError


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ImageError(f"request body is {int(declared)} bytes, over the limit of {limit}; send fewer or smaller images", code="image_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ImageError(f"request body is over the limit of {limit} bytes; send fewer or smaller images", code="image_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(video: bool, message: str, index: int) -> ServiceError:
    err = VideoError(message, code="video_too_large") if video else ImageError(message, code="image_too_large")
    return at_index(err, index)


def _decode_data_url(url: str, index: int, max_bytes: int, video: bool = False) -> bytes:
    field, kind = ("video_url", "video") if video else ("image_url", "image")
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:") or not head.endswith(";base64"):
        raise RequestError(f"images[{index}].{field}.url must be a data URL 'data:{kind}/<fmt>;base64,<data>' "
                         f"or an allowed http(s) URL")
    if len(payload) > (max_bytes * 4) // 3 + 4:
        raise _too_large(video, f"images[{index}] is over the limit of {max_bytes} bytes", index)
    try:
        # pybase64: ~30x the standard library's speed, so far less time holding the GIL (8 vs 249 us a JPEG)
        return pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(f"images[{index}].{field}.url has invalid base64 data: {_base64_fault(payload)}") from None


_BASE64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def _base64_fault(payload: str) -> str:
    """What is wrong with base64 text that did not decode, said so that a client can fix it (the decoder's
    own "Non-base64 digit found" is said of a missing '=' padding too). Only on the error path."""
    bad = next((i for i, c in enumerate(payload) if c not in _BASE64_ALPHABET), None)
    if bad is not None:
        char = payload[bad]
        hint = {"-": "URL-safe base64: use + and /", "_": "URL-safe base64: use + and /"}.get(
            char, "whitespace is not allowed" if char.isspace() else "not a base64 character")
        return f"character {char!r} at position {bad} ({hint})"
    if len(payload) % 4:
        return (f"its length, {len(payload)} characters, is not a multiple of 4: is its '=' padding missing? "
                "(standard base64 with padding)")
    return "'=' padding before its end"


def _url_host(url: str, index: int, video: bool = False) -> tuple[str, int]:
    """(host, port) of an http(s) URL, or `bad_request` for one that does not parse."""
    field = "video_url" if video else "image_url"
    try:
        parts = urlsplit(url)
        host, port = (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # "Invalid IPv6 URL", a port out of range, ...
        raise RequestError(f"images[{index}].{field}.url is not a valid URL: {e}") from None
    if not host or any(c.isspace() or ord(c) < 32 for c in url):
        raise RequestError(f"images[{index}].{field}.url is not a valid URL (no host, or whitespace or control "
                         "characters in it)")
    return host, port


async def _check_resolves_public(rt: Runtime, host: str, port: int, index: int) -> None:
    """Refuse a host that resolves to loopback, private, link-local or otherwise non-public addresses
    (the service's own /metrics, cloud metadata endpoints), unless --allow-private-url-addresses.
    NOTE: checked at resolution; the fetch resolves again, so a DNS-rebinding host could still switch
    addresses in between. Only allow-listed hosts get here."""
    if rt.settings.allow_private_url_addresses:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise at_index(ImageError(f"images[{index}]: cannot resolve {host!r}: {e}", code="image_fetch_failed"), index) from None
    for *_, sockaddr in infos:
        addr = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not addr.is_global:
            raise at_index(ImageError(f"images[{index}]: {host!r} resolves to {addr}, a loopback, private or "
                                           "link-local address; such fetches are refused (--allow-private-url-addresses)", code="image_fetch_failed"),
                           index)


class _Budget:
    """The bytes one request may still bring in: --max-request-bytes less its body, shared by its fetches."""

    def __init__(self, limit: int, body: int):
        self.limit, self.left = limit, limit - body

    def take(self, n: int, index: int) -> None:
        self.left -= n
        if self.left < 0:
            raise at_index(RequestError(f"images[{index}]: the request's body and what its URLs fetched are over "
                                        f"{self.limit} bytes together (--max-request-bytes); send fewer or smaller "
                                        "images and videos per request", code="request_too_large"), index)


async def _fetch_url(rt: Runtime, url: str, index: int, video: bool, budget: _Budget,
                     client_gone: ClientGone) -> bytes | None:
    """The URL's bytes, within its bounds (the module's docstring); None if the client left meanwhile."""
    host, port = _url_host(url, index, video)
    if host not in rt.settings.allowed_url_hosts:
        raise at_index(ImageError(f"images[{index}]: fetching from {host!r} is not allowed; send a data URL, or add "
                                       f"the host to --allowed-url-hosts", code="image_fetch_failed"), index)
    if rt.stopping:
        raise Unavailable("the service is shutting down; send the request to another instance")
    timeout_s = rt.settings.url_timeout_s
    fetch = asyncio.ensure_future(asyncio.wait_for(_get(rt, url, host, port, index, video, budget), timeout_s))
    rt.fetches.add(fetch)
    watcher = asyncio.ensure_future(watch_client(client_gone))
    try:
        done, _ = await asyncio.wait({fetch, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        rt.fetches.discard(fetch)
        if not fetch.done():  # the client left (or this request was cancelled): the fetch goes with it
            fetch.cancel()
    if fetch not in done:  # the client left: nobody to answer
        return None
    if fetch.cancelled():  # Runtime.stop_fetches: the server stops, and answers at once
        raise Unavailable("the service is shutting down; send the request to another instance")
    try:
        return fetch.result()
    except asyncio.TimeoutError:
        raise at_index(ImageError(f"images[{index}]: fetching {url} did not finish within {timeout_s:g} s "
                                  "(--url-timeout-s, for the whole fetch)", code="image_fetch_failed"), index) from None


async def _get(rt: Runtime, url: str, host: str, port: int, index: int, video: bool, budget: _Budget) -> bytes:
    await _check_resolves_public(rt, host, port, index)
    limit = rt.settings.video_max_bytes if video else rt.settings.max_image_bytes
    try:
        async with rt.http.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise at_index(ImageError(f"images[{index}]: GET {url} answered {resp.status_code}", code="image_fetch_failed"), index)
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:  # refused before its body is read
                raise _too_large(video, f"images[{index}]: {url} is {int(declared)} bytes, over the limit of {limit}", index)
            if declared.isdigit():
                budget.take(int(declared), index)
            chunks, size = [], 0
            async for chunk in resp.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _too_large(video, f"images[{index}]: {url} is over the limit of {limit} bytes", index)
                if not declared.isdigit() or size > int(declared):
                    budget.take(len(chunk), index)
                chunks.append(chunk)
            return b"".join(chunks)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise at_index(ImageError(f"images[{index}]: could not fetch {url}: {type(e).__name__}: {e}", code="image_fetch_failed"), index) from None


def _content_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _json_limit(s) -> int:
    """The largest JSON body read: --max-request-bytes, or what the most images a request may have take as
    base64 and a little more, if that is less."""
    return min(s.max_request_bytes, s.max_images_per_request * s.max_image_bytes * 4 // 3 + 65536)


async def read_json_body(request: Request, s) -> bytes:
    """A JSON request's body, bounded (its content type checked: JSON, or none given)."""
    ctype = _content_type(request)
    if ctype not in ("application/json", ""):
        raise RequestError(f"content-type {ctype!r} is not supported; send application/json")
    return await _read_body(request, _json_limit(s))


async def inputs_from_parts(rt: Runtime, parts: list[ImagePart | VideoPart], body_bytes: int,
                            client_gone: ClientGone) -> list[Input] | None:
    """Each image_url / video_url part's bytes (a data URL decoded, an allow-listed URL fetched, what the
    fetches bring counted with the body's `body_bytes` against --max-request-bytes), in order; None if the
    client left while a URL was fetched."""
    s = rt.settings
    inputs = []
    budget = _Budget(s.max_request_bytes, body_bytes)
    for i, part in enumerate(parts):
        video = isinstance(part, VideoPart)
        url = part.video_url.url if video else part.image_url.url
        if url.startswith("data:"):
            data = _decode_data_url(url, i, s.video_max_bytes if video else s.max_image_bytes, video)
        elif url.startswith(("http://", "https://")):
            data = await _fetch_url(rt, url, i, video, budget, client_gone)
            if data is None:
                return None  # the client left while it was fetched
            inputs.append(Input(data, part.uuid, source=url, video=video))
            continue
        else:
            raise RequestError(f"images[{i}].{'video_url' if video else 'image_url'}.url must start with data:, "
                               "http:// or https://")
        inputs.append(Input(data, part.uuid, video=video))
    return inputs


async def parse_inputs(rt: Runtime, request: Request) -> tuple[list[Input] | None, Urgent]:
    """/encode's inputs (None: the client left while a URL was fetched) and the request's priority and deadline."""
    s = rt.settings
    ctype = _content_type(request)
    if ctype == "multipart/form-data":
        try:
            form = await request.form(max_files=s.max_images_per_request, max_fields=2 * s.max_images_per_request + 2)
        except ServiceError:
            raise  # `request_too_large` from the body limit, as it is
        except Exception as e:  # starlette raises MultiPartException / HTTPException on malformed bodies
            raise RequestError(f"malformed multipart body: {e}") from None
        files = [(name, f) for name, f in form.multi_items() if name in ("image", "video")]  # in their order
        uuids = form.getlist("uuid")
        if not files:
            raise RequestError("multipart request has no 'image' or 'video' file parts")
        if uuids and len(uuids) != len(files):
            raise RequestError(f"got {len(uuids)} 'uuid' fields for {len(files)} images and videos; send one per "
                             "part or none")
        inputs = []
        for i, (name, f) in enumerate(files):
            if isinstance(f, str):
                raise RequestError(f"'{name}' part {i} is a text field; send it as a file part")
            video = name == "video"
            limit = s.video_max_bytes if video else s.max_image_bytes
            data = await f.read(limit + 1)
            where = f"{name} part {i}"  # (by its field and its place among the file parts: `index`)
            if len(data) > limit:
                raise _too_large(video, f"{where} is over the limit of {limit} bytes", i)
            inputs.append(Input(data, uuids[i] if uuids else None, video=video, name=where))
        return inputs, _form_urgency(form)
    if ctype not in ("application/json", ""):
        raise RequestError(f"content-type {ctype!r} is not supported; send application/json or multipart/form-data")
    body = await _read_body(request, _json_limit(s))
    try:
        req = EncodeRequest.model_validate_json(body)
    except ValidationError as e:
        raise RequestError(describe_invalid(e)) from None
    if len(req.images) > s.max_images_per_request:
        raise RequestError(f"{len(req.images)} images in one request; the limit is {s.max_images_per_request}")
    return await inputs_from_parts(rt, req.images, len(body), request.is_disconnected), req


def _form_urgency(form) -> Urgent:
    """A multipart request's `priority` and `deadline_ms` fields (integers, at most one each), as the JSON
    body's fields would be."""
    fields = {}
    for name in Urgent.model_fields:
        values = form.getlist(name)
        if len(values) > 1 or (values and not isinstance(values[0], str)):
            raise RequestError(f"multipart field {name!r}: send it once, as a text field")
        if values:
            try:
                fields[name] = int(values[0])
            except ValueError:
                raise RequestError(f"multipart field {name!r} must be an integer, got {clip(values[0])!r}") from None
    try:
        return Urgent(**fields)
    except ValidationError as e:
        raise RequestError(describe_invalid(e)) from None

"""What the API side and an engine host say to each other: one tagged union each way (msgspec Structs).

The same messages travel in process (a single-process service: the host is called directly) and over
a Unix socket as msgpack frames (API processes of a supervised service: procs/ipc.py). Pixels never
travel in a message: a Submit names an arena cell (socket) or comes with the pixel array beside it
(in process).

    API side -> host                    host -> API side
    Claim(id, key, sha256, ...)         Hit(id, item) | Joined(id) | Grant(id) | Failed(id, ...)
    Submit(id, grant, key, ...)         Hit(id, item) | Queued(id) | Failed(id, ...); after Queued,
                                        Result(id, item) | Failed(id, ...)
    Cancel(id)  (a grant or a wait)     (nothing: the waiter has gone)
    StatusQuery(id)                     Status(id, status)
    MetricsQuery(id)                    MetricsText(id, text)
                                        CellFree(cell): nothing will read that arena cell again

A Claim is admission before decode: a Grant holds one queue place (counted with the image's tokens
from its header) until its Submit, a Cancel, or the connection closing. A Joined claim and a Queued
submit get their Result later. Exactly one CellFree follows each Submit that carried a cell.

Imports no torch and no numpy: API processes use these.
"""

from __future__ import annotations

import msgspec

from service.media.params import PreprocessParams, VideoParams
from service.store.format import StoredItem


class Cell(msgspec.Struct, frozen=True):
    """Pixels in an API process's shared-memory arena (procs/arena.py): segment name, byte offset, size."""

    segment: str
    offset: int
    nbytes: int


class VideoInfo(msgspec.Struct, frozen=True):
    """What a decoded video is beside its shape: its frames, and what its store entry records."""

    frames: int  # resized frames in the pixels, 2 per temporal group (an odd count padded with the last)
    indices: tuple[int, ...]  # the source frames sampled
    fps: float  # the source's average frame rate
    timestamps: tuple[float, ...]  # seconds of each temporal group


class Geometry(msgspec.Struct, frozen=True):
    """A decoded image's or video's shape as the decoder produced it; the host checks it against the pixels."""

    height: int  # resized pixels, multiples of patch * merge
    width: int
    grid_thw: tuple[int, int, int]  # (1, height / patch, width / patch); a video: (groups, ...)
    tokens: int  # output tokens: grid patches / merge**2
    video: VideoInfo | None = None  # None: an image


# ---- API side -> engine host ------------------------------------------------------------------------
class Claim(msgspec.Struct, tag=True):
    id: int
    key: str
    sha256: str  # of the image's encoded bytes (a uuid bound to other bytes is a conflict)
    tokens: int  # output tokens by the image's header: what its queue place counts
    video: bool = False  # a video part: an image's entry under the same key (a uuid) is no hit for it
    priority: int = 0  # its request's (lower first: service/priority.py)
    deadline: float | None = None  # its request's, on time.monotonic() (one clock for the host's processes)


class Submit(msgspec.Struct, tag=True):
    id: int
    grant: int  # the Claim id whose Grant this uses up
    key: str
    sha256: str
    geometry: Geometry
    cell: Cell | None = None  # where the pixels are (socket); None in process (the array travels beside)
    traceparent: str | None = None  # the submitting request's span (W3C), when tracing is on: the engine's spans' parent
    priority: int = 0  # as its Claim's
    deadline: float | None = None


class Cancel(msgspec.Struct, tag=True):
    id: int  # a Claim's grant or wait, or a Submit's wait


class StatusQuery(msgspec.Struct, tag=True):
    id: int


class MetricsQuery(msgspec.Struct, tag=True):
    id: int


ToEngine = Claim | Submit | Cancel | StatusQuery | MetricsQuery


# ---- engine host -> API side ------------------------------------------------------------------------
class ModelInfo(msgspec.Struct, frozen=True):
    """What /ready shows about an engine's model (with `ready`)."""

    model: str
    device: str
    dtype: str
    random_weights: bool
    out_hidden_size: int
    deepstack_levels: int
    compiled: bool
    cuda_graphs: int
    startup_s: dict[str, float | int]  # seconds per start-up phase ("graphs": a count)
    # The preprocessing bounds in force (--min-pixels / --max-pixels or the checkpoint's): a client that
    # recomputes embeddings (the load tool's --verify) must resize the same way.
    min_pixels: int
    max_pixels: int
    store: str  # the store root: where a consumer on this machine reads the answered `path`s
    fp8_blocks: list[int] = []  # --dtype fp8: the blocks whose GEMMs run in FP8 (dtype is the activations')
    fp8_gemms: list[str] = []  # --dtype fp8: which of those blocks' GEMMs (qkv, fc1, fc2)
    attention: str = ""  # which kernel runs attention, by layout and segment length (AttentionPlan.describe)


class EngineStatus(msgspec.Struct, frozen=True):
    ready: bool  # warmed up and its step loop running
    failed: str | None  # why it will never be ready or has stopped (warm-up failed, the step loop died)
    store_error: str | None  # why the store cannot be written, if it cannot
    # Every engine must key and preprocess alike: an API process hashes and resizes with these.
    key_salt: str
    params: PreprocessParams
    video: VideoParams  # how a video is sampled and resized (and part of its key)
    pid: int
    info: ModelInfo


class Hit(msgspec.Struct, tag=True):
    id: int
    item: StoredItem


class Joined(msgspec.Struct, tag=True):
    id: int  # the identical image queued or running already; its Result follows


class Grant(msgspec.Struct, tag=True):
    id: int  # decode the image, then Submit with grant=id


class Queued(msgspec.Struct, tag=True):
    id: int
    coalesced: bool = False  # joined an identical image queued meanwhile (these pixels were not needed)


class Result(msgspec.Struct, tag=True):
    id: int
    item: StoredItem


class Failed(msgspec.Struct, tag=True):
    id: int
    code: str  # a ServiceError code (errors.py); the API side raises that class again
    message: str
    retry_after_s: int | None = None


class CellFree(msgspec.Struct, tag=True):
    cell: Cell


class Status(msgspec.Struct, tag=True):
    id: int
    status: EngineStatus


class MetricsText(msgspec.Struct, tag=True):
    id: int
    text: str  # Prometheus exposition of the engine's families (steps, queue, store)


FromEngine = Hit | Joined | Grant | Queued | Result | Failed | CellFree | Status | MetricsText

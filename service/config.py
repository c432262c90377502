"""One validated configuration object, built once at start-up and passed down explicitly.

Every setting can come from a CLI flag (`python -m service serve --max-batch-tokens 8192`) or from
the environment with the `QVE_` prefix (`QVE_MAX_BATCH_TOKENS=8192`); a flag wins over the
environment. Nothing on the hot path reads the environment.

Only the entry points (the single-process runtime, the engine process, benchmarks) read Settings. What
each part needs is derived from it once, as a frozen options object of its own: `Settings.runner_options()`
(RunnerOptions), `Settings.batch_limits()` (BatchLimits), `Settings.store_options()` (StoreOptions).
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.media.params import ImageLimits, VideoLimits
from service.sizes import Bytes, parse_size
from service.store.options import MOONCAKE_BUFFER_BYTES, MOONCAKE_SCHEME, MOONCAKE_START_WAIT_S, MOONCAKE_TIMEOUT_S, MooncakeOptions, StoreOptions, default_store_dir, parse_mooncake


def default_compile_cache() -> Path:
    # Under the user's cache directory (XDG), so a restart finds the compiled kernels of the last run.
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "qwen3vl-encoder" / "compile"


@dataclass(frozen=True)
class BatchLimits:
    """The batcher's limits (service/engine/batcher.py): step size and admission."""

    max_batch_tokens: int  # step token budget (output tokens after the 2x2 merge)
    max_batch_images: int
    max_wait_s: float  # a batch closes at most this long after its oldest item was enqueued
    max_queue_images: int  # admission limit on unscheduled items; beyond it submit raises Overloaded
    # Admission limit on the unscheduled items' output tokens (a token is 4 patches of 16x16 pixels, so
    # this bounds the queued pixels too): a few huge images cannot fill memory under the image count.
    # An item is always admitted into an empty queue, so no single image is refused for its size here.
    max_queue_tokens: int | None = None
    priority_aging_s: float = 10.0  # aging between priority levels (service/priority.py); 0: strict priority

    def __post_init__(self) -> None:
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be > 0, got {self.max_batch_tokens}")
        if self.max_batch_images <= 0:
            raise ValueError(f"max_batch_images must be > 0, got {self.max_batch_images}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if self.max_queue_images <= 0:
            raise ValueError(f"max_queue_images must be > 0, got {self.max_queue_images}")
        if self.max_queue_tokens is not None and self.max_queue_tokens <= 0:
            raise ValueError(f"max_queue_tokens must be > 0, got {self.max_queue_tokens}")


FAULT_ENV = "QVE_FAULT_INJECT"  # test-only fault injection (FaultInjection), read by the entry points


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults, `QVE_FAULT_INJECT=stall=CYCLES[,no-fence]`: the soak's control run
    (`qwen3vl-encoder soak --fault-inject`) proves it catches the corruption a missing fence causes on a
    lagging GPU. Never set it in service."""

    stall_cycles: int = 0  # a device sleep queued before each step's H2D copies (a GPU that lags)
    fence: bool = True  # False: the staging pool overwrites slots without waiting for the device

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> FaultInjection:
        """The faults `QVE_FAULT_INJECT` asks for (none when unset). Raises ValueError for an unknown one."""
        spec = environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        stall, fence = 0, True
        for part in spec.split(","):
            name, _, value = part.strip().partition("=")
            if name == "stall":
                stall = int(value)
            elif name == "no-fence":
                fence = False
            else:
                raise ValueError(f"{FAULT_ENV}: unknown fault {part!r} (known: stall=CYCLES, no-fence)")
        return cls(stall_cycles=stall, fence=fence)


@dataclass(frozen=True, kw_only=True)
class RunnerOptions:
    """What the engine's Runner needs (Settings.runner_options): staging capacity, pool depth, CUDA
    graphs and torch.compile."""

    max_batch_tokens: int  # with the model's max_pixels, the patches a step's buffers hold
    max_batch_images: int  # images a step's buffers hold
    pool_slots: int  # pinned staging slots, and as many output buffers
    cuda_graphs: bool  # replay the tower from CUDA graphs (where the tower is fast: CUDA, bf16/fp16)
    graph_max_patches: int  # the largest step replayed from a graph
    graph_exact_sides: tuple[int, ...]  # square sides whose equal steps get unpadded graphs
    graph_exact_images: int  # ... of 1..this many images
    compile: bool  # torch.compile the tower (where it is fast)
    attention: str  # "auto" (measure a plan at start-up) or a Backend's value to force (attention.py)
    compile_cache: Path  # on-disk compile caches (runner.use_compile_cache; the entry points set it up)
    faults: FaultInjection = FaultInjection()  # none, unless a test asks (FaultInjection.from_env)


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """Everything one engine is built from (Settings.engine_options; engine/host.py's build_host)."""

    runner: RunnerOptions
    store: StoreOptions
    limits: BatchLimits
    warmup: bool  # run one step through the whole path before saying ready


# The media limits' defaults are media/params.py's: one set, which the fields below take.
_IMAGE, _VIDEO = ImageLimits(), VideoLimits()


# The SGLang releases whose encoder protocol is served (api/sglang/; tests run against each).
SGLANG_VERSIONS = ("0.5.22", "0.5.23")


def _named_device(d: str) -> bool:
    """cpu, cuda or cuda:N (what --device takes besides auto, and each --devices entry)."""
    return d in ("cpu", "cuda") or (d.startswith("cuda:") and d[5:].isdigit())


def usable_cores() -> int:
    """The cores this process may run on (its affinity), or all of them where that cannot be read."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_api_processes() -> int:
    """A quarter of the cores this process may use, 1-8: on an H200 host with 16 cores 4 API processes
    served more than 8 (554 against 507 img/s over HTTP), the rest of the cores going to their decode threads, the engine and the store writers."""
    return max(1, min(8, usable_cores() // 4))


def is_size(name: str) -> bool:
    """Whether the setting `name` is a byte count (annotated `Bytes`): a SIZE flag, its default shown as `4GiB`."""
    return any(isinstance(m, BeforeValidator) and m.func is parse_size for m in Settings.model_fields[name].metadata)


def check_otlp_endpoint(v: str | None) -> str | None:
    """--otlp-endpoint (serve, consume, route): an http(s) URL, or None; ValueError says what is wrong."""
    if v is not None and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", v):
        raise ValueError(f"the OTLP endpoint must be an http(s) URL such as http://127.0.0.1:4318, got {v!r}")
    return v


class Settings(BaseSettings):
    """All service settings. Field names are the CLI flags with '-' for '_'; service/flags.py groups them for
    `serve --help` and docs/configuration.md."""

    model_config = SettingsConfigDict(env_prefix="QVE_", extra="forbid")

    model: str = Field("qwen3-vl-2b", description="preset name or local Hugging Face checkpoint directory")
    device: str = Field("auto", description="cpu, cuda, cuda:N, or auto (cuda when available)")
    devices: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="one engine process per device, comma-separated (cuda:0,cuda:1); the "
        "store's keys are split between them (each engine writes, indexes and evicts only its shard, with "
        "--store-capacity-bytes / n). Several devices need API processes: with --api-processes 0 or unset the default "
        "number is started. A cuda device may appear once; cpu may repeat (tests, CPU-only machines). One "
        "device is the same as --device; none: one engine on --device")
    dtype: Literal["auto", "float32", "bfloat16", "fp8"] = Field(
        "auto", description="auto: bfloat16 on cuda, float32 on cpu; fp8 (opt-in, a GPU of compute capability 8.9+): "
        "the --fp8-gemms GEMMs of the blocks in FP8 with row-wise scales, everything else and the stored embeddings "
        "in bfloat16 (another content key than bfloat16's)")
    fp8_bf16_blocks: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [0], description="with --dtype fp8: the blocks (0-based, comma-separated) that "
        "stay bfloat16, as the patch embedding, attention output projections and mergers always do")
    fp8_gemms: Annotated[list[Literal["qkv", "fc1", "fc2"]], NoDecode] = Field(
        default_factory=lambda: ["qkv"], description="with --dtype fp8: which GEMMs of the other blocks run in FP8 "
        "(comma-separated). Default qkv: its quantisation fuses into the layernorm before it; fc1 in FP8 loses "
        "the GELU in bf16's GEMM epilogue and fc2's quantisation is a pass of its own")
    seed: int = Field(0, description="seed for preset random weights")
    min_pixels: int | None = Field(None, description="resize every image to at least this many pixels instead of "
                                   "what the checkpoint's preprocessor_config.json says (presets: 65536); the LM "
                                   "side must resize alike")
    max_pixels: int | None = Field(None, description="resize every image to at most this many pixels instead of "
                                   "what the checkpoint's preprocessor_config.json says (presets: 16777216); the LM "
                                   "side must resize alike")

    store: Path | str = Field(default_factory=default_store_dir, description="where embeddings go: a directory "
                              "(the root, in vLLM's ECExampleConnector layout; LM servers on this machine read "
                              "it), or mooncake://MASTER_HOST:RPC_PORT (Mooncake Store: LM servers on any host of "
                              "the pool read it; docs/multihost.md)")
    store_capacity_bytes: Bytes = Field(4 * 1024**3, gt=0, description="LRU-evict above this many bytes (with "
                                        "several --devices, each engine's shard gets an equal part)")
    store_group: str | None = Field(None, description="a group that may read the store (e.g. an LM server running as "
                                    "another user): root 0750 and files 0640 instead of 0700 / 0600")
    store_min_residency_s: float = Field(30.0, ge=0, description="an entry answered by /encode is not evicted for this "
                                         "long (a consumer was told it is there); a store full of such entries "
                                         "answers 503 + Retry-After")
    store_writers: int = Field(4, gt=0, description="threads writing embeddings to the store (each write is a "
                               "memcpy into the store's filesystem with the GIL released)")
    mooncake_local_host: str = Field("127.0.0.1", description="with --store mooncake://...: the address the pool's "
                                     "other hosts reach this one at (its segment and transfers)")
    mooncake_segment_bytes: Bytes = Field(1024**3, ge=0, description="with --store mooncake://...: the memory this "
                                          "host adds to the pool for entries; 0 = a client only (its entries land in "
                                          "other hosts' segments)")
    mooncake_protocol: Literal["tcp", "rdma"] = Field("tcp", description="with --store mooncake://...: the transfer "
                                                      "protocol between the pool's hosts")
    mooncake_namespace: str | None = Field(None, description="with --store mooncake://...: the key namespace; "
                                           "default this service's own (vLLM's v3 form, from the model and its "
                                           "preprocessing); set it to the namespace a vLLM deployment computes to "
                                           "share entries with it")
    mooncake_timeout_s: float = Field(MOONCAKE_TIMEOUT_S, gt=0, description="with --store mooncake://...: the "
                                      "longest one Mooncake call may take before it counts as failed: a read's (a "
                                      "stored entry's, from a host that does not answer) is a miss and the image is "
                                      "encoded again, a lookup's or a write's a 503 (a host that is stopped would "
                                      "hold a read for up to a minute)")
    mooncake_start_wait_s: float = Field(MOONCAKE_START_WAIT_S, ge=0, description="with --store mooncake://...: how "
                                         "long start-up waits for the master to answer (one started beside this "
                                         "service, or restarted) before it gives up")

    vllm_model_id: str | None = Field(None, description="serve as vLLM's encoder instance for an LM started as `vllm "
                                      "serve ID` (this ID, exactly as given there): an image sent without a uuid is "
                                      "stored under vLLM's own key for it (its mm_hash), in /encode and "
                                      "/v1/chat/completions alike, and /v1/models lists ID; a video needs a uuid. "
                                      "Unset: content-hash keys")
    mm_hasher_algorithm: Literal["blake3", "sha256", "sha512"] = Field(
        "blake3", description="with --vllm-model-id: the hash of vLLM's keys, as the LM's --mm-hasher-algorithm")

    sglang_version: str | None = Field(None, description="serve SGLang's encoder protocol under /sglang for "
                                       "language servers of this SGLang release (`--encoder-urls "
                                       "http://HOST:PORT/sglang`); unset: not served")
    sglang_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        ["127.0.0.0/8", "::1/128"], description="with --sglang-version: the addresses (CIDRs) SGLang may call "
        "/sglang from and have embeddings pushed to (its prefill_host); any other is a 403")
    sglang_push_timeout_s: float = Field(60.0, gt=0, description="with --sglang-version: the longest a push of one "
                                         "part's embeddings may take, waiting for its ranks' registrations included")
    sglang_queue_wait_s: float = Field(100.0, ge=0, description="with --sglang-version: how long a part waits for a "
                                       "queue place when the queue is full (SGLang does not retry a refusal)")

    host: str = Field("127.0.0.1", description="bind address (0.0.0.0 only inside a container)")
    port: int = Field(8080, ge=0, le=65535, description="TCP port to listen on")
    header_timeout_s: float = Field(20.0, gt=0, description="longest time a request head (request line and "
                                    "headers) may take to arrive, from the connection's start or the request's first "
                                    "byte; then 408 and the connection closed (slowloris clients cannot hold "
                                    "connections)")
    body_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next part of a request body; "
                                  "then 408 (a client that stalls mid-body cannot hold a request forever)")
    keep_alive_s: float = Field(75.0, gt=0, description="idle keep-alive connections are closed after this long "
                                "(longer than common client pools keep theirs, so a client rarely reuses a closed one)")
    max_connections: int = Field(2048, gt=0, description="open connections plus requests in progress per HTTP "
                                 "process; beyond it new requests get 503 (the process keeps file descriptors to spare)")

    api_key: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False,
                                                    description="require `Authorization: Bearer <key>` on /encode "
                                                    "(comma-separated: several keys, e.g. while rotating)")
    api_key_metrics: bool = Field(True, description="with --api-key, require it on /metrics too")
    allowed_url_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list, description="hosts allowed for http(s) image URLs")
    allow_private_url_addresses: bool = Field(False, description="let allow-listed hosts resolve to loopback, "
                                              "private or link-local addresses (off: such fetches are refused)")
    url_timeout_s: float = Field(10.0, gt=0, description="the longest an http(s) image or video fetch may take, from "
                                 "name resolution to its last byte; longer is a 422 image_fetch_failed")

    max_images_per_request: int = Field(64, gt=0, description="most images in one /encode request; more is a 400")
    max_request_bytes: Bytes = Field(64 * 1024**2, gt=0, description="largest /encode body (JSON or multipart), "
                                     "refused with 413 before it is read when declared, or as soon as it passes; "
                                     "what a request's http(s) URLs fetch counts against it too, with the body")
    max_image_bytes: Bytes = Field(_IMAGE.max_image_bytes, gt=0, description="largest encoded image; larger is a 413, "
                                   "before it is decoded")
    max_input_pixels: int = Field(_IMAGE.max_input_pixels, gt=0, description="largest width x height an image's header may declare; "
                                  "larger is a 413, before it is decoded (decompression bombs)")
    max_jpeg_scans: int = Field(_IMAGE.max_jpeg_scans, gt=0, description="most scans a JPEG may have (each is a pass over the whole "
                                "image: progressive JPEGs have about 10, baseline ones 1); more is a 422 "
                                "image_too_complex, before it is decoded (scan bombs)")
    decode_timeout_s: float = Field(_IMAGE.decode_timeout_s, gt=0, description="wall time one image's decode may take; longer is stopped "
                                    "and answered 422 image_too_complex (the largest admitted image decodes in a few "
                                    "seconds on one core). In a single-process service, a decoder that cannot be "
                                    "stopped has its decode process ended after this and 5 s more of CPU time")
    video_max_bytes: Bytes = Field(_VIDEO.max_bytes, gt=0, description="largest encoded video; larger is a 413, before it "
                                   "is decoded (a JSON body is also bounded by --max-request-bytes)")
    video_max_duration_s: float = Field(_VIDEO.max_duration_s, gt=0, description="longest video by its header; longer is a 413, "
                                        "before any frame is decoded")
    video_max_frames: int = Field(_VIDEO.max_frames, gt=0, description="most frames a video's stream may have by its header "
                                  "(what a decode walks through); more is a 413, before any frame is decoded")
    video_max_frame_pixels: int = Field(_VIDEO.max_frame_pixels, gt=0, description="largest width x height of a video's frames by "
                                        "its header, a 413 before any frame is decoded; and of every frame as it is "
                                        "decoded, sampled or not (a stream may change its size)")
    video_max_decode_s: float = Field(_VIDEO.max_decode_s, gt=0, description="wall time one video's decode may take; longer is "
                                      "stopped and answered 413 (in a single-process service a decode that cannot be "
                                      "stopped has its process ended after this much CPU time on each core, and 5 s more)")
    video_max_request_bytes: Bytes = Field(_VIDEO.max_request_bytes, gt=0, description="most bytes one request's videos "
                                           "may be once resized (uint8 frames after sampling, computed from their headers "
                                           "before any frame is decoded); more is a 413. Qwen3-VL's released video config "
                                           "resizes any clip to at most 72 MiB (a 20-minute 1080p clip at its default "
                                           "sampling to 63 MiB): the default admits three")
    video_max_process_bytes: Bytes = Field(_VIDEO.max_process_bytes, gt=0, description="most bytes the videos one "
                                           "process decodes at once may be once resized; a video that alone is more is a "
                                           "413 before it is decoded, others wait for room. The default holds seven of "
                                           "the largest clips of Qwen3-VL's released video config")

    max_batch_tokens: int = Field(16384, gt=0, description="step token budget (output tokens; 4 patches each)")
    max_batch_images: int = Field(64, gt=0, description="most images in one step")
    max_wait_ms: float = Field(5.0, ge=0, description="while the device runs a step, the next step waits at most "
                               "this long after its first image for more (an idle device takes a step at once; "
                               "while a launched step waits behind the running one, it waits until it would run)")
    max_queue_images: int = Field(512, gt=0, description="admission limit; beyond it requests get 429")
    max_queue_tokens: int = Field(65536, gt=0, description="admission limit on the queued images' output tokens "
                                  "(one token = 1024 pixels after resizing, so 65536 ~ 67 megapixels); beyond it "
                                  "429. An image alone in the queue is always admitted")
    priority_aging_s: float = Field(10.0, ge=0, description="aging between priority levels (a request's `priority`, "
                                    "lower first): work of priority q arriving more than (p - q) times this many "
                                    "seconds after work of priority p never goes before it; 0 = strict priority")
    default_deadline_ms: int | None = Field(None, ge=0, description="budget of a request sending no `deadline_ms`: "
                                            "work not decoded, or whose step has not started, this long after its "
                                            "arrival is dropped and answered 504 (a cached hit is still answered)")

    api_processes: int | None = Field(None, ge=0, description="HTTP API processes started by a supervisor beside "
                                      "the engine process(es) (images reach the engines through shared memory); 0 = "
                                      "one process does everything; unset = the default for this machine: on a GPU "
                                      "(--device cuda..., or auto with one present) or with several --devices, a "
                                      "quarter of the usable cores (1-8), on the CPU 0")
    decode_workers: int = Field(0, ge=0, description="image decoders per serving process: worker processes in a "
                                "single-process service, threads in each API process; 0 = this process's share of the "
                                "cores (all of them, or divided among the API processes), 2-8")
    video_decode_workers: int = Field(0, ge=0, description="most videos one serving process decodes at once (the "
                                      "others wait); 0 = half its decode workers. At most all of them but one, so that "
                                      "images always have a decoder beside long videos")
    decode_stall_s: float = Field(30.0, gt=0, description="a single-process service's decode pool in which no decode "
                                  "finishes and no video decodes a frame for this long is taken for stuck: its processes "
                                  "are killed, a new pool started, and the decodes waiting on it answered 503")
    arena_bytes: Bytes = Field(256 * 1024**2, gt=0, description="shared-memory pixel arena of each API process "
                               "(decoded images waiting for the engine); full -> 429")
    engine_exit_grace_s: float = Field(2.0, ge=0, description="after the engine process dies, how long the API "
                                       "processes answer 503 before the supervisor exits with status 1")

    # 4, not 3: the writer holds one step's output buffer while it commits it, and with two steps on the device
    # (batcher.BACKLOG) a third buffer left the loop waiting for the writer (output_wait 8.7-24.4 ms per step at 1
    # image per request). On an H200 with --graph-exact-images 64: 673.5 -> 773.8 img/s.
    # The fourth slot costs pinned host memory: with the 4B preset's defaults a staging slot is ~0.10 GB (two
    # frames' pixels of a 65536-patch step) and an output buffer ~0.34 GB (16384 tokens x 10240 bf16).
    pool_slots: int = Field(4, ge=2, description="pinned staging slots, and as many output buffers (>= steps in "
                            "flight + 2: the writer holds one)")
    warmup: bool = Field(True, description="run one step before /ready says ready")
    cuda_graphs: bool = Field(True, description="replay the tower from CUDA graphs (cuda + bfloat16 only)")
    # 64 images of 448x448: a step launched from Python took ~25 ms of the step loop's time under HTTP load (from
    # a graph ~4), so steps of 17..64 such images launched from Python made the loop, not the GPU, the limit at 1
    # image per request (591 -> 722 img/s; 134 graphs instead of 98, +3 s start-up).
    # Then the whole default step (16384 tokens): mixed real-world steps beyond the graphs were
    # launch-bound too (80 ms of launch for 93 between steps), and the batcher's backlog hold grows steps to the budget.
    # Measured in the mix: launch 3.1 ms per step against 40.4 at 50176, the rate the same (149.9 against 153.7 img/s:
    # the store writer was the limit), start-up 141 graphs in 13.5-15 s against 134 in 11.
    graph_max_patches: int = Field(65536, gt=0, description="largest step (in patches) replayed from a CUDA graph; "
                                   "graphs are captured at start for every bucket up to it (65536: a step of the "
                                   "default --max-batch-tokens)")
    graph_exact_sides: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [448, 512], description="square image sides (px) whose steps of 1..--graph-exact-images "
        "equal images get an unpadded CUDA graph of their own, with batched attention (comma-separated; other steps "
        "pad to the nearest bucket)")
    # 64: equal steps of up to 64 images run batched attention from a graph of their own, 1.164 ms per 448px image
    # on the device against 1.209-1.256 through the varlen graphs (H200; the tower alone 1.150). Start-up captures 237 graphs in 21 s instead of 141 in 13.5.
    graph_exact_images: int = Field(64, gt=0, description="the largest step of equal --graph-exact-sides images "
                                    "that gets a graph of its own (1..this many images; larger steps of them pad "
                                    "to the nearest bucket, with varlen attention)")
    compile: bool = Field(True, description="torch.compile the tower (cuda + bfloat16 only); --no-compile runs it eagerly")
    attention: Literal["auto", "cudnn", "fa3", "fa4", "fa2", "sdpa"] = Field(
        "auto", description="the attention kernel on a GPU: auto times each one that runs at start-up and each "
        "step takes the fastest for its longest image; a name forces that kernel where it runs (fa3: the `fa3` "
        "extra, Hopper GPUs; fa4: the `fa4` extra, Hopper and Blackwell GPUs; cudnn and sdpa: steps of equal "
        "images; fa2: the others), the default elsewhere")
    compile_cache: Path = Field(default_factory=default_compile_cache,
                                description="persistent torch.compile cache, so a restart does not compile again")

    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level of every "
                                                                   "process of the service")
    otlp_endpoint: str | None = Field(None, description="send OpenTelemetry traces (OTLP/HTTP) to this collector, "
                                      "e.g. http://127.0.0.1:4318: a span per request and its phases, and the "
                                      "engine's queue, step and store write per image, under the request's W3C "
                                      "traceparent (needs the `tracing` extra); unset: no tracing")

    @field_validator("otlp_endpoint")
    @classmethod
    def _check_otlp_endpoint(cls, v: str | None) -> str | None:
        return check_otlp_endpoint(v)

    @field_validator("vllm_model_id")
    @classmethod
    def _check_vllm_model_id(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("the model ID is empty: give what the LM's `vllm serve` was given")
        return v

    @field_validator("sglang_version")
    @classmethod
    def _check_sglang_version(cls, v: str | None) -> str | None:
        if v is not None and v not in SGLANG_VERSIONS:
            raise ValueError(f"SGLang {v} is not supported: its encoder protocol is served for SGLang "
                             f"{' and '.join(SGLANG_VERSIONS)} only (it changes between releases)")
        return v

    @field_validator("sglang_allowed_hosts")
    @classmethod
    def _check_cidrs(cls, v: list[str]) -> list[str]:
        for cidr in v:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"{cidr!r} is not an address or CIDR (e.g. 10.0.0.0/8)") from None
        return v

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v == "auto" or _named_device(v):
            return v
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {v!r}")

    @field_validator("store", mode="before")
    @classmethod
    def _check_store(cls, v):
        # A mooncake:// URL stays a string (a Path would fold its '//'); anything else is a directory.
        if isinstance(v, str) and v.startswith(MOONCAKE_SCHEME):
            parse_mooncake(v)
            return v
        return Path(v) if isinstance(v, str) else v

    @property
    def store_is_mooncake(self) -> bool:
        return isinstance(self.store, str)

    @field_validator("devices", "api_key", "graph_exact_sides", "allowed_url_hosts", "fp8_bf16_blocks", "fp8_gemms",
                     "sglang_allowed_hosts", mode="before")
    @classmethod
    def _split_commas(cls, v):
        # A list from a flag or a QVE_ variable is comma-separated (`a.example,b.example` is friendlier
        # than JSON in an env file); the field's type then converts the items (ints for the sides).
        if isinstance(v, str):
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, v: list[str]) -> list[str]:
        for d in v:
            # NOTE: no `auto` here: an engine per device needs each device named.
            if not _named_device(d):
                raise ValueError(f"each device must be cpu, cuda or cuda:N, got {d!r}")
        gpus = [("cuda:0" if d == "cuda" else d) for d in v if d != "cpu"]
        for d in sorted(set(gpus)):
            if gpus.count(d) > 1:
                raise ValueError(f"{d} is listed more than once (cuda is cuda:0): one engine per GPU; only cpu may "
                                 "repeat (for tests and CPU-only machines)")
        if gpus and len(gpus) < len(v):
            # The engines would load the model in different dtypes (bfloat16 on cuda, float32 on cpu): their
            # embeddings, and so their content keys, would differ.
            raise ValueError("mixes cpu and cuda devices; list only GPUs, or only cpu")
        return v

    @field_validator("fp8_bf16_blocks")
    @classmethod
    def _check_fp8_blocks(cls, v: list[int]) -> list[int]:
        if any(i < 0 for i in v):
            raise ValueError(f"block indexes are 0-based and not negative, got {v}")
        return sorted(set(v))
    @field_validator("allowed_url_hosts")
    @classmethod
    def _lower_hosts(cls, v: list[str]) -> list[str]:
        return [h.lower() for h in v]  # host names compare case-insensitively (the allow-list check is exact)

    @model_validator(mode="after")
    def _check_pixels(self) -> "Settings":
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        if len(self.devices) == 1:  # documented: one device is --device
            self.device = self.devices[0]
        if self.dtype == "fp8" and not self.fp8_gemms:
            raise ValueError("--dtype fp8 with no --fp8-gemms: name at least one of qkv, fc1, fc2 (or use bfloat16)")
        return self

    @property
    def engine_devices(self) -> list[str]:
        """One engine process per entry (and store shard per engine)."""
        return self.devices if len(self.devices) > 1 else [self.device]

    def api_process_count(self) -> int:
        """The API processes `serve` starts (0: one process does everything). Unset, a GPU gets several: one
        process cannot parse, hash and decode at the tower's rate (~350-480 images/s at most: bench/RESULTS.md),
        while a CPU engine needs the cores for itself. Several devices always need them."""
        n = self.api_processes
        if n is None:
            on_gpu = self.device.startswith("cuda") or (self.device == "auto" and os.path.exists("/dev/nvidiactl"))
            n = default_api_processes() if on_gpu else 0
        return n if n > 0 or len(self.engine_devices) == 1 else default_api_processes()

    @property
    def supervised(self) -> bool:
        """A supervisor with API processes and engine processes, rather than one process doing everything."""
        return self.api_process_count() > 0

    def decode_worker_count(self) -> int:
        """--decode-workers, or the default: the cores this process may use, divided among the API processes
        when there are any (each decodes in its own threads), at least 2 and at most 8."""
        if self.decode_workers:
            return self.decode_workers
        return min(8, max(2, usable_cores() // max(1, self.api_process_count())))

    def video_decode_slots(self) -> int:
        """Videos decoded at once in a serving process: --video-decode-workers, or half its decode workers; at
        most all of them but one (long videos on every decoder made images wait for them), at least 1."""
        workers = self.decode_worker_count()
        return max(1, min(self.video_decode_workers or workers // 2, workers - 1))

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(max_image_bytes=self.max_image_bytes, max_input_pixels=self.max_input_pixels,
                           max_jpeg_scans=self.max_jpeg_scans, decode_timeout_s=self.decode_timeout_s)

    @property
    def video_limits(self) -> VideoLimits:
        return VideoLimits(max_bytes=self.video_max_bytes, max_duration_s=self.video_max_duration_s,
                           max_frames=self.video_max_frames, max_frame_pixels=self.video_max_frame_pixels,
                           max_decode_s=self.video_max_decode_s, max_request_bytes=self.video_max_request_bytes,
                           max_process_bytes=self.video_max_process_bytes)

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(max_batch_tokens=self.max_batch_tokens, max_batch_images=self.max_batch_images,
                           max_wait_s=self.max_wait_ms / 1000, max_queue_images=self.max_queue_images,
                           max_queue_tokens=self.max_queue_tokens, priority_aging_s=self.priority_aging_s)

    def runner_options(self, faults: FaultInjection = FaultInjection()) -> RunnerOptions:
        """`faults`: FaultInjection.from_env(os.environ) at an entry point; tests pass theirs."""
        return RunnerOptions(max_batch_tokens=self.max_batch_tokens, max_batch_images=self.max_batch_images,
                             pool_slots=self.pool_slots, cuda_graphs=self.cuda_graphs,
                             graph_max_patches=self.graph_max_patches, graph_exact_sides=tuple(self.graph_exact_sides),
                             graph_exact_images=self.graph_exact_images, compile=self.compile,
                             attention=self.attention, compile_cache=self.compile_cache, faults=faults)

    def engine_options(self, faults: FaultInjection = FaultInjection()) -> EngineOptions:
        """The options of one engine (`faults`: FaultInjection.from_env(os.environ) at an entry point)."""
        return EngineOptions(runner=self.runner_options(faults), store=self.store_options(),
                             limits=self.batch_limits(), warmup=self.warmup)

    def store_options(self) -> StoreOptions:
        mooncake = None
        if self.store_is_mooncake:
            mooncake = MooncakeOptions(master=parse_mooncake(self.store), local_host=self.mooncake_local_host,
                                       segment_bytes=self.mooncake_segment_bytes, buffer_bytes=MOONCAKE_BUFFER_BYTES,
                                       protocol=self.mooncake_protocol, namespace=self.mooncake_namespace,
                                       timeout_s=self.mooncake_timeout_s)
        return StoreOptions(root=self.store, mooncake=mooncake, capacity_bytes=self.store_capacity_bytes,
                            group=self.store_group, min_residency_s=self.store_min_residency_s,
                            writers=self.store_writers)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch  # local: config stays importable (and testable) without touching CUDA

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"


# ---- where a setting comes from: the QVE_ environment ---------------------------------------------
ENV_PREFIX = "QVE_"
# prometheus_client's multiprocess directory (metrics.py; set in each API process by procs/api_process.py).
# Here, not in metrics.py: that imports prometheus_client, which must not be imported before it is set.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# QVE_ variables that are not settings, so not worth a warning at start.
OTHER_ENV = frozenset({
    FAULT_ENV,  # test-only fault injection (FaultInjection)
    "QVE_ENCODER_API_KEY", "QVE_VLLM_API_KEY",  # the keys `consume` and `route` send (service/__main__.py)
    "QVE_COMPOSE_TEST", "QVE_COMPOSE_LOG", "QVE_TEST_SUPERVISOR_REQUESTS",  # read by the tests
})


def env_name(field: str) -> str:
    """The environment variable of a setting: `max_batch_tokens` -> `QVE_MAX_BATCH_TOKENS`."""
    return ENV_PREFIX + field.upper()


def unknown_env(environ: Mapping[str, str]) -> list[str]:
    """A warning for each QVE_ variable that is no setting (a typo would otherwise be ignored in
    silence), naming the closest setting's variable."""
    known = {env_name(f) for f in Settings.model_fields}
    warnings = []
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings matches names case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper in known or upper in OTHER_ENV:
            continue
        close = difflib.get_close_matches(upper, known, n=1)
        hint = f"did you mean {close[0]}?" if close else f"`--help` lists the {ENV_PREFIX} variables"
        warnings.append(f"{name} is not a setting and is ignored; {hint}")
    return warnings

"""The consumer's one config, built by the CLI (`consume`) and passed down to the app and the LM."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ChatConfig:
    model: Path  # a local Qwen3-VL checkpoint directory with its tokenizer and chat template
    encoder_url: str  # the encoder service, e.g. http://127.0.0.1:8080
    store: Path | str  # the encoder's store: its root as mounted here (read-only is enough), or mooncake://...
    device: str = "cpu"
    dtype: str = "auto"  # float32 | bfloat16; auto: bfloat16 on cuda, float32 on cpu
    max_tokens_limit: int = 1024  # the most tokens one request may ask for
    encoder_timeout_s: float = 300.0
    mooncake_local_host: str = "127.0.0.1"  # with a mooncake:// store: the address the pool reaches this host at
    # What one request may cost, each refused before the request takes the LM (the package docstring).
    # The encoder's own --max-request-bytes: a chat whose images the encoder would take is not refused here.
    max_request_bytes: int = 64 * 1024**2
    body_timeout_s: float = 30.0  # the longest wait for the next part of a body (408), as the encoder's
    # Two images at Qwen3-VL's largest size (16,384 rows each at its 16 MP max_pixels), or a long document;
    # a prefill is one step that cannot be stopped midway, and the one LM serves one request at a time.
    max_prompt_tokens: int = 32768
    max_waiting: int = 16  # requests admitted behind the one generating; one more is a 429
    request_timeout_s: float = 300.0  # from admission to the answer; then 504 and the generation stopped
    api_key: tuple[str, ...] = field(default=(), repr=False)  # bearer keys this consumer takes; none: open
    encoder_api_key: str | None = field(default=None, repr=False)  # sent to the encoder (its --api-key)
    # The encoder model whose store entries this LM reads (the encoder's /ready `model`; engine/loader.py's
    # same_tower compares); an entry of any other is a 502. None: any. `consume` gives its checkpoint's own tower
    # unless told otherwise (--encoder-model).
    encoder_model: str | None = None

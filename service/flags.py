"""Every Settings field as a command-line flag (`max_batch_tokens` -> `--max-batch-tokens`), in the groups
of GROUPS, each help saying the default and the QVE_ variable. `serve` takes these flags, and
so does the soak, which reads a `serve` command line to learn what the server it starts will run with."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from service.config import Settings, env_name, is_size
from service.sizes import format_size

# The settings' groups, in `serve --help` and docs/configuration.md alike (tests/unit/test_flags.py: each setting is in
# exactly one).
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ('Model and device', ('model', 'device', 'devices', 'dtype', 'fp8_bf16_blocks', 'fp8_gemms', 'seed', 'min_pixels', 'max_pixels',)),
    ("Serving as vLLM's encoder", ('vllm_model_id', 'mm_hasher_algorithm',)),
    ("Serving as SGLang's encoder", ('sglang_version', 'sglang_allowed_hosts', 'sglang_push_timeout_s', 'sglang_queue_wait_s',)),
    ('Store', ('store', 'store_capacity_bytes', 'store_group', 'store_min_residency_s', 'store_writers', 'mooncake_local_host', 'mooncake_segment_bytes', 'mooncake_protocol', 'mooncake_namespace', 'mooncake_timeout_s', 'mooncake_start_wait_s',)),
    ('HTTP serving', ('host', 'port', 'header_timeout_s', 'body_timeout_s', 'keep_alive_s', 'max_connections',)),
    ('Security: API keys and image URLs', ('api_key', 'api_key_metrics', 'allowed_url_hosts', 'allow_private_url_addresses', 'url_timeout_s',)),
    ('Request limits', ('max_images_per_request', 'max_request_bytes', 'max_image_bytes', 'max_input_pixels', 'max_jpeg_scans', 'decode_timeout_s', 'video_max_bytes', 'video_max_duration_s', 'video_max_frames', 'video_max_frame_pixels', 'video_max_decode_s', 'video_max_request_bytes', 'video_max_process_bytes',)),
    ('Batching and admission', ('max_batch_tokens', 'max_batch_images', 'max_wait_ms', 'max_queue_images', 'max_queue_tokens',
                                'priority_aging_s', 'default_deadline_ms',)),
    ('Processes', ('api_processes', 'decode_workers', 'video_decode_workers', 'decode_stall_s', 'arena_bytes', 'engine_exit_grace_s',)),
    ('Step loop and GPU', ('pool_slots', 'warmup', 'cuda_graphs', 'graph_max_patches', 'graph_exact_sides', 'graph_exact_images', 'compile', 'attention', 'compile_cache',)),
    ('Logging and tracing', ('log_level', 'otlp_endpoint',)),
)


def setting_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """GROUPS, and under "Other" any setting none of them names (the tests catch that)."""
    named = {name for _, names in GROUPS for name in names}
    other = tuple(name for name in Settings.model_fields if name not in named)
    return GROUPS + ((("Other", other),) if other else ())


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per Settings field on `parser`, an argument group per heading of setting_groups(). A flag
    not given is left out of the parsed namespace only if `parser` has argument_default=SUPPRESS (as
    `serve` does, so that Settings applies the environment and its own defaults)."""
    for title, names in setting_groups():
        group = parser.add_argument_group(title)
        for name in names:
            _add_setting(group, name)


def _flag_kind(name: str, field) -> tuple[type, list[str] | None, str | None]:
    """argparse's type, choices and metavar for a Settings field. The metavar is short (SIZE, N, SECONDS),
    so that most help texts start on the flag's own line."""
    base = field.annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(base) if a is not type(None)]  # `int | None` -> int
        if set(args) == {Path, str}:  # a path or a URL (--store): Settings tells which
            return str, None, "DIR|URL"
        base = args[0]
    if is_size(name):
        return str, None, "SIZE"  # `4GiB` as well as bytes: Settings parses it (sizes.parse_size)
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base)), None
    if typing.get_origin(base) is list:
        return str, None, "LIST"  # comma-separated; Settings splits it
    if name.endswith("_s") or name.endswith("_ms"):
        return base, None, "SECONDS" if name.endswith("_s") else "MS"
    if base in (int, float):
        return base, None, "N"
    if base is Path:
        return base, None, "DIR"
    return str, None, name.rsplit("_", 1)[-1].upper()  # store_group -> GROUP


def _default_text(name: str) -> str:
    """A setting's default as one would type it."""
    value = Settings.model_fields[name].get_default(call_default_factory=True)
    if is_size(name):
        return format_size(value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None or value == []:
        return "none"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def _add_setting(group, name: str) -> None:
    """The flag of one Settings field, its help saying the default and the QVE_ variable."""
    field = Settings.model_fields[name]
    flag = "--" + name.replace("_", "-")
    help_ = f"{field.description or ''} (default: {_default_text(name)}; env {env_name(name)})".strip()
    help_ = help_.replace("%", "%%")  # argparse %-formats help strings
    if field.annotation is bool:
        group.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
        return
    type_, choices, metavar = _flag_kind(name, field)
    group.add_argument(flag, type=type_, choices=choices, help=help_, metavar=metavar)


def describe_errors(error: ValidationError, flags: Mapping[str, object]) -> list[str]:
    """One line per invalid setting, named the way the user set it: `--flag` for a setting in `flags`
    (given on the command line), else its QVE_ variable (the only other place a value comes from)."""
    lines = []
    for e in error.errors():
        msg = e["msg"].removeprefix("Value error, ")
        field = e["loc"][0] if e["loc"] else None
        if field not in Settings.model_fields:  # a check across fields (min_pixels vs max_pixels)
            lines.append(msg)
            continue
        source = "--" + field.replace("_", "-") if field in flags else env_name(field)
        # A flag's value as it was typed: pydantic's input is what a before-validator made of it (`0GiB` -> 0).
        given = flags[field] if field in flags else e["input"]
        # A secret (--api-key) is never echoed; neither is a value too long for one line.
        value = "" if not Settings.model_fields[field].repr or len(str(given)) > 80 else f"={given}"
        lines.append(f"{source}{value}: {msg}")
    return lines

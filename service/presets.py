"""Vision-tower presets named after the released Qwen3-VL checkpoints, plus a tiny one for tests.

A preset builds the real architecture with seeded random weights (no weights can be downloaded).
Values are the `vision_config` of each released checkpoint; the class defaults of transformers'
`Qwen3VLVisionConfig` match no released model (out_hidden 3584), so every field is spelled out.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from service.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import Qwen3VLVisionConfig

_COMMON = dict(
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    in_channels=3,
    num_position_embeddings=2304,
    hidden_act="gelu_pytorch_tanh",
    initializer_range=0.02,
)

# name -> (depth, hidden, intermediate, heads, out_hidden, deepstack taps)
_TABLE: dict[str, tuple[int, int, int, int, int, list[int]]] = {
    "qwen3-vl-2b": (24, 1024, 4096, 16, 2048, [5, 11, 17]),
    "qwen3-vl-4b": (24, 1024, 4096, 16, 2560, [5, 11, 17]),
    "qwen3-vl-8b": (27, 1152, 4304, 16, 4096, [8, 16, 24]),
    "qwen3-vl-32b": (27, 1152, 4304, 16, 5120, [8, 16, 24]),
    # For tests and laptops: 3 blocks of width 64, two deepstack taps, same patching as the real ones.
    "tiny": (3, 64, 128, 2, 48, [0, 1]),
}

PRESETS = tuple(_TABLE)


def preset_vision_config(name: str) -> Qwen3VLVisionConfig:
    """The transformers vision config of a preset. Raises KeyError for an unknown name."""
    # NOTE: imported here, not at the top: the CLI checks `--model` against PRESETS before anything
    # heavy is imported (transformers takes seconds), so a typo fails at once.
    from transformers import Qwen3VLVisionConfig

    depth, hidden, inter, heads, out_hidden, taps = _TABLE[name]
    return Qwen3VLVisionConfig(
        depth=depth,
        hidden_size=hidden,
        intermediate_size=inter,
        num_heads=heads,
        out_hidden_size=out_hidden,
        deepstack_visual_indexes=list(taps),
        **_COMMON,
    )


def check_model(name: str) -> None:
    """`--model` names a preset or an existing directory (what is inside is checked by the loader)."""
    if name not in PRESETS and not Path(name).is_dir():
        raise ModelLoadError(
            f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor an existing checkpoint directory"
        )

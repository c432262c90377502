"""The language model: Qwen3-VL loaded from a checkpoint directory, generating greedily from the stored
image and video embeddings (transformers' `mm_encoder_outputs`), and the check that a store entry fits it."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from service.errors import GatewayError, ModelLoadError
from service.lm.chat.config import ChatConfig
from service.lm.chat.prompt import PromptBuilder
from service.store.format import StoredEmbeddings


class LanguageModel:
    """Qwen3-VL from a checkpoint directory, fed precomputed image embeddings. One generation at a time.
    `prompt` builds its prompts (prompt.py)."""

    def __init__(self, cfg: ChatConfig):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        if not (cfg.model / "config.json").is_file():
            raise ModelLoadError(f"--model {cfg.model} is not a Qwen3-VL checkpoint directory (no config.json); "
                                 "the LM side needs a real checkpoint with its tokenizer")
        cuda = cfg.device.startswith("cuda")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.dtype, torch.bfloat16 if cuda else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model)
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(cfg.model, dtype=dtype).to(cfg.device).eval()
        self.device, self.dtype = torch.device(cfg.device), dtype
        mc = self.model.config
        self.image_token_id, self.video_token_id = mc.image_token_id, mc.video_token_id
        self.hidden_size = mc.text_config.hidden_size
        self.deepstack_levels = len(mc.vision_config.deepstack_visual_indexes)
        self.merge = mc.vision_config.spatial_merge_size
        self.eos_ids = {i for i in (self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id) if isinstance(i, int)}
        self.name = cfg.model.resolve().name
        # the longest prompt plus answer its rotary positions cover
        self.context = getattr(mc.text_config, "max_position_embeddings", None)
        self._lock = threading.Lock()  # generate() is not re-entrant on one model
        if not hasattr(self.tokenizer, "backend_tokenizer"):
            raise ModelLoadError(f"--model {cfg.model}: the tokenizer is not a fast one (no tokenizer.json); the "
                                 "consumer needs it to encode control tokens in message text as plain text")
        self.prompt = PromptBuilder(self.tokenizer, mc)

    def generate(self, input_ids: list[int], media: list[StoredEmbeddings], max_new_tokens: int,
                 stop: Callable[[], bool] = lambda: False) -> list[int]:
        """Greedy tokens after `input_ids`, with `media` (images and videos, prompt order) as the encoder
        outputs: transformers scatters each modality's rows into its own placeholders and its deepstack
        features at those positions, and takes the rotary positions from the grids (get_rope_index).
        `stop()` is asked after every token: True ends the generation there (the tokens so far are returned)."""
        from transformers import StoppingCriteria, StoppingCriteriaList
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        class Stop(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
                return torch.full((input_ids.shape[0],), stop(), dtype=torch.bool, device=input_ids.device)

        ids = torch.tensor([input_ids], device=self.device)
        kwargs: dict = {}
        cast = lambda t: t.to(self.device, self.dtype)  # noqa: E731
        outputs = {}
        for modality in ("image", "video"):
            items = [e for e in media if e.modality == modality]
            if not items:
                continue
            kwargs[f"{modality}_grid_thw"] = torch.tensor([e.grid_thw for e in items], device=self.device)
            outputs[modality] = BaseModelOutputWithDeepstackFeatures(
                pooler_output=tuple(cast(e.main) for e in items),
                deepstack_features=[tuple(cast(e.deepstack[i]) for e in items) for i in range(self.deepstack_levels)],
            )
        if outputs:  # Qwen3-VL's token types: 0 text, 1 image, 2 video
            kwargs["mm_token_type_ids"] = (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()
            kwargs["mm_encoder_outputs"] = outputs
        with self._lock, torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=sorted(self.eos_ids) or None,
                                      pad_token_id=self.tokenizer.pad_token_id,
                                      stopping_criteria=StoppingCriteriaList([Stop()]), **kwargs)
        return out[0, len(input_ids):].tolist()

    def check(self, key: str, emb: StoredEmbeddings, item: dict) -> None:
        """The stored tensor must be what this LM consumes (vLLM checks none of this and truncates), and
        the entry the modality the encoder answered."""
        t, h, w = emb.grid_thw
        num_tokens = item["num_tokens"]
        problems = []
        if emb.modality != item.get("modality", "image"):
            problems.append(f"the entry is an {emb.modality}, the encoder answered a {item.get('modality', 'image')}")
        if emb.modality == "video" and (emb.timestamps is None or len(emb.timestamps) != t):
            problems.append(f"video timestamps {emb.timestamps} for {t} temporal groups")
        if emb.main.shape != (num_tokens, self.hidden_size):
            problems.append(f"main embeddings {tuple(emb.main.shape)}, expected ({num_tokens}, {self.hidden_size})")
        if len(emb.deepstack) != self.deepstack_levels:
            problems.append(f"{len(emb.deepstack)} deepstack levels, expected {self.deepstack_levels}")
        if t * h * w // self.merge**2 != num_tokens:
            problems.append(f"grid_thw {emb.grid_thw} gives {t * h * w // self.merge**2} tokens, answered {num_tokens}")
        if problems:
            raise GatewayError(f"store entry {key!r} does not fit this language model: " + "; ".join(problems)
                             + ". Do encoder and LM use the same checkpoint?", code="embeddings_mismatch")

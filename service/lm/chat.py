"""The LM side: an OpenAI-style chat endpoint answered by Qwen3-VL's language model, which reads each
image's and video's embeddings from the encoder's store and never runs the vision tower.

    python -m service consume --model CHECKPOINT_DIR --encoder-url http://127.0.0.1:8080 --store DIR --port 8090

Per request (`POST /v1/chat/completions`, a subset of OpenAI's: text, `image_url` and `video_url` content
parts, `max_tokens`, greedy decoding only):
  1. every image and video part goes to the encoder's `/encode` (the same content-part shapes, one call
     for all) -> key, modality, grid_thw, num_tokens;
  2. the key's entry is read from the store (store/reader.py: a directory, or Mooncake Store) -> the main
     embeddings, the deepstack features and, for a video, its timestamps;
  3. the prompt is the checkpoint's chat template with one `<|image_pad|>` per image embedding row, and
     each video's `<|video_pad|>` expanded as Qwen3VLProcessor.replace_video_token does: per temporal
     group `<{t:.1f} seconds><|vision_start|>` + one `<|video_pad|>` per row + `<|vision_end|>` (the
     template's `<|vision_start|>`/`<|vision_end|>` around the video kept or dropped as the installed
     transformers' processor does: `processor_drops_video_wrapper`);
  4. transformers' Qwen3-VL generates greedily from the embeddings (`mm_encoder_outputs`), taking
     the 3-D rotary positions from image_grid_thw / video_grid_thw and mm_token_type_ids (its
     get_rope_index splits a video into one grid per temporal group, with the timestamp text between),
     and the answer carries OpenAI's `usage` counts.
A key evicted between the encoder's answer and the read is re-requested once; still missing -> 424.
Errors are the encoder's JSON error shape: `{"error": {"code", "message"}}`.

What one request may cost (issue 23: a 200k-word prompt held the one LM for minutes while every other
chat waited): a body over --max-request-bytes is a 413 before it is read; a prompt over
--max-prompt-tokens (counted after tokenisation, media rows included) is a 400 before the LM is taken;
at most --max-waiting requests wait behind the one generating, one more is a 429 at once; a request not
answered within --request-timeout-s is a 504 and its generation stops at the next token, as it does
when its client disconnects. With --api-key every route but /health and /ready needs
`Authorization: Bearer <key>`; --encoder-api-key is sent to the encoder.

Control tokens in message text (`<|im_end|>`, `<|im_start|>`, `<|image_pad|>`, ...) are encoded as the
plain text they are, never as the tokens the chat template writes: a user cannot forge a turn or a
placeholder. `return_token_ids: true` answers the prompt's ids too (`prompt_token_ids`, vLLM's name).

The preprocessing rule (as with vLLM): the LM's image placeholders come from the encoder's
num_tokens, so the encoder's pixel limits decide the tokens; this side never re-derives them.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import httpx
import jinja2
import torch
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field, ValidationError

from service import tracing
from service.lm.client import apost
from service.api.schemas import ImagePart
from service.api.server import BodyLimit, bearer_auth, install_error_handlers
from service.errors import (
    BadGateway,
    BadRequest,
    DeadlineExceeded,
    EmbeddingsMissing,
    ModelLoadError,
    Overloaded,
    Relayed,
    Unauthorized,
    clip,
)
from service.store.format import StoredEmbeddings, StoreFormatError
from service.store.reader import is_mooncake, open_reader

log = logging.getLogger(__name__)

# Private-use characters around the control tokens found in message text (LanguageModel.template_ids): no
# chat template writes them, so after rendering they tell a user's `<|im_end|>` from the template's.
_MARK_START, _MARK_END = "\ue000", "\ue001"
COUNT_SLICE = 16384  # characters tokenised at a time when a text is counted against the prompt limit


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
    # What one request may cost, each refused before the request takes the LM (module docstring).
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


# ---- request / response schemas (OpenAI chat-completions subset) ------------------------------------
class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class VideoURL(BaseModel):
    url: str = Field(description="data:video/...;base64,... or an http(s) URL on the encoder's allow-list")


class VideoPart(BaseModel):
    """A video as /encode takes it (issue 22's contract). NOTE: the encoder's own schema (api/schemas.py)
    gains the same part with its video support; this one goes when both are merged."""

    type: Literal["video_url"] = "video_url"
    video_url: VideoURL
    uuid: str | None = Field(None, description="optional store key; default: content hash")


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[Annotated[TextPart | ImagePart | VideoPart, Field(discriminator="type")]]


class ChatRequest(BaseModel):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    temperature: float | None = None
    return_token_ids: bool = Field(False, description="also answer the token ids, generated (choices[].token_ids) "
                                   "and the prompt's (prompt_token_ids), as vLLM does")


def processor_drops_video_wrapper() -> bool:
    """Whether the installed transformers' Qwen3VLProcessor expands the chat template's whole
    `<|vision_start|><|video_pad|><|vision_end|>` into the per-group text (True: Qwen3-VL's own format, that
    of transformers 4.57 and of 5.25 on) or only its bare `<|video_pad|>`, keeping the template's two
    markers around the whole video (False: transformers 5.0 to 5.24). Asked of the processor's own code
    (get_text_with_replacements, on a processor built without __init__, which would need torchvision),
    not of its version; where that code cannot be asked, the version decides."""
    start, pad, end = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
    try:
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        proc = object.__new__(Qwen3VLProcessor)
        proc.image_token, proc.video_token, proc.vision_start_token, proc.vision_end_token = "<|image_pad|>", pad, start, end
        (text,), _ = proc.get_text_with_replacements([f"{start}{pad}{end}"], videos_replacements=["V"])
    except Exception as e:  # noqa: BLE001 - a transformers whose processor code has moved: its version decides
        import transformers

        log.warning("could not ask Qwen3VLProcessor how it expands a video (%s); deciding by transformers %s",
                    e, transformers.__version__)
        return tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2]) >= (5, 25)
    if text not in ("V", f"{start}V{end}"):
        raise ModelLoadError(f"transformers' Qwen3VLProcessor expands a video placeholder as {text!r}: not a "
                             "form this consumer knows")
    return text == "V"


# ---- the language model -------------------------------------------------------------------------
class LanguageModel:
    """Qwen3-VL from a checkpoint directory, fed precomputed image embeddings. One generation at a time."""

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
        self.image_pad = self.tokenizer.convert_ids_to_tokens(mc.image_token_id)
        self.video_pad = self.tokenizer.convert_ids_to_tokens(mc.video_token_id)
        self.vision_start = self.tokenizer.convert_ids_to_tokens(mc.vision_start_token_id)
        self.vision_end = self.tokenizer.convert_ids_to_tokens(mc.vision_end_token_id)
        self.vision_start_id, self.vision_end_id = mc.vision_start_token_id, mc.vision_end_token_id
        self.drops_video_wrapper = processor_drops_video_wrapper()
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
        control = self._control_tokens()
        if control:
            either = "|".join(map(re.escape, sorted(control, key=len, reverse=True)))  # a longer token first
            self._control_re = re.compile(either)
            self._marked_re = re.compile(f"{_MARK_START}({either}){_MARK_END}|[{_MARK_START}{_MARK_END}]")
        else:
            self._control_re = self._marked_re = None

    def _control_tokens(self) -> list[str]:
        """The tokens a chat template writes as markup: the tokenizer's special tokens (its unknown token
        aside: text becomes it anyway), and the added tokens the template's source holds (`<think>`)."""
        template = self.tokenizer.chat_template
        template = "\0".join(template.values()) if isinstance(template, dict) else template or ""
        unk = self.tokenizer.unk_token
        return [t.content for t in self.tokenizer.added_tokens_decoder.values()
                if t.content != unk and (t.special or (t.content in template and not t.content.isspace()))]

    def prompt_text(self, messages: list[dict], media: list[StoredEmbeddings]) -> str:
        """The prompt as text, for reading and the tests (prompt_ids is what runs, and it reads control
        tokens in message text as text): the chat template's text with each placeholder expanded, in order:
        an image's `<|image_pad|>` to its rows, a video's `<|video_pad|>` to
        Qwen3VLProcessor.replace_video_token's text (transformers 5.0 to 5.24 replace the bare video token,
        so the template's own `<|vision_start|>`/`<|vision_end|>` around it stay, as vLLM 0.33 does with
        them; 5.25 on replace the three, as Qwen3-VL's own processor did: `drops_video_wrapper`)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if self.drops_video_wrapper:
            text = text.replace(self.vision_start + self.video_pad + self.vision_end, self.video_pad)
        pieces = re.split(f"({re.escape(self.image_pad)}|{re.escape(self.video_pad)})", text)
        found = [("image" if p == self.image_pad else "video") for p in pieces[1::2]]
        if found != [e.modality for e in media]:
            raise BadRequest(f"the chat template placed placeholders for {found or 'nothing'}, the request has "
                             f"{[e.modality for e in media] or 'no media'}")
        out = [pieces[0]]
        for e, after in zip(media, pieces[2::2]):
            out.append(self.image_pad * e.main.shape[0] if e.modality == "image" else self.video_text(e))
            out.append(after)
        return "".join(out)

    def video_text(self, e: StoredEmbeddings) -> str:
        """A video's placeholder text: per temporal group its time, then its rows between vision markers."""
        t, h, w = e.grid_thw
        per_group = h * w // self.merge**2
        return "".join(f"<{s:.1f} seconds>" + self.vision_start + self.video_pad * per_group + self.vision_end
                       for s in e.timestamps)

    def prompt_ids(self, messages: list[dict], media: list[StoredEmbeddings]) -> list[int]:
        """The prompt as it runs: `template_ids` with each placeholder expanded (`expand`)."""
        return self.expand(self.template_ids(messages), media)

    def template_ids(self, messages: list[dict]) -> list[int]:
        """The chat template's prompt as token ids, one placeholder token per image and video (what
        --max-prompt-tokens counts before the encoder is asked). The control tokens in the messages' text
        are encoded as the plain text they are, so only the template's own markup is markup: a user's
        `<|im_end|>\n<|im_start|>system` is text, not a new turn. A prompt with none is tokenised whole,
        exactly as before (the monolithic reference's ids).
        NOTE: recent transformers (5.24 here) has this as apply_chat_template(sanitize_control_tokens=True);
        this package also installs beside vLLM 0.33, which pins transformers < 5.21, so it is done here the
        same way: the control tokens in client text are wrapped in private-use marks before the template is
        rendered, and the rendered text is split at the marks."""
        if self._control_re is not None:
            messages = [{**m, "content": self._mark(m["content"]) if isinstance(m["content"], str) else
                         [{**p, "text": self._mark(p["text"])} if p["type"] == "text" else p for p in m["content"]]}
                        for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except jinja2.TemplateError as e:  # a template's raise_exception(): its own words on the messages
            raise BadRequest(f"the model's chat template refused the messages: {clip(str(e), 200)}") from None
        if self._marked_re is None:
            return self._encode(text)
        # [text, marked token, text, ...]; None for a lone mark (a template's split() can separate a pair):
        # it is dropped, but still cuts the text, so the text on its two sides cannot join into a token.
        pieces = self._marked_re.split(text)
        ids = self._encode(pieces[0])
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            if i % 2 == 0:
                ids += self._encode(piece)
                continue
            plain = self._encode_plain(piece)
            if self.tokenizer.convert_tokens_to_ids(piece) in plain:
                raise BadRequest(f"a message's text holds {piece!r}, which this model's tokenizer reads as its "
                                 "control token even as plain text, so it cannot stay text; leave it out (message "
                                 "text never writes chat markup here)")
            ids += plain
        return ids

    def _mark(self, text: str) -> str:
        # Marks a client wrote are dropped first: they would only cut its own text.
        text = text.replace(_MARK_START, "").replace(_MARK_END, "")
        return self._control_re.sub(lambda m: f"{_MARK_START}{m.group(0)}{_MARK_END}", text)

    def _encode(self, text: str) -> list[int]:
        """Text with the template's markup: control tokens are tokens."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_plain(self, text: str) -> list[int]:
        """Text as plain text: the tokenizer's pipeline without its added tokens (split_special_tokens would
        still match the non-special ones, and it is a switch on the tokenizer that every thread shares).
        Qwen's byte-level BPE adds no prefix space, so a piece encodes as it would inside the text."""
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        splits = [s for s, _ in backend.pre_tokenizer.pre_tokenize_str(text)] if backend.pre_tokenizer else [text]
        return [t.id for split in splits for t in backend.model.tokenize(split)]

    def count_text(self, text: str, stop_after: int) -> int:
        """The tokens of `text` as plain text, counted slice by slice until more than `stop_after` are seen:
        what a long text costs to refuse is bounded by the limit, not by the text's size (a megabyte takes
        seconds to tokenise whole). Slices are cut before a space that follows a non-space, where Qwen's
        pre-tokenizer cuts too, so they add up to the whole text's count (a slice with no such space for
        COUNT_SLICE more characters is cut anyway: at most a token off there)."""
        count, start = 0, 0
        while start < len(text) and count <= stop_after:
            end = min(start + COUNT_SLICE, len(text))
            if end < len(text):
                cut = text.find(" ", end, end + COUNT_SLICE)
                while cut != -1 and text[cut - 1].isspace():
                    cut = text.find(" ", cut + 1, end + COUNT_SLICE)
                end = cut if cut != -1 else end + COUNT_SLICE
            count += len(self._encode_plain(text[start:end]))
            start = end
        return count

    def expand(self, ids: list[int], media: list[StoredEmbeddings]) -> list[int]:
        """`ids` (template_ids') with each image placeholder repeated once per embedding row and each video
        placeholder replaced by `video_ids`, in order. BadRequest when the template's placeholders are not
        the request's media."""
        found = ["image" if i == self.image_token_id else "video" for i in ids
                 if i in (self.image_token_id, self.video_token_id)]
        if found != [e.modality for e in media]:
            raise BadRequest(f"the chat template placed placeholders for {found or 'nothing'}, the request has "
                             f"{[e.modality for e in media] or 'no media'}")
        if not media:
            return ids
        out: list[int] = []
        rest = iter(media)
        skip = False
        for n, i in enumerate(ids):
            if skip:  # the template's <|vision_end|> after a video placeholder whose wrapper is dropped
                skip = False
            elif i == self.image_token_id:
                out += [i] * next(rest).main.shape[0]
            elif i == self.video_token_id:
                if (self.drops_video_wrapper and out and out[-1] == self.vision_start_id
                        and ids[n + 1:n + 2] == [self.vision_end_id]):
                    out.pop()
                    skip = True
                out += self.video_ids(next(rest))
            else:
                out.append(i)
        return out

    def media_rows(self, media: list[StoredEmbeddings]) -> int:
        """The prompt tokens `expand` puts in for these media: an image's rows, a video's `video_ids`."""
        return sum(e.main.shape[0] if e.modality == "image" else len(self.video_ids(e)) for e in media)

    def video_ids(self, e: StoredEmbeddings) -> list[int]:
        """`video_text` as ids, each timestamp encoded alone (as vLLM's get_video_repl does). After the first
        group each lies between two vision markers, so it encodes as it would inside the whole prompt; the
        first does too where the template's <|vision_start|> stays before it, or where the text before the
        video ends in a letter, a digit, a newline or a marker (a punctuation or a space there may join
        `<` into one token when transformers tokenises the whole text)."""
        t, h, w = e.grid_thw
        group = [self.vision_start_id, *[self.video_token_id] * (h * w // self.merge**2), self.vision_end_id]
        return [i for s in e.timestamps for i in self._encode(f"<{s:.1f} seconds>") + group]

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
            raise BadGateway(f"store entry {key!r} does not fit this language model: " + "; ".join(problems)
                             + ". Do encoder and LM use the same checkpoint?", code="embeddings_mismatch")


# ---- the request path ---------------------------------------------------------------------------
POLL_S = 0.1  # how often a request in progress looks whether its client is still there


class Cancel:
    """Why one request's work should stop: its deadline passed, or its client left. Set by the request's
    watcher (event loop) and read by its generation thread after every token."""

    def __init__(self, deadline: float):
        self.deadline = deadline  # time.monotonic()
        self.reason: Literal["deadline", "client gone"] | None = None
        self.phase = "admitted"  # where the request is, for the deadline's message
        self.fired = False  # the generation stopped on it (its tokens are not the whole answer)
        self._event = threading.Event()

    def set(self, reason: Literal["deadline", "client gone"]) -> None:
        if self.reason is None:
            self.reason = reason
        self._event.set()

    def stopped(self) -> bool:
        if not self._event.is_set() and time.monotonic() >= self.deadline:
            self.set("deadline")
        return self._event.is_set()

    def in_generation(self) -> bool:
        """`stopped`, as the generation thread asks it: records that the generation ended on it."""
        if self.stopped():
            self.fired = True
        return self.fired


class ClientGone(Exception):
    """The client disconnected: nobody to answer (not a ServiceError: no answer is sent)."""


class Admission:
    """The LM's queue: at most `max_waiting` requests admitted behind the one generating, counted from the
    moment the body is in until the answer (encoding, tokenising, waiting for the LM); one more is a 429
    at once. One event loop, so a plain counter."""

    def __init__(self, max_waiting: int):
        self.max_waiting, self.inside = max_waiting, 0

    @contextmanager
    def __call__(self):
        if self.inside > self.max_waiting:
            raise Overloaded(f"{self.inside} chat requests are in progress here: one generating and "
                             f"{self.max_waiting} waiting (--max-waiting); retry after Retry-After seconds")
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1


class Chat:
    def __init__(self, cfg: ChatConfig, lm: LanguageModel, encoder_transport: httpx.AsyncBaseTransport | None = None):
        self.cfg, self.lm = cfg, lm
        headers = {"authorization": f"Bearer {cfg.encoder_api_key}"} if cfg.encoder_api_key else None
        self.http = httpx.AsyncClient(base_url=cfg.encoder_url, timeout=cfg.encoder_timeout_s, headers=headers,
                                      transport=encoder_transport)
        self.reader = open_reader(cfg.store, local_host=cfg.mooncake_local_host) if is_mooncake(cfg.store) else \
            open_reader(cfg.store)
        self.admission = Admission(cfg.max_waiting)
        self.turn = asyncio.Lock()  # one generation at a time, in arrival order (asyncio's lock is FIFO)

    async def encode(self, parts: list[ImagePart | VideoPart]) -> list[dict]:
        """POST the image and video parts to the encoder; its items, in order. Its 4xx/503 pass through as ours."""
        body = {"images": [p.model_dump(exclude_none=True) for p in parts]}
        try:
            r, _ = await apost(self.http, "/encode", json=body)  # retried once if the connection was stale
        except httpx.HTTPError as e:
            raise BadGateway(f"the encoder at {self.cfg.encoder_url} could not be reached: {type(e).__name__}: {e}",
                             code="encoder_unavailable") from None
        if r.status_code != 200:
            try:
                err = r.json()["error"]
                code, message = err["code"], f"encoder: {err['message']}"
            except (ValueError, KeyError, TypeError):
                code, message = "encoder_error", f"encoder answered {r.status_code}"
            if r.status_code == 401:  # our key, not the client's: the client can do nothing about it
                raise BadGateway(f"the encoder at {self.cfg.encoder_url} refused this consumer's key ({message}); "
                                 "start the consumer with the encoder's key (--encoder-api-key or "
                                 "QVE_ENCODER_API_KEY)", code="encoder_unauthorized")
            status = r.status_code if r.status_code < 500 or r.status_code == 503 else 502
            retry = r.headers.get("Retry-After")
            raise Relayed(status, code, message, int(retry) if retry and retry.isdigit() else None)
        return r.json()["items"]

    async def embeddings(self, parts: list[ImagePart | VideoPart]) -> list[tuple[dict, StoredEmbeddings]]:
        items = await self.encode(parts) if parts else []
        out = []
        for part, item in zip(parts, items):
            emb = self._read(item)
            if emb is None:  # evicted (or its host lost) between the encoder's answer and this read: ask once more
                log.warning("store entry %s missing after /encode answered it; re-requesting once", item["key"])
                (item,) = await self.encode([part])
                emb = self._read(item)
            if emb is None:
                raise EmbeddingsMissing(f"the encoder answered key {item['key']!r} twice, but {self.cfg.store} does not "
                                        "hold it: is --store the encoder's store root, and is the store large enough?")
            sent = "image" if isinstance(part, ImagePart) else "video"
            if item.get("modality", "image") != sent:
                raise BadGateway(f"the encoder answered {item['key']!r} as an {item.get('modality', 'image')} for a "
                                 f"{sent} part: does it take videos (issue 22)?", code="embeddings_mismatch")
            try:
                self.lm.check(item["key"], emb, item)
            except StoreFormatError as e:
                raise BadGateway(f"store entry {item['key']!r}: {e}", code="embeddings_mismatch") from None
            out.append((item, emb))
        return out

    def _read(self, item: dict) -> StoredEmbeddings | None:
        try:
            return self.reader.read(item["key"], item.get("store_key"))
        except KeyError:
            return None
        except StoreFormatError as e:
            raise BadGateway(str(e), code="embeddings_mismatch") from None

    async def answer(self, req: ChatRequest, client_gone: Callable[[], Awaitable[bool]]) -> dict:
        """`complete(req)` within the request's deadline, stopped when the client leaves (ClientGone) or the
        deadline passes (DeadlineExceeded): a generation stops at its next token, and whatever the request
        was waiting for (the encoder, the LM) is cancelled."""
        cancel = Cancel(time.monotonic() + self.cfg.request_timeout_s)
        work = asyncio.ensure_future(self.complete(req, cancel))

        async def watch() -> None:
            while not cancel.stopped():
                if await client_gone():
                    cancel.set("client gone")
                    return
                await asyncio.sleep(POLL_S)

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                await asyncio.wait([work])  # a generation stops at its next token; the LM is handed on after
        if cancel.reason == "client gone":
            raise ClientGone()
        if work.cancelled():
            raise self._late(cancel)
        return work.result()

    def _late(self, cancel: Cancel) -> DeadlineExceeded:
        return DeadlineExceeded(f"no answer within {self.cfg.request_timeout_s:g} s (--request-timeout-s); the request "
                                f"was stopped while {cancel.phase}: ask for fewer max_tokens, or retry when the LM is "
                                "less busy")

    async def complete(self, req: ChatRequest, cancel: Cancel) -> dict:
        if req.temperature not in (None, 0, 0.0):
            raise BadRequest(f"temperature {req.temperature}: only greedy decoding is supported; "
                             "send temperature 0 or leave it out")
        if req.max_tokens > self.cfg.max_tokens_limit:
            raise BadRequest(f"max_tokens {req.max_tokens} is over this server's limit of "
                             f"{self.cfg.max_tokens_limit}")
        parts, messages = [], []
        for m in req.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            content = []
            for p in m.content:
                if isinstance(p, (ImagePart, VideoPart)):
                    parts.append(p)
                    content.append({"type": "image" if isinstance(p, ImagePart) else "video"})
                else:
                    content.append({"type": "text", "text": p.text})
            messages.append({"role": m.role, "content": content})
        # The prompt is counted before the encoder is asked (a long prompt costs it nothing), then with the
        # media's rows; in a thread: tokenising takes a while, and the loop serves the other requests.
        cancel.phase = "tokenising"
        template_ids = await asyncio.to_thread(self._tokenise, messages, len(parts), req.max_tokens)
        cancel.phase = "encoding its images and videos"
        media = [e for _, e in await self.embeddings(parts)]
        input_ids = self.lm.expand(template_ids, media)
        self._check_prompt(len(input_ids), 0, req.max_tokens, media_rows=self.lm.media_rows(media))
        new = await self.generate(input_ids, media, req.max_tokens, cancel)
        finish = "stop" if new and new[-1] in self.lm.eos_ids else "length"
        choice = {"index": 0, "finish_reason": finish,
                  "message": {"role": "assistant", "content": self.lm.tokenizer.decode(new, skip_special_tokens=True)}}
        answer = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                  "model": req.model or self.lm.name, "choices": [choice],
                  "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(new),
                            "total_tokens": len(input_ids) + len(new)}}
        if req.return_token_ids:
            choice["token_ids"] = new
            answer["prompt_token_ids"] = input_ids  # vLLM's field: what the model read, placeholders expanded
        return answer

    def _tokenise(self, messages: list[dict], placeholders: int, max_tokens: int) -> list[int]:
        """The prompt's template_ids, checked against --max-prompt-tokens; first the messages' text alone,
        counted slice by slice (count_text), so that a text far over the limit is refused after about a
        limit's worth of tokenising, whatever its size (a megabyte of text took seconds to tokenise whole)."""
        limit = self.cfg.max_prompt_tokens
        texts = [t for m in messages for t in ([m["content"]] if isinstance(m["content"], str) else
                                               [p["text"] for p in m["content"] if p["type"] == "text"])]
        # Inside the template a text's first and last tokens can merge with the markup beside them: two
        # tokens of slack per text, so that this early count never refuses what the exact one would take.
        slack, seen = 2 * len(texts), 0
        for text in texts:
            seen += self.lm.count_text(text, limit + slack - seen)
            if seen > limit + slack:
                raise BadRequest(f"the messages' text is over this server's limit of {limit} prompt tokens "
                                 f"(--max-prompt-tokens; {seen} counted before the count stopped); send less text")
        ids = self.lm.template_ids(messages)
        self._check_prompt(len(ids), placeholders, max_tokens)
        return ids

    def _check_prompt(self, tokens: int, placeholders: int, max_tokens: int, media_rows: int | None = None) -> None:
        """A prompt over --max-prompt-tokens, or one whose answer would pass the model's context, is a 400
        before the LM is taken. Before the encoder answers (`media_rows` None) each image or video counts
        one token; it will count at least that."""
        limit, context = self.cfg.max_prompt_tokens, self.lm.context
        if tokens > limit:
            what = (f"{tokens - placeholders} tokens of text and chat markup" if media_rows is None else
                    f"{tokens} tokens, {media_rows} of them images and videos")
            raise BadRequest(f"the prompt is {what}, over this server's limit of {limit} prompt tokens "
                             "(--max-prompt-tokens); send less text, or fewer or smaller images and videos")
        if context is not None and tokens + max_tokens > context:
            raise BadRequest(f"the prompt's {tokens} tokens and max_tokens {max_tokens} pass the model's context "
                             f"of {context} tokens; ask for fewer")

    def _generation(self, input_ids: list[int], media: list[StoredEmbeddings], max_tokens: int, stop) -> list[int]:
        """The LM's generation (its thread), a `generation` span with tracing on (to_thread carries the context)."""
        with tracing.span("generation", prompt_tokens=len(input_ids), max_tokens=max_tokens) as span:
            new = self.lm.generate(input_ids, media, max_tokens, stop)
            if span is not None:
                span.set_attribute("completion_tokens", len(new))
            return new

    async def generate(self, input_ids: list[int], media: list[StoredEmbeddings], max_tokens: int,
                       cancel: Cancel) -> list[int]:
        """The LM's greedy tokens, one request at a time (first come, first served), stopped by `cancel`."""
        cancel.phase = "waiting for the LM"
        async with self.turn:
            cancel.phase = "generating"
            work = asyncio.ensure_future(asyncio.to_thread(self._generation, input_ids, media, max_tokens,
                                                           cancel.in_generation))
            try:
                new = await asyncio.shield(work)
            except asyncio.CancelledError:
                # Cancelled from outside (the deadline or a disconnect seen by the watcher, which set
                # `cancel`; or a shutdown): the thread stops at its next token. The LM is handed on only
                # once it has: no two generations on one model.
                cancel.set("deadline")  # (a no-op when the watcher set its reason first)
                await asyncio.wait([work])
                raise
        if cancel.fired:  # the thread stopped on the deadline it checks itself: a part answer is no answer
            if cancel.reason == "client gone":
                raise ClientGone()
            raise self._late(cancel)
        return new


def create_chat_app(cfg: ChatConfig, lm: LanguageModel, encoder_transport: httpx.AsyncBaseTransport | None = None,
                    ) -> FastAPI:
    """The consumer's app; `encoder_transport` (tests): how its encoder calls travel, httpx's own by default."""
    chat = Chat(cfg, lm, encoder_transport)
    app = FastAPI(title="Qwen3-VL LM consumer", version="0.1.0",
                  description="Answers chat requests from the image and video embeddings the encoder service stored.")
    app.state.chat = chat
    started = int(time.time())
    # The body's size and pace, as the encoder bounds its /encode (a 100 MB body was read whole).
    app.add_middleware(BodyLimit, limit=cfg.max_request_bytes, timeout_s=cfg.body_timeout_s,
                       paths=("/v1/chat/completions",), hint="send less text, or fewer or smaller images and videos")
    install_error_handlers(app)
    authorized = bearer_auth(cfg.api_key)

    def authorize(request: Request) -> None:
        if not authorized(request):
            raise Unauthorized("this consumer needs an API key: send `Authorization: Bearer <key>`")

    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        authorize(request)
        body = await request.body()  # (BodyLimit: 413 over --max-request-bytes, 408 on a stall)
        try:
            req = ChatRequest.model_validate_json(body)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BadRequest(f"invalid request body at '{where}': {first['msg']}") from None
        with chat.admission():
            try:
                return await chat.answer(req, request.is_disconnected)
            except ClientGone:
                log.info("chat request stopped: its client disconnected")
                return PlainTextResponse("client disconnected", status_code=499)  # nobody reads it

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request):
        """200 once the LM is loaded. With --api-key, the details (model, encoder, store, queue) only to a
        request with the key: a load balancer's probe needs just `ready`."""
        if not authorized(request):
            return {"ready": True}
        return {"ready": True, "model": lm.name, "encoder": cfg.encoder_url, "store": str(cfg.store),
                "requests": chat.admission.inside}

    @app.get("/v1/models")
    async def models(request: Request):
        """OpenAI's model list (clients ask it first): the one model this consumer serves."""
        authorize(request)
        return {"object": "list", "data": [{"id": lm.name, "object": "model", "created": started,
                                            "owned_by": "qwen3vl-encoder"}]}

    return app


def serve(cfg: ChatConfig, host: str, port: int, log_level: str = "info") -> int:
    import uvicorn

    try:
        lm = LanguageModel(cfg)
    except ModelLoadError as e:
        print(f"cannot load the language model: {e}", flush=True)
        return 2
    uvicorn.run(create_chat_app(cfg, lm), host=host, port=port, log_level=log_level)
    return 0

"""The prompt as token ids: the checkpoint's chat template rendered with the control tokens in message
text kept as text, each image's and video's placeholder expanded to its stored rows (a video's as
Qwen3VLProcessor writes it), and a text counted against the prompt limit. Tokenizer work only."""

from __future__ import annotations

import logging
import re

import jinja2

from service.errors import clip, ModelLoadError, RequestError
from service.store.format import StoredEmbeddings

log = logging.getLogger(__name__)

# Private-use characters around the control tokens found in message text (PromptBuilder.template_ids): no
# chat template writes them, so after rendering they tell a user's `<|im_end|>` from the template's.
_MARK_START, _MARK_END = "\ue000", "\ue001"
COUNT_SLICE = 16384  # characters tokenised at a time when a text is counted against the prompt limit


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


class PromptBuilder:
    """A checkpoint's prompts: from the chat messages (the template's dicts, one `{"type": "image"}` or
    `{"type": "video"}` per media part) and the media's stored embeddings to the ids the LM reads.
    `tokenizer` is the checkpoint's, a fast one; `config` its Qwen3-VL config (placeholder ids, merge size)."""

    def __init__(self, tokenizer, config):
        self.tokenizer = tokenizer
        self.image_token_id, self.video_token_id = config.image_token_id, config.video_token_id
        self.image_pad = tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.video_pad = tokenizer.convert_ids_to_tokens(config.video_token_id)
        self.vision_start = tokenizer.convert_ids_to_tokens(config.vision_start_token_id)
        self.vision_end = tokenizer.convert_ids_to_tokens(config.vision_end_token_id)
        self.vision_start_id, self.vision_end_id = config.vision_start_token_id, config.vision_end_token_id
        self.drops_video_wrapper = processor_drops_video_wrapper()
        self.merge = config.vision_config.spatial_merge_size
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
            raise RequestError(f"the chat template placed placeholders for {found or 'nothing'}, the request has "
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
            raise RequestError(f"the model's chat template refused the messages: {clip(str(e), 200)}") from None
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
                raise RequestError(f"a message's text holds {piece!r}, which this model's tokenizer reads as its "
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
        placeholder replaced by `video_ids`, in order. `bad_request` when the template's placeholders are not
        the request's media."""
        found = ["image" if i == self.image_token_id else "video" for i in ids
                 if i in (self.image_token_id, self.video_token_id)]
        if found != [e.modality for e in media]:
            raise RequestError(f"the chat template placed placeholders for {found or 'nothing'}, the request has "
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


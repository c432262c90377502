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
     transformers' processor does: prompt.py's `processor_drops_video_wrapper`);
  4. transformers' Qwen3-VL generates greedily from the embeddings (`mm_encoder_outputs`), taking
     the 3-D rotary positions from image_grid_thw / video_grid_thw and mm_token_type_ids (its
     get_rope_index splits a video into one grid per temporal group, with the timestamp text between),
     and the answer carries OpenAI's `usage` counts.
A key evicted between the encoder's answer and the read is re-requested once; still missing -> 424. An
entry of another encoder model than the one this LM reads (its checkpoint's own tower unless
--encoder-model says otherwise) -> 502, whatever its shapes: a random preset of the same architecture fits.
Errors are the encoder's JSON error shape: `{"error": {"code", "message"}}`.

What one request may cost (the one LM answers one chat at a time: a 200k-word prompt would hold it for
minutes while every other chat waited): a body over --max-request-bytes is a 413 before it is read; a prompt over
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

The package, a module per job: config.py (ChatConfig), schemas.py (the request's shapes, with the
encoder's own image and video parts), prompt.py (the prompt's ids: the chat template, control tokens in
text, the media's placeholders), model.py (LanguageModel: loading, generation, whether a store entry fits),
app.py (the request path: admission, the deadline and the disconnect, the encoder and the store, the
routes; `create_chat_app`, `serve`).
"""

from service.lm.chat.app import create_chat_app, serve
from service.lm.chat.config import ChatConfig
from service.lm.chat.model import LanguageModel

__all__ = ["ChatConfig", "LanguageModel", "create_chat_app", "serve"]

"""CLI: `python -m service serve --model PRESET_OR_DIR --device cpu|cuda[:N] --dtype ... --store DIR ...`
and `python -m service consume --model CHECKPOINT_DIR --encoder-url URL --store DIR` (the LM side).

Every Settings field is a flag (`max_batch_tokens` -> `--max-batch-tokens`) and an environment
variable (`QVE_MAX_BATCH_TOKENS`); a flag wins. The model is loaded before the server binds, so a bad
`--model` fails fast with a message instead of a half-started server.
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError

from .config import Settings
from .errors import ModelLoadError


def _flag_type(annotation):
    """argparse type for a Settings field annotation."""
    base = annotation
    if typing.get_origin(base) in (typing.Union, types.UnionType):  # `int | None` -> int
        base = next(a for a in typing.get_args(base) if a is not type(None))
    if typing.get_origin(base) is typing.Literal:
        return str, list(typing.get_args(base))
    if typing.get_origin(base) is list:
        return str, None  # comma-separated; Settings splits it
    if base in (int, float, str, Path):
        return base, None
    return str, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m service", description="Qwen3-VL vision-encoder service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service", argument_default=argparse.SUPPRESS)
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        help_ = f"{field.description or ''} (env QVE_{name.upper()})".strip()
        if field.annotation is bool:
            serve.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_)
            continue
        type_, choices = _flag_type(field.annotation)
        serve.add_argument(flag, type=type_, choices=choices, help=help_, metavar=name.upper() if not choices else None)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    from .config import default_store_dir

    consume = sub.add_parser("consume", help="run the LM consumer: OpenAI-style chat answered from the store",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    consume.add_argument("--model", type=Path, required=True, help="Qwen3-VL checkpoint directory (with tokenizer)")
    consume.add_argument("--encoder-url", default="http://127.0.0.1:8080", help="the encoder service")
    consume.add_argument("--store", type=Path, default=default_store_dir(), help="the encoder's store root")
    consume.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    consume.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    consume.add_argument("--host", default="127.0.0.1")
    consume.add_argument("--port", type=int, default=8090)
    consume.add_argument("--max-tokens-limit", type=int, default=1024, help="the most tokens one request may ask for")
    consume.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    route = sub.add_parser("route", help="run a router: encode a chat request's images here, forward it to vLLM",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    route.add_argument("--encoder-url", default="http://127.0.0.1:8080", help="this encoder service")
    route.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="vLLM running as an EC consumer of the store")
    route.add_argument("--image-parts", default="raw", choices=["raw", "embeds"],
                       help="forward images as they came plus uuid (raw), or as metadata-only image_embeds (vLLM >= 0.33)")
    route.add_argument("--host", default="127.0.0.1")
    route.add_argument("--port", type=int, default=8100)
    route.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    log_level = args.pop("log_level", "info")
    if command == "route":
        from .router import RouterConfig, serve as serve_router

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return serve_router(RouterConfig(args["encoder_url"], args["vllm_url"], args["image_parts"]),
                            args["host"], args["port"], log_level)
    if command == "consume":
        from .chat import ChatConfig, serve

        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        host, port = args.pop("host"), args.pop("port")
        return serve(ChatConfig(**args), host, port, log_level)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(**args)
    except ValidationError as e:
        print(f"invalid settings:\n{e}", file=sys.stderr)
        return 2

    if settings.api_processes > 0:
        from .supervisor import serve_supervised

        return serve_supervised(settings, log_level)

    import uvicorn

    from .app import create_app, server_options
    from .loader import load_model

    try:
        model = load_model(settings)
    except ModelLoadError as e:
        print(f"cannot load model: {e}", file=sys.stderr)
        return 2
    # NOTE: several threads share the GIL (event loop, step loop, store writers); each blocking call
    # (file I/O, event waits) can cost a whole switch interval to get the GIL back. 5 ms (the default)
    # stalls the pipeline; 1 ms keeps the hand-offs short at negligible switching cost.
    sys.setswitchinterval(0.001)
    app = create_app(settings, model)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=log_level, **server_options(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())

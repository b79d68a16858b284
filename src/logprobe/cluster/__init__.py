"""logprobe beyond one process: replicas on Ray Serve (ray_app.py) and what they share (state.py)."""

import os

LOCAL_RAY_ENV = {
    # bind every Ray process of a local cluster to 127.0.0.1 (read when ray is imported)
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Serve's controller kills a proxy that misses three health checks in a row, and with it every
    # connection the proxy holds. Its default, 10 s a check, is short on a machine whose cores the
    # replicas keep busy (they run niced, ray_app.REPLICA_NICENESS, but other programs may not be):
    # 30 s a check, and 30 s for a new proxy to say it is ready.
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30",
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30",
    # logprobe's own: the replicas' inter-deployment gRPC servers on 127.0.0.1 too (ray_app.py)
    "LOGPROBE_RAY_LOOPBACK": "1",
}


def local_ray_environment(joining: bool) -> None:
    """Set before `import ray`: a local cluster stays on loopback, with patient proxy health checks;
    joining one, only usage stats are off (the cluster's processes have the environment of its
    `ray start`)."""
    for name, value in LOCAL_RAY_ENV.items():
        if joining and name != "RAY_USAGE_STATS_ENABLED":
            continue
        os.environ.setdefault(name, value)

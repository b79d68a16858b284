"""logprobe beyond one process: replicas on Ray Serve (ray_app.py) and what they share (state.py)."""

import os

LOCAL_RAY_ENV = {
    # bind every Ray process of a local cluster to 127.0.0.1 (read when ray is imported)
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # logprobe's own: the replicas' inter-deployment gRPC servers on 127.0.0.1 too (ray_app.py)
    "LOGPROBE_RAY_LOOPBACK": "1",
}


def local_ray_environment(joining: bool) -> None:
    """Set before `import ray`: a local cluster stays on loopback; joining one, only usage stats are off."""
    for name, value in LOCAL_RAY_ENV.items():
        if joining and name != "RAY_USAGE_STATS_ENABLED":
            continue
        os.environ.setdefault(name, value)

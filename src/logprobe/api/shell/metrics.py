"""/metrics in the Prometheus text format (prometheus_client, one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from ...engine.host import grammar

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """What an engine reports: its steps, rows per step, failures, KV cache and sequence groups. In one
    process they live in the app's registry; each Ray Serve replica keeps its own (cluster/ray_app.py),
    which the app's /metrics shows with a `replica` label."""

    def __init__(self, registry: CollectorRegistry, stats, models: dict | None = None):
        """`stats`: the engine's stats function; or `models`: {model name: stats function} for several
        engines in one process, whose metrics then carry a `model` label."""
        r = registry
        models = models or {None: stats}
        labels = ["model"] if None not in models else []
        self.step_seconds = Histogram("logprobe_engine_step_seconds", "Duration of one engine step", labels,
                                      buckets=STEP, registry=r)
        self.batch_rows = Histogram("logprobe_engine_batch_rows", "Sequences (rows) in one engine step", labels,
                                    buckets=BATCH, registry=r)
        self.kv_cache_bytes = Gauge("logprobe_kv_cache_bytes", "Bytes allocated to the batched KV cache", labels,
                                    registry=r)
        self.prefix_cache_bytes = Gauge("logprobe_prefix_cache_bytes", "Bytes held by the prefix cache "
                                        "(--prefix-cache-mb)", labels, registry=r)
        # counts since start, read from the engine at scrape time (as the grammar cache's)
        prefix_counts = {key: Gauge(f"logprobe_prefix_cache_{key}", help_text, labels, registry=r) for key, help_text in (
            ("hits", "Prompts that found a kept prefix (prefix cache)"),
            ("misses", "Prompts that found none (prefix cache misses)"),
            ("tokens_saved", "Prompt tokens a kept prefix spared the blocks"))}
        self.engine_failures = Counter("logprobe_engine_failures", "Engine failures: 'step' (a shared pass failed; "
                                       "its requests failed and shared state was rebuilt) or 'request' (one "
                                       "request's own work failed)", ["kind", *labels], registry=r)
        self.engine_in_flight = Gauge("logprobe_engine_sequence_groups", "Sequence groups in the engine", labels,
                                      registry=r)
        self._children = {}
        for name, model_stats in models.items():
            pick = (lambda metric: metric.labels(name)) if labels else (lambda metric: metric)
            for kind in ("step", "request"):
                self.engine_failures.labels(kind, *([name] if labels else []))
            pick(self.engine_in_flight).set_function(lambda f=model_stats: f()["in_flight"])
            pick(self.kv_cache_bytes).set_function(lambda f=model_stats: f()["kv_cache_bytes"])
            pick(self.prefix_cache_bytes).set_function(lambda f=model_stats: f().get("prefix_cache_bytes", 0))
            for key, gauge in prefix_counts.items():
                pick(gauge).set_function(lambda f=model_stats, key=key: f().get(f"prefix_cache_{key}", 0))
            self._children[name] = (pick(self.step_seconds), pick(self.batch_rows), labels and [name] or [])

    def observers(self, model=None):
        """(observe_step, observe_failure) for one engine (`model`: its name when there are several)."""
        step_seconds, batch_rows, extra = self._children[model]

        def observe_step(seconds: float, rows: int) -> None:
            """Called by the engine thread after each step (prometheus_client is thread-safe)."""
            step_seconds.observe(seconds)
            batch_rows.observe(rows)

        def observe_failure(kind: str) -> None:
            self.engine_failures.labels(kind, *extra).inc()

        return observe_step, observe_failure


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("logprobe_requests", "HTTP requests answered, by path and status",
                                ["path", "status"], registry=r)
        self.prompt_tokens = Counter("logprobe_prompt_tokens", "Prompt tokens of answered requests (x n)",
                                     registry=r)
        self.completion_tokens = Counter("logprobe_completion_tokens", "Tokens generated", registry=r)
        self.request_seconds = Histogram("logprobe_request_duration_seconds",
                                         "Time from request to the end of its answer", ["path"],
                                         buckets=LATENCY, registry=r)
        self.queue_seconds = Histogram("logprobe_queue_time_seconds", "Time admitted requests waited for their hold",
                                       buckets=LATENCY, registry=r)
        self.queue_depth = Gauge("logprobe_queue_depth", "Requests waiting for their hold", registry=r)
        self.running = Gauge("logprobe_requests_running", "Admitted requests not yet finished", registry=r)
        self.tokens_held = Gauge("logprobe_tokens_held", "Tokens held by admitted requests", registry=r)
        self.capacity = Gauge("logprobe_tokens_capacity", "Tokens the server holds at most (max_tokens_in_flight)",
                              registry=r)
        self.engine: EngineMetrics | None = None
        self.watch_grammars()

    def watch_grammars(self) -> None:
        """The grammar cache of this process (engine/host/grammar.py): the API looks up every request's
        constraint before it is held, and an engine in the same process each sequence's (a Ray
        replica's lookups are its own)."""
        r = self.registry
        for key, help_text in (("hits", "Constraints found already compiled (grammar cache)"),
                               ("misses", "Constraints compiled (grammar cache misses)"),
                               ("entries", "Compiled grammars held in the cache"),
                               ("compile_seconds", "Seconds spent compiling grammars, summed")):
            gauge = Gauge(f"logprobe_grammar_cache_{key}", help_text, registry=r)
            gauge.set_function(lambda key=key: grammar.cache_stats()[key])

    def watch(self, admission) -> None:
        """Gauges read live from the admission at scrape time."""
        self.queue_depth.set_function(lambda: admission.queue_depth)
        self.running.set_function(lambda: admission.running)
        self.tokens_held.set_function(lambda: admission.held)
        self.capacity.set_function(lambda: admission.capacity)

    def attach_backends(self, backends) -> None:
        """The served models' metrics: the steps and failures of those whose steps run in this process
        observed as they happen (labelled by model when there are several); the others' collectors."""
        engines = [b for b in backends if b.steps_here]
        if len(engines) == 1:
            self.engine = EngineMetrics(self.registry, engines[0].stats)
            engines[0].observe(*self.engine.observers())
        elif engines:
            self.engine = EngineMetrics(self.registry, None, {e.info.name: e.stats for e in engines})
            for engine in engines:
                engine.observe(*self.engine.observers(engine.info.name))
        for backend in backends:
            collector = backend.collector()
            if collector is not None:
                self.registry.register(collector)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

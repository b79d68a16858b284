"""Token strings, text offsets and the log-probability shapes, on their own."""

from __future__ import annotations

import numpy as np

from logprobe.tokens import TextAssembler, TokenTable, token_string
from logprobe.output.logprobs import TokenNamer, legacy_logprobs, ranks_of_top, wire_floats


def test_token_string_partial_utf8():
    assert token_string(b" sky") == " sky"
    assert token_string("’".encode()[:2]) == "bytes:\\xe2\\x80"
    assert token_string(b"\xff") == "bytes:\\xff"


def test_table_matches_tokenizer_for_whole_tokens(tokenizer):
    table = TokenTable.build(tokenizer, len(tokenizer))
    ids = tokenizer("The café’s naïve ünïcödé 日本語 text", add_special_tokens=False).input_ids
    joined = b"".join(table.token_bytes[i] for i in ids)
    assert joined.decode("utf-8") == "The café’s naïve ünïcödé 日本語 text"
    # every single-token string equals the tokenizer's own decode where that is valid UTF-8
    for i in ids:
        s = table.strings[i]
        if not s.startswith("bytes:"):
            assert s == tokenizer.decode([i])
    assert any(table.strings[i].startswith("bytes:") for i in ids)  # 日本語 splits inside characters
    assert table.strings[tokenizer.eos_token_id] == tokenizer.eos_token


def test_text_assembler_offsets_split_character(tokenizer):
    table = TokenTable.build(tokenizer, len(tokenizer))
    text = "a 日本語 b"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    asm = TextAssembler(table, start=5)
    for i in ids:
        asm.add(i)
    asm.finish()
    assert asm.text == text
    assert asm.offsets[0] == 5 and asm.offsets == sorted(asm.offsets)
    assert asm.length == 5 + len(text)
    # a token that finishes a character starts where that character starts
    for off, i in zip(asm.offsets, ids):
        s = table.strings[i]
        if not s.startswith("bytes:"):
            assert text[off - 5:off - 5 + len(s)] == s


def test_wire_floats_neg_inf():
    out = wire_floats(np.array([-np.inf, -1.5, 0.0], dtype=np.float32))
    assert out.tolist() == [-9999.0, -1.5, 0.0]


def test_ranks_with_ties():
    top = np.array([[-1.0, -2.0, -2.0, -3.0]], dtype=np.float32)
    assert ranks_of_top(top).tolist() == [[1, 2, 2, 4]]


def test_legacy_shape_own_token_first_and_k_plus_one():
    namer = TokenNamer(np.array(["a", "b", "c", "d"], dtype=object), as_ids=False)
    out = legacy_logprobs(namer, np.array([3, 0]), np.array([-5.0, -0.5], dtype=np.float32),
                          np.array([[0, 1], [0, 2]]), np.array([[-0.5, -1.0], [-0.5, -2.0]], dtype=np.float32),
                          [0, 1])
    assert out["tokens"] == ["d", "a"]
    assert list(out["top_logprobs"][0]) == ["d", "a", "b"]  # k + 1: the token is not among the top 2
    assert list(out["top_logprobs"][1]) == ["a", "c"]  # k: it is
    assert out["text_offset"] == [0, 1]


def test_sampling_at_extreme_temperatures_picks_a_real_token():
    import torch

    from logprobe.engine.host.request import SamplingParams
    from logprobe.engine.device.sampler import sample_row

    row = torch.log_softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), -1)
    for t in (5e-324, 1e-300, 1e-6, 1e-5, 2.0):
        for top_p in (1.0, 1e-9):
            token = sample_row(row, SamplingParams(temperature=t, top_p=top_p), 12345)
            if t < 1e-4 or top_p < 1e-6:
                assert token == int(row.argmax())  # vanishing temperature or top_p: the likeliest
            else:
                assert 0 <= token < 1000


def test_gguf_cache_is_per_transformers_version(tmp_path, monkeypatch):
    """A directory dequantized by one transformers version (its tokenizer conversion differs between
    versions) is never read by another."""
    import transformers

    from logprobe.engine.runners import loader

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LOGPROBE_CACHE_DIR", str(tmp_path / "cache"))
    here = loader.gguf_cache_dir(str(gguf))
    assert loader.gguf_cache_dir(str(gguf)) == here
    monkeypatch.setattr(transformers, "__version__", "5.0.0")
    assert loader.gguf_cache_dir(str(gguf)) != here

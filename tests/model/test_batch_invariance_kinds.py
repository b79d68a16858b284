"""The same bits beside other requests (test_batch_invariance.py) for every other kind of request and
every other number an answer holds: activations (residual stream) of a scored text and of a generation,
the logit lens, instruments on generated tokens (asked ids, statistics, top-p sets, processed numbers),
steered and constrained draws (logit bias, allowed ids, a regex, a choice list), interventions with their
unmodified numbers, several choices of one prompt, token trees, and the whole vocabulary at every prompt
position (what /v1/compare reads of each model).

Each probe runs alone on the engine without a prefix cache, then all the probes together beside a random
mix of 7 and of 24 other requests (test_batch_invariance's `mixed`, with requests of these kinds added, so
activation, lens, steered, constrained, intervened, several-choice and tree requests run beside each other),
arriving in the same step as the mix or while it runs, on that engine and on one whose prefix cache holds
what the runs before left; prompts are prefilled in chunks of 40 tokens beside decoding rows. Every number
of a probe's answer (`SequenceGroup.output()`, walked field by field: arrays with their dtype and shape,
texts, offsets, counts) must have the alone run's bits; a few are checked against the float64 forward.

/v1/compare is the host's computation (api/compare/serving.py: output/divergence.py over two answers'
`prompt_logprobs: -1` columns): its engine input is the "full" probe's answer, compared here; the same input
bits give the same divergences.

The runs are made once per family (`runs`) and each test reads its own probes' answers from them.

Slow: the first test of a family makes its runs (5 alone, 4 beside 7-24 others; 9-12 s on one thread)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from logprobe.backend import Constraint, GenerationRequest, Intervention, TreeShape
from logprobe.engine.host.request import SamplingParams, SequenceGroup
from logprobe.engine.host.tree import group_for
from logprobe.engine.runners.lean.attention import Attention
from test_batch_invariance import drive, mixed, prompt
from test_prefix_cache import engines  # noqa: F401 (a fixture: kind -> (model, cached engine, uncached))

pytestmark = pytest.mark.skipif(not Attention.invariant_kernels(), reason=(
    f"torch {torch.__version__}: its CPU attention gives a decode row other bits than a prompt pass "
    f"(test_attention_reads.py)"))

TOL = 1e-5
FAMILIES = ["llama", "gemma3"]  # full attention; sliding and full layers mixed (a window of 12)
HEAD = prompt(150, 3)  # the scored probe of test_batch_invariance: `mixed` shares its first 16-80 tokens
CHOICES = ["yes", "no", "maybe so"]


# ---- the probes ---------------------------------------------------------------------------------------
def vector(seed: int, d: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(d) * scale).astype(np.float32)


def probes(engine) -> list[SequenceGroup]:
    """One request of each kind (fresh groups; the same requests each call)."""
    layers, d, table = engine.info.num_layers, engine.info.d_model, engine.table
    sampled = dict(temperature=0.9, logprobs=3)

    def group(name, ids, **params):
        return SequenceGroup(name, ids, SamplingParams(**params), table)

    def tree(name, ids, shape, **params):
        return group_for(GenerationRequest(name, ids, SamplingParams(**params), tree=shape), table)

    edits = (Intervention(1, "add", None, vector(1, d)),  # every position, the generated ones too
             Intervention(0, "scale", (2, 5, -1), factor=0.5),
             Intervention(layers, "patch", (4,), source_ids=tuple(prompt(12, 40)), source_position=-1,
                          source_layer=1),
             Intervention(1, "set", (27, 29), vector(2, d)))  # generated positions (the prompt has 26)
    return [
        # 1. the residual stream
        group("residual-scored", HEAD[:40] + prompt(20, 31)[1:], max_tokens=0, echo=True, prompt_logprobs=1,
              residual_layers=(0, 1, layers)),
        group("residual-generated", prompt(25, 32), max_tokens=10, seed=5, residual_layers=(0, layers - 1, layers),
              **sampled),
        # 2. the logit lens
        group("lens", HEAD[:24] + prompt(10, 33)[1:], max_tokens=8, temperature=0, logprobs=1,
              lens_layers=(0, 1, layers), lens_top_k=3),
        group("lens-scored", prompt(30, 44), max_tokens=0, lens_layers=(1, layers), lens_top_k=2),
        # 3. instruments on generated tokens (and the prompt's)
        group("instruments", prompt(30, 34), max_tokens=10, seed=7, top_p=0.95, top_k=50, prompt_logprobs=2,
              logprob_token_ids=(5, 9, 100, 101), position_stats=True, top_logprobs_p=0.3, max_top_p_tokens=16,
              logprobs_mode="both", **sampled),
        # 4. steered and constrained draws
        group("biased", prompt(20, 35), max_tokens=10, seed=8, logprobs_mode="both",
              logit_bias=((5, 8.0), (9, -100.0), (100, 4.0)), position_stats=True, **sampled),
        group("allowed", prompt(22, 36), max_tokens=8, seed=9, logprobs_mode="both",
              allowed_token_ids=tuple(range(1000, 1300)) + (2,), logit_bias=((1001, 3.0),), **sampled),
        group("regex", prompt(18, 37), max_tokens=8, seed=10, logprobs_mode="both",
              constraint=Constraint("regex", "[0-9]{2,5}"), **sampled),
        group("choice", prompt(18, 38), max_tokens=8, seed=11, logprobs_mode="both",
              constraint=Constraint("choice", json.dumps(CHOICES)), **sampled),
        # 5. interventions, with the numbers without them
        group("intervened", prompt(26, 39), max_tokens=8, seed=12, prompt_logprobs=2, echo=True,
              interventions=edits, return_unmodified=True, residual_layers=(1, layers), lens_layers=(layers,),
              lens_top_k=2, **sampled),
        group("intervened-scored", HEAD[:50] + prompt(10, 45)[1:], max_tokens=0, prompt_logprobs=3, echo=True,
              interventions=(Intervention(0, "add", (1, 3, -2), vector(3, d)),), return_unmodified=True),
        # 6. several choices of one prompt
        group("n3", prompt(26, 41), n=3, max_tokens=8, seed=13, prompt_logprobs=1, **sampled),
        # 7. token trees
        tree("tree", HEAD[:33] + prompt(8, 42)[1:], TreeShape(depth=3, branches=3), temperature=0.9, top_k=20),
        tree("tree-steered", prompt(15, 46), TreeShape(depth=2, branches=6, branch_p=0.5), temperature=0.8,
             logit_bias=((5, 6.0), (9, 3.0))),
        # 8. /v1/compare's input: every prompt position's whole vocabulary
        group("full", HEAD[:20] + prompt(20, 43)[1:], max_tokens=0, prompt_logprobs=-1),
    ]


def other_kinds(engine, count: int, rng) -> list[SequenceGroup]:
    """`count` requests of the probes' kinds, on random prompts (some beginning with HEAD) and seeds."""
    layers, d, table = engine.info.num_layers, engine.info.d_model, engine.table
    out = []
    for i in range(count):
        ids = prompt(int(rng.integers(3, 120)), 500 + int(rng.integers(10_000)))
        if rng.integers(3) == 0:
            ids = HEAD[:int(rng.integers(16, 64))] + ids[1:]
        seed, gen = int(rng.integers(1000)), dict(max_tokens=int(rng.integers(3, 16)), temperature=0.8,
                                                   logprobs=int(rng.integers(0, 4)))
        gen["seed"] = seed
        which = int(rng.integers(10))
        params = [
            dict(gen, residual_layers=(int(rng.integers(layers + 1)),)),
            dict(max_tokens=0, residual_layers=(layers,), prompt_logprobs=1),
            dict(gen, lens_layers=(1,), lens_top_k=int(rng.integers(0, 4))),
            dict(gen, logprob_token_ids=(7, 8), position_stats=True, top_logprobs_p=0.5, max_top_p_tokens=8,
                 logprobs_mode="both"),
            dict(gen, logit_bias=((int(rng.integers(3, 500)), 5.0),), allowed_token_ids=tuple(range(2, 900))),
            dict(gen, constraint=Constraint("regex", "[a-z ]{1,12}")),
            dict(gen, interventions=(Intervention(int(rng.integers(layers + 1)), "add", None, vector(seed, d, 0.5)),),
                 return_unmodified=bool(rng.integers(2))),
            dict(gen, n=2, prompt_logprobs=1),
            None,  # a tree
            dict(max_tokens=0, prompt_logprobs=-1),
        ][which]
        if params is None:
            out.append(group_for(GenerationRequest(f"kind{i}", ids, SamplingParams(temperature=0.7),
                                                   tree=TreeShape(depth=2, branches=int(rng.integers(2, 5)))), table))
        else:
            out.append(SequenceGroup(f"kind{i}", ids, SamplingParams(**params), table))
    return out


# ---- an answer, number by number ---------------------------------------------------------------------
def numbers(value, path: str = "") -> list[tuple[str, object]]:
    """Every leaf of an answer (`GenerationOutput`): arrays, numbers, texts, with where it sits. The
    count of prompt tokens the prefix cache served is left out (the cached engine's own, by design)."""
    if dataclasses.is_dataclass(value):
        return [leaf for f in dataclasses.fields(value) if f.name != "num_cached_tokens"
                for leaf in numbers(getattr(value, f.name), f"{path}.{f.name}")]
    if isinstance(value, dict):
        return [leaf for key in sorted(value) for leaf in numbers(value[key], f"{path}[{key}]")]
    if isinstance(value, (list, tuple)):
        return [(f"{path}#len", len(value))] + [leaf for i, v in enumerate(value)
                                                for leaf in numbers(v, f"{path}[{i}]")]
    if isinstance(value, torch.Tensor):
        return [(path, value.cpu().numpy())]
    return [(path, value)]


def assert_same_bits(alone: list, beside: list, where: str) -> None:
    assert [p for p, _ in alone] == [p for p, _ in beside], where
    for (path, a), (_, b) in zip(alone, beside):
        if isinstance(a, np.ndarray):
            assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, (where, path)
            if not np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"):
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                raise AssertionError(f"{where}{path}: max abs difference {np.nanmax(diff):.3g} "
                                     f"at {int(np.sum(~(diff == 0) & ~np.isnan(diff)))} entries")
        else:
            assert type(a) is type(b) and (a == b or (a != a and b != b)), (where, path, a, b)


# ---- the runs, once per family -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(engines):
    """family -> (model, {probe: alone answer}, [(where, {probe: answer beside}, {probe: group})]): each
    probe alone on the engine without a cache; then all of them beside 7 and 24 others, in the same step
    and while the others run, on both engines (the cached one's cache cleared once, then holding what the
    runs leave), prompts prefilled in chunks of 40 tokens."""
    made = {}

    def of(kind):
        if kind in made:
            return made[kind]
        model, cached, uncached = engines(kind)
        with torch.inference_mode():
            alone = {}
            for group in probes(uncached):
                drive(uncached, [group])
                alone[group.request_id] = numbers(group.output())
            cached.runner.prefix_cache.clear()
            rng, beside = np.random.default_rng(29), []
            plan = [(uncached, 7, "same step"), (uncached, 24, "while running"),
                    (cached, 7, "while running"), (cached, 24, "same step")]
            for engine, count, arrival in plan:
                chunk, engine.scheduler.prefill_chunk_tokens = engine.scheduler.prefill_chunk_tokens, 40
                try:
                    others = mixed(engine, count * 2 // 3, rng) + other_kinds(engine, count - count * 2 // 3, rng)
                    others = [others[i] for i in rng.permutation(len(others))]
                    mine = probes(engine)
                    if arrival == "same step":
                        drive(engine, others + mine)
                    else:
                        drive(engine, others, later=mine, after=int(rng.integers(1, 4)))
                finally:
                    engine.scheduler.prefill_chunk_tokens = chunk
                beside.append((f"{kind}, beside {count} ({arrival}, {engine.info.name}): ",
                               {g.request_id: numbers(g.output()) for g in mine}, {g.request_id: g for g in mine}))
            assert cached.runner.prefix_cache.hits > 0
        made[kind] = model, alone, beside
        return made[kind]

    return of


def check(runs, kind: str, names: list[str]) -> list[SequenceGroup]:
    """The probes `names` have the alone run's bits in every run beside others; returns their groups of
    the first such run (the engine without a cache, beside 7)."""
    _, alone, beside = runs(kind)
    for where, answers, _ in beside:
        for name in names:
            assert_same_bits(alone[name], answers[name], where + name)
    return [beside[0][2][name] for name in names]


def hidden64(reference, ids: list[int], layers: int) -> list[np.ndarray]:
    """The float64 residual stream entering block 0 and leaving each block (the last before the final norm)."""
    kept = {}
    handle = reference.model.model.layers[-1].register_forward_hook(lambda m, i, o: kept.setdefault("x", o))
    try:
        with torch.inference_mode():
            out = reference.model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    last = kept["x"][0] if isinstance(kept["x"], tuple) else kept["x"]
    return [h[0].numpy() for h in out.hidden_states[:layers]] + [last[0].numpy()]


def close(got: np.ndarray, want: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=TOL * scale, rtol=0)


# ---- the tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FAMILIES)
def test_residual_stream_has_the_same_bits_beside_anything(kind, runs, reference_of):
    """The residual stream (residual_layers: entering block 0, leaving inner and last blocks) of a scored
    text starting with a prefix the mix shares, and of a seeded sampled generation (prompt and generated
    positions), with every other number of both answers: the alone run's bits beside 7 and 24 requests of
    every kind, on both engines; the values are the float64 forward's hidden states."""
    scored, generated = check(runs, kind, ["residual-scored", "residual-generated"])
    reference, layers = reference_of(runs(kind)[0]), scored.params.residual_layers[-1]
    for group in (scored, generated):
        seq = group.sequences[0]
        ids = group.prompt_ids + seq.token_ids
        want = hidden64(reference, ids, layers)
        assert sorted(seq.residual) == sorted(set(group.params.residual_layers))
        for layer, got in seq.residual.items():
            assert got.shape == (len(ids), reference.model.config.hidden_size) and got.dtype == np.float32
            close(got, want[layer])


@pytest.mark.parametrize("kind", FAMILIES)
def test_logit_lens_has_the_same_bits_beside_anything(kind, runs, reference_of):
    """The logit lens (lens_layers with lens_top_k: every position's log probability, rank and top-k under
    each layer's stream) of a greedy generation and of a scored text: the alone run's bits beside 7 and 24
    requests of every kind, on both engines; the last layer's lens is the float64 model's distribution."""
    generated, scored = check(runs, kind, ["lens", "lens-scored"])
    reference = reference_of(runs(kind)[0])
    for group in (generated, scored):
        seq = group.sequences[0]
        ids = group.prompt_ids + seq.token_ids
        last = seq.lens[max(seq.lens)]
        ref = reference.logprobs(ids).numpy()
        np.testing.assert_allclose(last.logprobs[1:], [ref[i][t] for i, t in enumerate(ids[1:])], atol=TOL)


@pytest.mark.parametrize("kind", FAMILIES)
def test_instruments_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """A seeded sampled generation (top-k, top-p) asking for every instrument: asked ids' raw and processed
    log probabilities and ranks, entropy and rank of each token, top-p sets (ids, values, counts, mass,
    cut), logprobs_mode "both" (processed numbers and top-k), at generated and prompt positions: the alone
    run's bits beside 7 and 24 requests of every kind, on both engines; the asked ids' raw log
    probabilities are the float64 forward's."""
    group, = check(runs, kind, ["instruments"])
    out = group.output().choices[0]
    assert out.extras.token_id_logprobs_processed is not None and out.processed_logprobs is not None
    ids = group.prompt_ids + group.sequences[0].token_ids
    ref = reference_of(runs(kind)[0]).logprobs(ids).numpy()[len(group.prompt_ids) - 1:-1]
    np.testing.assert_allclose(out.extras.token_id_logprobs, ref[:, [5, 9, 100, 101]], atol=TOL)


@pytest.mark.parametrize("kind", FAMILIES)
def test_steered_and_constrained_draws_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """Seeded sampled generations steered by a logit bias, by allowed ids (with a bias), by a regex and by a
    choice list (llguidance's masks, computed beside the decode pass): tokens, raw and processed numbers,
    the processed top-k's own ids and the allowed mass (constraint_logprobs): the alone run's bits beside 7
    and 24 requests of every kind, on both engines; raw log probabilities are the float64 forward's."""
    groups = check(runs, kind, ["biased", "allowed", "regex", "choice"])
    reference = reference_of(runs(kind)[0])
    regex, choice = groups[2].sequences[0].text.text, groups[3].sequences[0].text.text
    assert regex.isdigit() and 2 <= len(regex) <= 5 and choice in CHOICES
    assert set(groups[1].sequences[0].token_ids) <= set(range(1000, 1300)) | {2}
    for group in groups:
        seq = group.sequences[0]
        ref = reference.logprobs(group.prompt_ids + seq.token_ids).numpy()
        got = [ref[len(group.prompt_ids) - 1 + i][t] for i, t in enumerate(seq.token_ids)]
        np.testing.assert_allclose(seq.logprobs, got, atol=TOL)


@pytest.mark.parametrize("kind", FAMILIES)
def test_interventions_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """A seeded sampled generation with add (every position), scale (prompt positions), patch (another
    prompt's stream) and set (generated positions) interventions, asking for its prompt's numbers, its
    edited activations and lens, and return_unmodified (a pass without the edits); and a scored text with an
    intervention and return_unmodified, starting with a prefix the mix shares (an intervened prompt neither
    reads nor seeds the prefix cache): the alone run's bits beside 7 and 24 requests of every kind, on
    both engines; the unmodified numbers are the float64 forward's."""
    groups = check(runs, kind, ["intervened", "intervened-scored"])
    reference = reference_of(runs(kind)[0])
    for group in groups:
        seq = group.sequences[0]
        ids = group.prompt_ids + seq.token_ids
        ref = reference.logprobs(ids).numpy()
        np.testing.assert_allclose(seq.unmodified.logprobs[1:], [ref[i][t] for i, t in enumerate(ids[1:])], atol=TOL)
        assert np.abs(seq.unmodified.logprobs[1:len(group.prompt_ids)] - group.prompt_columns.logprobs[1:]).max() > 1e-3


@pytest.mark.parametrize("kind", FAMILIES)
def test_several_choices_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """n = 3 seeded sampled choices of one prompt (rows of one group, each with its own stream) and the
    prompt's numbers: the alone run's bits beside 7 and 24 requests of every kind, on both engines; each
    choice's log probabilities are the float64 forward's."""
    group, = check(runs, kind, ["n3"])
    reference = reference_of(runs(kind)[0])
    assert len({tuple(seq.token_ids) for seq in group.sequences}) > 1
    for seq in group.sequences:
        ref = reference.logprobs(group.prompt_ids + seq.token_ids).numpy()
        got = [ref[len(group.prompt_ids) - 1 + i][t] for i, t in enumerate(seq.token_ids)]
        np.testing.assert_allclose(seq.logprobs, got, atol=TOL)


@pytest.mark.parametrize("kind", FAMILIES)
def test_token_trees_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """A token tree (depth 3, 3 branches, its prompt starting with a prefix the mix shares, so the cached
    engine starts it after kept keys) and a steered one cut by branch_p, each a level per step in a pass of
    its own while the step's other passes run: every node's ids, parents, raw, processed and cumulative
    log probabilities, ranks, entropies, stop marks and the forward tokens counted: the alone run's bits
    beside 7 and 24 requests of every kind, on both engines; the nodes are the float64 forward's."""
    trees = check(runs, kind, ["tree", "tree-steered"])
    reference = reference_of(runs(kind)[0])
    for tree in trees:
        assert tree.num_nodes > tree.shape.branches
        for node in range(tree.num_nodes):
            lineage = tree.path(node)
            row = reference.logprobs(tree.prompt_ids + lineage[:-1]).numpy()[-1]
            assert abs(tree.logprobs[node] - row[lineage[-1]]) < TOL


@pytest.mark.parametrize("kind", FAMILIES)
def test_whole_vocabulary_columns_have_the_same_bits_beside_anything(kind, runs, reference_of):
    """A scored text with every prompt position's whole vocabulary and its ranks (prompt_logprobs -1: what
    /v1/compare reads of each model, its divergences a host computation over two such answers): the alone
    run's bits beside 7 and 24 requests of every kind, on both engines; the values are the float64
    forward's."""
    group, = check(runs, kind, ["full"])
    cols = group.prompt_columns
    assert cols.full is not None and cols.full_ranks is not None
    ref = reference_of(runs(kind)[0]).logprobs(group.prompt_ids).numpy()
    assert np.abs(cols.full[1:] - ref[:-1]).max() < TOL

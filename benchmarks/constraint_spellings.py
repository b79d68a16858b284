"""Which tokens a grammar's mask should allow where the grammar forces a text (docs/api.md, 2.6;
docs/performance.md, "Constrained decoding: the allowed set"). Two ways, each decoding greedily the same
prompts under regexes, JSON schemas and grammars:

* `tokenizer` (logprobe's, `GrammarState.sets` in engine/host/grammar.py): llguidance's own masks: where
  the grammar forces a text, only the first token of the tokenizer's spelling of that text (encoded on
  its own) may be drawn (every token the parser accepts where llguidance has no spelling of it yet);
* `parser`: every token the parser accepts may be drawn (`sets` patched to draw from the whole allowed
  set). Both report the same allowed mass (`constraint_logprobs`: the whole set).

Each produced text is then scored unconstrained, after the prompt, as `/v1/score` reads an input after a
context (the text encoded on its own, appended to the prompt's tokens): the model's own log probability
of the text. The way whose texts the model finds likelier is the better answer to "the likeliest text
inside the grammar" that greedy decoding approximates. Also printed: the log probability of the tokens
each way emitted (its path), which may differ from the text's where the emitted spelling is not the
tokenizer's.

    python benchmarks/constraint_spellings.py [--model smollm2-135m|gemma3-270m] [--max-tokens 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from logprobe.backend import Constraint, GenerationRequest, SamplingParams  # noqa: E402
from logprobe.engine.engine import Engine  # noqa: E402
from logprobe.engine.host import grammar  # noqa: E402
from logprobe.engine.runners import loader  # noqa: E402

NO_SPACE = {"x-guidance": {"whitespace_flexible": False}}
CASES = [  # (prompt, kind, source)
    ("The first moon landing, as an ISO date:", "regex", r"\d{4}-\d{2}-\d{2}"),
    ("Call the front desk at", "regex", r" \(\d{3}\) \d{3}-\d{4}"),
    ("The day after Monday is", "regex", " (Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"),
    ("The capitals of France and Italy are", "regex", " [A-Z][a-z]+ and [A-Z][a-z]+"),
    ("A person as JSON:", "json_schema", {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"], **NO_SPACE}),
    ("The colour of the sky as JSON:", "json_schema", {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"], **NO_SPACE}),
    ("A book as JSON:", "json_schema", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24}, "year": {"type": "integer"}},
        "required": ["title", "year"]}),
    ("Is the sky blue? Answer:", "grammar", 'start: " yes" | " no"'),
    ("What is 12 times 12?", "grammar", 'start: " The answer is " NUMBER "."\nNUMBER: /[0-9]+/'),
    ("A character sheet.\n", "grammar", 'start: "Name: " NAME "\\nAge: " AGE\nNAME: /[A-Z][a-z]+/\nAGE: /[0-9]+/'),
    ("A city as JSON:", "json_schema", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], **NO_SPACE}),
    ("Three fruits as a JSON array:", "json_schema", {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                     "minItems": 3, "maxItems": 3, **NO_SPACE}),
    ("The weather today, as JSON:", "json_schema", {"type": "object", "properties": {
        "temperature": {"type": "integer"}, "sky": {"enum": ["clear", "cloudy", "rainy"]}},
        "required": ["temperature", "sky"], **NO_SPACE}),
    ("Email the author at", "regex", r" [a-z]+@[a-z]+\.com"),
    ("The time now, as HH:MM:", "regex", r" \d{2}:\d{2}"),
    ('Translate "cat" to French.', "grammar", 'start: " French: " WORD "."\nWORD: /[a-z]+/'),
]


def constraint_of(kind: str, source) -> Constraint:
    return Constraint(kind, source if isinstance(source, str) else json.dumps(source, separators=(",", ":")))


def decode(engine, cases, max_tokens: int) -> list:
    requests = [GenerationRequest(f"c{i}", engine.tokenizer(prompt).input_ids,
                                  SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0,
                                                 stop_token_ids=engine.info.stop_token_ids,
                                                 constraint=constraint_of(kind, source)))
                for i, (prompt, kind, source) in enumerate(cases)]
    return requests, asyncio.run(engine.run(requests))


def text_logprobs(engine, prompts: list[list[int]], texts: list[str]) -> list[float]:
    """Each text's log probability after its prompt, unconstrained: its own encoding appended."""
    ids = [engine.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    requests = [GenerationRequest(f"s{i}", p + t, SamplingParams(max_tokens=0, echo=True, logprobs=0))
                for i, (p, t) in enumerate(zip(prompts, ids))]
    outs = asyncio.run(engine.run(requests))
    return [float(np.sum(o.prompt_columns.logprobs[len(p):], dtype=np.float64)) for o, p in zip(outs, prompts)]


def without_stop(engine, choice) -> tuple[str, list[int], np.ndarray]:
    """A choice's text, tokens and their log probabilities, less a final stop token."""
    ids, lps, text = list(choice.token_ids), np.asarray(choice.logprobs, dtype=np.float64), choice.text
    stops = {engine.info.eos_token_id} | set(engine.info.stop_token_ids)
    if choice.finish_reason == "stop" and ids and ids[-1] in stops:
        rendered = engine.table.text_bytes(ids[-1]).decode("utf-8", errors="replace")
        if rendered and text.endswith(rendered):
            text = text[:-len(rendered)]
        ids, lps = ids[:-1], lps[:-1]
    return text, ids, lps


def run_way(engine, way: str, max_tokens: int) -> list[dict]:
    original = grammar.GrammarState.sets
    if way == "parser":
        grammar.GrammarState.sets = lambda self: (self.allowed(), None)
    try:
        requests, outputs = decode(engine, CASES, max_tokens)
    finally:
        grammar.GrammarState.sets = original
    rows = []
    for request, out in zip(requests, outputs):
        text, ids, lps = without_stop(engine, out.choices[0])
        canonical = engine.tokenizer(text, add_special_tokens=False).input_ids
        rows.append({"text": text, "path": float(lps.sum()), "tokens": len(ids), "canonical": ids == canonical,
                     "finish": out.choices[0].finish_reason})
    scored = text_logprobs(engine, [r.prompt_ids for r in requests], [row["text"] for row in rows])
    for row, lp in zip(rows, scored):
        row["text_logprob"] = lp
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="smollm2-135m (default, the bundled model) or gemma3-270m")
    ap.add_argument("--max-tokens", type=int, default=40)
    args = ap.parse_args()
    source = loader.resolve_source(args.model)
    model, tok = loader.load(source)
    engine = Engine(model, tok, source.name, source.aliases, prefix_cache_mb=0)
    engine.start()
    try:
        ways = {way: run_way(engine, way, args.max_tokens) for way in ("tokenizer", "parser")}
    finally:
        engine.stop()
    print(f"{source.name}, greedy, max_tokens {args.max_tokens}, {len(CASES)} prompts")
    print(f"{'case':>4} {'way':>9} {'text logprob':>12} {'path logprob':>12} {'tokens':>6} {'canon':>5}  text")
    for i in range(len(CASES)):
        for way, rows in ways.items():
            row = rows[i]
            print(f"{i:>4} {way:>9} {row['text_logprob']:>12.3f} {row['path']:>12.3f} {row['tokens']:>6} "
                  f"{'yes' if row['canonical'] else 'no':>5}  {row['text']!r} ({row['finish']})")
    a = np.array([r["text_logprob"] for r in ways["tokenizer"]])
    b = np.array([r["text_logprob"] for r in ways["parser"]])
    differ = [i for i in range(len(CASES)) if ways["tokenizer"][i]["text"] != ways["parser"][i]["text"]]
    print(f"texts that differ: {len(differ)} of {len(CASES)}; summed text log probability: tokenizer {a.sum():.3f}, "
          f"parser {b.sum():.3f}; parser - tokenizer per case: {np.round(b - a, 3).tolist()}")
    print(f"parser's text likelier in {int((b > a + 1e-6).sum())}, tokenizer's in {int((a > b + 1e-6).sum())}, "
          f"equal in {int((np.abs(a - b) <= 1e-6).sum())}")


if __name__ == "__main__":
    main()

"""A mixed dataset for the dataset-scoring tests: short, long, empty and unicode texts, some with one of a
few shared contexts, written alike as JSON lines, CSV and Parquet."""

from __future__ import annotations

import csv
import json
import random

WORDS = ("the cat sat on a mat while seven quiet engineers measured every token of it twice "
         "because numbers must not move, and the river ran past old stone bridges").split()
UNICODE = ["naïve café ☕", "日本語のテキスト", "emoji 🙂🚀 and ZWJ 👩‍💻", "Ελληνικά και русский", "tab\there",
           "quote \"inside\", comma", "line\nbreak inside", "e\u0301 combining", "  leading and trailing  "]
CONTEXTS = ["Question: what is shown?\nAnswer:", "A story about a cat.", "Translate to French:"]


def mixed_rows(num: int = 300, long_words: int = 150, seed: int = 0) -> list[dict]:
    """Rows {"id", "text", "context"}: every 37th text empty, every 11th unicode, every 50th about
    `long_words` words, every third with one of three shared contexts."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        if i % 37 == 5:
            text = ""
        elif i % 11 == 3:
            text = UNICODE[(i // 11) % len(UNICODE)]
        elif i % 50 == 7:
            text = " ".join(rng.choice(WORDS) for _ in range(long_words))
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        context = CONTEXTS[(i // 3) % len(CONTEXTS)] if i % 3 == 0 else None
        rows.append({"id": f"row-{i:04d}", "text": text, "context": context})
    return rows


def write_all(rows: list[dict], directory) -> dict[str, str]:
    """The rows as data.jsonl, data.csv and data.parquet in `directory`: {"jsonl": path, ...}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {kind: str(directory / f"data.{kind}") for kind in ("jsonl", "csv", "parquet")}
    with open(paths["jsonl"], "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    with open(paths["csv"], "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["id", "text", "context"])
        for row in rows:
            writer.writerow([row["id"], row["text"], row["context"] or ""])
    pq.write_table(pa.table({name: [row[name] for row in rows] for name in ("id", "text", "context")}),
                   paths["parquet"])
    return paths

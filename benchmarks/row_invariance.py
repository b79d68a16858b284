"""Which of torch's CPU kernels give a row the same bits whatever else is in its call: the measurement
under the batch-invariance work (docs/performance.md). Not a timing: it prints, for each kernel the lean
runner calls, the classes of call shapes inside which one row's output is bit-for-bit the same.

- Products (`F.linear` in float32; oneDNN's float32 product, pre-packed and of the plain weight;
  oneDNN's pre-packed bfloat16 product; the 4-bit kernel of
  `--quantization int4`), at a model's weight shapes: one probe row at the first, middle and last place
  of calls of 1 to 1,024 rows, the other rows random.
- Attention in the decode layout (one query per row, `attend_rows`): one row beside n - 1 others over
  `read` positions, the positions past its own masked.
- Attention in the prompt layout (`attend_prompt`): the same queries of one sequence, attending over
  keys from position 0, computed in one call or split in chunks of queries (as chunked prefill does).
- Attention over reads: one query at a position, over every read of whole 64 positions that holds it;
  and whether the reads `Attention.aligned` makes fall in one class (the invariance rests on it).
- Last, what the runner measures and chooses on this machine as it starts (engine/runners/lean/row_floors.py):
  each weight's float32 product and its row floor, SDPA's query floor and short block of keys.

    python benchmarks/row_invariance.py [--threads 2] [--hidden 576 --heads 9 --kv-heads 3 --head-dim 64
                                         --intermediate 1536 --vocab 49152]

The defaults are SmolLM2-135M's shapes. One class per line means the kernel is row-invariant over the
row counts tried; several mean a row's bits depend on its call's size.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

COUNTS = list(range(1, 20)) + [24, 31, 32, 33, 48, 63, 64, 65, 100, 128, 200, 256, 300, 512, 600, 1024]


def classes(outputs: list[tuple[int, torch.Tensor]]) -> list[list[int]]:
    """Group the keys whose tensors are bit-for-bit equal."""
    found: list[tuple[torch.Tensor, list[int]]] = []
    for key, y in outputs:
        for ref, keys in found:
            if torch.equal(ref, y):
                if key not in keys:
                    keys.append(key)
                break
        else:
            found.append((y, [key]))
    return [keys for _, keys in found]


def show(name: str, groups: list[list[int]]) -> None:
    def span(keys):
        keys = sorted(keys)
        return f"{keys[0]}..{keys[-1]} ({len(keys)} sizes)" if len(keys) > 4 else ",".join(map(str, keys))
    verdict = "invariant" if len(groups) == 1 else f"{len(groups)} classes"
    print(f"{name:42s} {verdict:12s} " + " | ".join(span(g) for g in groups), flush=True)


def products(shapes: dict, gen: torch.Generator) -> None:
    from logprobe.engine.runners.int4 import GROUP, Grid, Int4Linear, available

    for name, (n, k) in shapes.items():
        w32 = torch.randn(n, k, generator=gen) * 0.05
        kinds = {"float32 F.linear": (lambda x, w=w32: F.linear(x, w), torch.float32)}
        if torch.backends.mkldnn.is_available():
            packed32 = torch.ops.mkldnn._reorder_linear_weight(w32)
            kinds["float32 packed (oneDNN)"] = (
                lambda x, p=packed32: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), torch.float32)
            kinds["float32 plain (oneDNN)"] = (
                lambda x, w=w32: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), torch.float32)
            packed = torch.ops.mkldnn._reorder_linear_weight(w32.bfloat16())
            kinds["bfloat16 packed (oneDNN)"] = (
                lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), torch.bfloat16)
        if available() and k % GROUP == 0:
            q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
            grid = Grid(q, torch.rand(n, k // GROUP, generator=gen) * 0.01, -torch.rand(n, k // GROUP, generator=gen) * 0.08)
            kinds["4-bit (int4 kernel)"] = (Int4Linear([grid]), torch.bfloat16)
        for kind, (f, dtype) in kinds.items():
            probe = torch.randn(1, k, generator=gen).to(dtype)
            outs = []
            for m in COUNTS:
                for place in sorted({0, m // 2, m - 1}):
                    x = torch.randn(m, k, generator=gen).to(dtype)
                    x[place] = probe[0]
                    outs.append((m, f(x)[place]))
            show(f"{kind} [{n}x{k}]", classes(outs))


def decode_attention(heads: int, kv_heads: int, d: int, gen: torch.Generator) -> None:
    group, length = heads // kv_heads, 40  # the probe row is at position 39
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, kv_heads, group, d, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, 1100, d, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, 1100, d, generator=gen).to(dtype)
        outs = []
        for n in (1, 2, 3, 4, 8, 16, 64):
            for read in (length, 64, 256, 600, 1100):
                qs = torch.randn(n, kv_heads, group, d, generator=gen).to(dtype)
                ks = torch.randn(n, kv_heads, read, d, generator=gen).to(dtype)
                vs = torch.randn(n, kv_heads, read, d, generator=gen).to(dtype)
                qs[0], ks[0, :, :length], vs[0, :, :length] = q[0], k[0, :, :length], v[0, :, :length]
                mask = torch.zeros(n, 1, 1, read, dtype=dtype)
                mask[0, ..., length:] = float("-inf")
                outs.append((n * 10_000 + read, F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0]))
        show(f"{dtype} SDPA decode (rows*10000+read)", classes(outs))


def prompt_attention(heads: int, kv_heads: int, d: int, gen: torch.Generator) -> None:
    length = 300
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, heads, length, d, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, length, d, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, length, d, generator=gen).to(dtype)
        outs = []
        for chunk in (length, 256, 128, 64, 32, 17, 1):
            parts = []
            for start in range(0, length, chunk):
                stop = min(length, start + chunk)
                mask = torch.ones(stop - start, stop, dtype=torch.bool).tril(start)
                parts.append(F.scaled_dot_product_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop],
                                                            attn_mask=mask, enable_gqa=heads != kv_heads))
            outs.append((chunk, torch.cat(parts, dim=2)))
        show(f"{dtype} SDPA prompt (query chunk size)", classes(outs))


def read_attention(heads: int, kv_heads: int, d: int, gen: torch.Generator) -> None:
    """One query at position p over reads of every multiple of 64 positions that holds it (the keys past p
    masked): the classes of reads giving the same bits, then whether the reads `Attention.aligned` makes
    all fall in one class."""
    from logprobe.engine.runners.lean.attention import Attention

    att = Attention([None], d ** -0.5, heads, kv_heads, torch.float32, torch.device("cpu"))
    longest = 1280
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(1, heads, longest, d, generator=gen).to(dtype)
        k = torch.randn(1, kv_heads, longest, d, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, longest, d, generator=gen).to(dtype)
        for p in (40, 200, 300, 450, 700, 1100):
            outs = []
            for read in range(64 * (p // 64 + 1), longest + 1, 64):
                mask = torch.zeros(1, read, dtype=dtype).masked_fill_(torch.arange(read)[None] > p, float("-inf"))
                outs.append((read, F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :read], v[:, :, :read],
                                                                  attn_mask=mask, enable_gqa=heads != kv_heads)))
            groups = classes(outs)
            aligned = {att.aligned(n) for n in range(p + 1, longest + 1)}
            together = any(aligned <= set(g) for g in groups)
            show(f"{dtype} SDPA query at {p} (reads); Attention.aligned's reads in one class: {together}", groups)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    h, d = args.hidden, args.head_dim
    shapes = {"qkv": ((args.heads + 2 * args.kv_heads) * d, h), "o_proj": (h, args.heads * d),
              "gate_up": (2 * args.intermediate, h), "down": (h, args.intermediate), "head": (args.vocab, h)}
    print(f"torch {torch.__version__}, {args.threads} threads, {torch.backends.cpu.get_cpu_capability()}")
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        products(shapes, gen)
        decode_attention(args.heads, args.kv_heads, d, gen)
        prompt_attention(args.heads, args.kv_heads, d, gen)
        read_attention(args.heads, args.kv_heads, d, gen)
    from logprobe.engine.runners.lean import row_floors

    threads = torch.get_num_threads()
    for name, (n, k) in shapes.items():
        onednn, floor = row_floors.product_for(n, k, threads)
        print(f"the runner's float32 product [{n}x{k}] ({name}): {'oneDNN' if onednn else 'F.linear'}, "
              f"calls padded to {floor} rows at least")
    for dtype in (torch.float32, torch.bfloat16):
        print(f"SDPA {dtype}, head size {d}: query floor {row_floors.query_floor(d, dtype, threads)}, "
              f"short block {row_floors.short_block(d, dtype, threads)}")


if __name__ == "__main__":
    main()

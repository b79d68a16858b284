"""How many rows this machine's CPU kernels need before a row's bits stop depending on the call: the
measurement the lean runner's batch invariance rests on where the kernels differ by CPU.

A float32 product gives a row other bits in a call of 1 row, or of 2-3, than in a call of 4 or more on
some CPUs: MKL's `sgemm`, which `F.linear` and SDPA's CPU kernel call, takes other paths for those row
counts on an AMD EPYC even in its strict reproducibility mode (on an Intel Xeon under that mode every
row count gives the same bits). oneDNN's float32 product (`torch.ops.mkldnn._linear_pointwise` of the
plain weight, no repacked copy) gives one class from 2 rows on there, and runs faster than MKL there
at every row count. So the runner measures, once per process and per shape (0.4-0.7 s in all for
SmolLM2 with 2 threads, most of it the head):

- **products** (`product_for(n, k)`): the row floor of `F.linear` and of oneDNN's product for a weight
  [n, k], the fewest rows from which a probe row has the same bits in calls of every row count probed
  (1 to 130; the row first, in the middle and last). `F.linear` is taken where its floor is 1;
  otherwise the one with the lower floor (oneDNN where they tie). `Linear` pads a call of fewer rows
  than the floor with rows of zeros;
- **attention's query floor** (`query_floor(d, dtype)`): the fewest queries a block of SDPA's CPU
  kernel needs for a query's bits not to depend on the others (`Attention` pads a call's queries so
  that every block of the kernel's query split holds that many: `padded_queries`). For bfloat16, at
  least the float32 floor: the kernel sums in float32 whatever its inputs, and rounding its output to
  bfloat16 hides most of its other paths from a short probe, not all (a decode query of SmolLM2's
  shape at position 253 came out otherwise alone than among 4 on an AMD EPYC);
- **attention's short block** (`short_block(d, dtype)`): the longest last block of keys that gives a
  query the bits of a whole block of 512 (`Attention.aligned` reads on to 512 past it); for bfloat16
  at most the float32 one, as above.

The probes are deterministic (the same machine, torch and thread count choose the same), so a server
restarted on the same machine gives the same bits. `python benchmarks/row_invariance.py` prints the
classes in full and what the runner chooses; docs/performance.md ("The same bits beside other
requests") has what was measured.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("logprobe.engine")

PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 64, 65, 130)
PROBE_WIDTH = 8192  # a weight's rows probed at most (the head's vocabulary): the kernels split wider ones alike


def _classes(product, k: int, counts, dtype, gen: torch.Generator) -> list[tuple[int, torch.Tensor]]:
    """A probe row's output in calls of each count of rows, the row first, in the middle and last."""
    probe = torch.randn(k, generator=gen).to(dtype)
    outputs = []
    for rows in counts:
        for place in sorted({0, rows // 2, rows - 1}):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            x[place] = probe
            outputs.append((rows, product(x)[place]))
    return outputs


def _floor(outputs: list[tuple[int, torch.Tensor]]) -> int | None:
    """The fewest rows from which every probed call gives the probe row the same bits; None where even
    the largest count's calls disagree."""
    largest = outputs[-1][0]
    want = next(out for rows, out in outputs if rows == largest)
    floor = None
    for rows, out in reversed(outputs):
        if not torch.equal(out, want):
            break
        floor = rows
    return floor


def onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product of x [..., k] by the plain weight [n, k] (no packed copy is kept)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def product_for(n: int, k: int, threads: int | None = None) -> tuple[bool, int]:
    """(whether oneDNN's product is taken, the row floor: calls of fewer rows are padded to it) for a
    float32 weight [n, k] on this CPU (`threads`: torch's, part of the cache's key; module docstring).
    Where neither product has a floor, `F.linear` with none (and a warning: rows may move)."""
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(min(n, PROBE_WIDTH), k, generator=gen) * 0.05
    with torch.inference_mode():
        plain = _floor(_classes(lambda x: F.linear(x, w), k, PROBE_ROWS, torch.float32, gen))
        if plain == 1:
            return False, 1
        onednn = None
        if torch.backends.mkldnn.is_available():
            try:
                onednn = _floor(_classes(lambda x: onednn_product(x, w, None), k, PROBE_ROWS, torch.float32, gen))
            except Exception:  # no float32 product of a plain weight in this build of torch's oneDNN
                pass
    if onednn is not None and (plain is None or onednn <= plain):
        return True, onednn
    if plain is None:
        log.warning("float32 products of a [%d x %d] weight give a row other bits with the rows beside it on "
                    "this CPU (docs/performance.md)", n, k)
        return False, 1
    return False, plain


@functools.cache
def packed_floor(n: int, k: int, dtype: torch.dtype, threads: int | None = None) -> int:
    """The fewest rows a call of oneDNN's pre-packed product (bfloat16 on a CPU) of a weight [n, k] needs
    for a row's bits not to depend on the call: 1 where each probe row has the same bits alone as in a
    call of 2, else 2 (`Linear` pads a call of 1 row). On an AMD EPYC SmolLM2's `down_proj` [576 x 1536]
    gives 9% of random rows other bits alone, its projections of 576 columns and its head none of 2,048
    (the kernel's one-row path differs by shape). Probed on a random weight of min(n, PROBE_WIDTH) rows
    and on about a quarter of a million outputs (a shape whose one-row path differs shows it in most rows: the
    probe stops at the first), once per shape, dtype and thread count (`threads`: the cache's key)."""
    gen = torch.Generator().manual_seed(n * 7919 + k + 1)
    width = min(n, PROBE_WIDTH)
    packed = torch.ops.mkldnn._reorder_linear_weight((torch.randn(width, k, generator=gen) * 0.05).to(dtype))
    rows = min(256, max(32, 2**18 // width)) & ~1  # in pairs
    x = torch.randn(rows, k, generator=gen).to(dtype)

    def product(rows_x):
        return torch.ops.mkldnn._linear_pointwise(rows_x, packed, None, "none", [], "")

    with torch.inference_mode():
        for i in range(0, rows, 2):
            pair = product(x[i:i + 2])
            if not (torch.equal(product(x[i:i + 1])[0], pair[0]) and torch.equal(product(x[i + 1:i + 2])[0], pair[1])):
                return 2
    return 1


@functools.cache
def query_floor(d: int, dtype: torch.dtype, threads: int | None = None) -> int:
    """The fewest query rows a block of SDPA's CPU kernel needs for a query's bits not to depend on the
    others in it: 1 where every count gives the same bits; 4 for SmolLM2's head size on an AMD EPYC,
    whose products take the rows of a call of 1 and of 2-3 other ways. Probed in calls of up to 32
    queries (one block of the kernel's split: `query_split`), one key/value head of 64 keys."""
    gen = torch.Generator().manual_seed(d)
    keys, values = (torch.randn(1, 1, 64, d, generator=gen).to(dtype) for _ in range(2))

    def attend(q):
        return F.scaled_dot_product_attention(q[None, None], keys, values)[0, 0]

    with torch.inference_mode():
        floor = _floor(_classes(attend, d, range(1, 33), dtype, gen))
    if floor is None:
        log.warning("SDPA's CPU kernel gives a query other bits with the queries beside it on this CPU "
                    "(head size %d, %s; docs/performance.md)", d, dtype)
        floor = 1
    if dtype != torch.float32:  # the kernel sums in float32 either way: its float32 floor holds too
        floor = max(floor, query_floor(d, torch.float32, threads))
    return floor


def query_split(length: int) -> int:
    """The rows of each query block SDPA's CPU flash kernel splits `length` queries into (torch's
    `q_split_size`: 256 from 768 queries, 64 from 192, else 32; all of them where fewer)."""
    split = 256 if length >= 768 else 64 if length >= 192 else 32
    return min(split, length)


def padded_queries(length: int, floor: int) -> int:
    """The fewest queries, `length` or more, whose every block of the kernel's split holds `floor` rows
    at least (the last one included): the queries past `length` are padding."""
    if floor <= 1:
        return length
    padded = max(length, floor)
    while 0 < padded % query_split(padded) < floor:
        padded += 1
    return padded


@functools.cache
def short_block(d: int, dtype: torch.dtype, threads: int | None = None, longest: int = 256) -> int:
    """The longest last block of keys (a multiple of 64, `longest` at most) over which a query's output
    of SDPA's CPU kernel has the bits it has over a block of 512 (the kernel's key split), the keys past
    its position masked, in calls of the kernel's query floor and of 32 queries: 256 on an Intel Xeon
    (a block of 257-511 keys is split at a point that moves with its length), 192 on an AMD EPYC (where
    blocks of 256 and 320 are split too, in calls of 4 queries or more). `Attention.aligned` reads on
    to the next 512 past it."""
    gen = torch.Generator().manual_seed(d + 1)
    keys, values = (torch.randn(1, 1, 512, d, generator=gen).to(dtype) for _ in range(2))
    floor = query_floor(d, dtype, threads)
    with torch.inference_mode():
        for rows in sorted({floor, 32}):
            q = torch.randn(1, 1, rows, d, generator=gen).to(dtype)
            for block in range(64, longest + 1, 64):
                for p in sorted({block // 2 + 1, block - 33, block - 1}):
                    outs = []
                    for read in (block, 512):
                        mask = torch.zeros(rows, read, dtype=dtype).masked_fill_(torch.arange(read)[None] > p, float("-inf"))
                        outs.append(F.scaled_dot_product_attention(q, keys[:, :, :read], values[:, :, :read],
                                                                   attn_mask=mask)[0, 0, 0])
                    if not torch.equal(*outs):
                        longest = block - 64
                        break
    if dtype != torch.float32:  # as in query_floor: the float32 probe's shorter block holds too
        longest = min(longest, short_block(d, torch.float32, threads, longest))
    return max(longest, 64)

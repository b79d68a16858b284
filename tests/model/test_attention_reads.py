"""The property the lean runner's batch invariance rests on, checked on torch's own attention kernel: a
query's output has the same bits however many key positions its call reads (`Attention.aligned` of any
length that holds its keys, the positions past its own masked or never seen), whichever form the call
takes (a prompt's queries under a mask or plain causal, a chunk of them, one decode row among others),
in float32 (the dtype the same bits are promised in), for SmolLM2's and Gemma 3's attention shapes and
a tiny test model's.

A read of any multiple of 64 is not enough: a key block of 257-511 keys gives other bits than one of
512 (on an AMD EPYC, in calls of 4 queries or more, blocks of 256 and 320 keys too), which is why
`aligned` reads on to the next 512 where the last block would be longer than the short block this CPU's
kernel allows (row_floors.short_block: 256 on an Intel Xeon, 192 on an AMD EPYC). There too a call of 1
or of 2-3 queries gives other bits than one of 4 or more, so `Attention` pads a call's queries to the
kernel's floor (row_floors.query_floor). benchmarks/row_invariance.py shows the classes. The property
is torch's kernel's, not logprobe's: it holds on torch 2.13 and 2.15 (measured), not on 2.6 (other bits
for reads of 512 and for the decode layout), so these tests run from `Attention.INVARIANT_TORCH` on;
below it the engine warns at start (docs/performance.md). In bfloat16 too (not yet promised the same
bits as a whole: docs/performance.md), with the float32 probes' query floor and short block, since
rounding to bfloat16 hides most of the kernel's other paths from a short probe; with 1 thread and with
2, whose paths differ (a read of 16 keys at head size 256, with 2 threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from logprobe.engine.runners.lean.attention import Attention

LENGTH = 1300
pytestmark = pytest.mark.skipif(not Attention.invariant_kernels(), reason=(
    f"torch {torch.__version__}: SDPA's CPU kernel gives a query other bits at other reads below torch "
    f"{'.'.join(map(str, Attention.INVARIANT_TORCH))} (module docstring)"))
SHAPES = {"smollm2": (3, 3, 64), "gemma3": (1, 4, 256), "tiny": (2, 2, 16)}  # (KV heads, query heads each, d)


def setup(shape, dtype, windows=(None,)):
    kv, group, d = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, LENGTH, d, generator=gen).to(dtype) for n in (kv * group, kv, kv))
    return Attention(list(windows), d ** -0.5, kv * group, kv, dtype, torch.device("cpu"), head_dim=d), q, k, v


def padded(t: torch.Tensor, read: int) -> torch.Tensor:
    """Keys or values [KV, LENGTH, d] as a buffer read to `read` positions: zeros past those held."""
    return F.pad(t[:, :min(read, LENGTH)], (0, 0, 0, max(0, read - LENGTH)))[None]


def prompt_form(att, q, k, v, start, stop, read, causal=False):
    """Queries start..stop-1 over keys 0..read-1: masked (`prompt_masks`), or plain causal from 0 (`own_pass`)."""
    if causal:
        masks, read = att.own_pass(stop)
        mask = masks[None]
    else:
        mask = att.prompt_masks(torch.arange(start, stop), read)[None]
    return att.sdpa(q[None, :, start:stop], padded(k, read), padded(v, read), mask)[0]


def decode_form(att, q, k, v, positions, read):
    """One query per row at `positions`, every row over the same read of its slab (`decode_views`)."""
    n, (kv, group, d) = len(positions), (att.kv_heads, att.group, q.shape[-1])
    where = torch.tensor(positions)
    _, mask = att.decode_views(where, read)[None]
    queries = torch.stack([q[:, p].reshape(kv, group, d) for p in positions])
    out = att.attend_decode(queries, padded(k, read).expand(n, -1, -1, -1), padded(v, read).expand(n, -1, -1, -1), mask)
    return out.reshape(n, att.num_heads, d)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The kernel's paths depend on torch's thread count: the suite's (1) and a server's on 2 vCPUs."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_query_has_the_same_bits_at_every_read_and_in_every_form(shape, dtype, threads):
    att, q, k, v = setup(shape, dtype)
    reads = sorted({att.aligned(n) for n in range(1, LENGTH + 1)})
    assert att.short_block in (64, 128, 192, 256)  # measured on this CPU (row_floors.short_block)
    short = list(range(64, att.short_block + 1, 64))
    assert reads[:len(short) + 1] == [*short, 512] and reads[len(short) + 1:len(short) + 4] == [576, 640, 704]
    assert all(r % 512 <= att.short_block for r in reads)
    whole = prompt_form(att, q, k, v, 0, LENGTH, att.aligned(LENGTH))  # every query, the longest read
    positions = list(range(0, LENGTH, 23)) + [255, 256, 511, 512, 767, 1023, 1024, LENGTH - 1]
    for p in positions:
        want = whole[:, p]
        for read in (r for r in reads if r > p):
            assert torch.equal(decode_form(att, q, k, v, [p], read)[0], want), (p, read, "decode row")
        assert torch.equal(prompt_form(att, q, k, v, 0, p + 1, 0, causal=True)[:, p], want), (p, "causal")
    beside = decode_form(att, q, k, v, positions, att.aligned(LENGTH))
    for i, p in enumerate(positions):
        assert torch.equal(beside[i], whole[:, p]), (p, "decode rows together")
    for capacity in (4, 16, 100, 256, 300, 1000):  # a KV cache class's read cut at its end (Attention.held)
        read = att.held(capacity)
        assert capacity <= read <= att.aligned(capacity)
        for p in {0, capacity // 2, capacity - 1}:
            assert torch.equal(decode_form(att, q, k, v, [p], read)[0], whole[:, p]), (p, read, "class read")
    # chunks of every size, those whose last block of the kernel's query split holds 1-3 queries included
    for start, stop in [(0, 40), (40, 100), (200, 300), (250, 290), (500, 700), (700, 1000), (1000, 1100),
                        (1290, 1300), (0, 1), (5, 7), (30, 33), (0, 33), (64, 65), (100, 293), (0, 769)]:
        for read in (att.aligned(stop), att.aligned(LENGTH)):
            got = prompt_form(att, q, k, v, start, stop, read)
            assert torch.equal(got, whole[:, start:stop]), (start, stop, read, "chunk")


def test_sliding_windows_too():
    att, q, k, v = setup("gemma3", torch.float32, windows=(None, 12))
    whole = prompt_form(att, q, k, v, 0, 700, att.aligned(700))
    for start, stop in [(0, 30), (30, 300), (300, 700)]:
        masks = att.prompt_masks(torch.arange(start, stop), att.aligned(stop))
        got = att.sdpa(q[None, :, start:stop], padded(k, att.aligned(stop)), padded(v, att.aligned(stop)), masks[12])[0]
        masks_all = att.prompt_masks(torch.arange(0, 700), att.aligned(700))
        want = att.sdpa(q[None, :, :700], padded(k, att.aligned(700)), padded(v, att.aligned(700)), masks_all[12])[0]
        assert torch.equal(got, want[:, start:stop])
        assert torch.equal(prompt_form(att, q, k, v, start, stop, att.aligned(stop)), whole[:, start:stop])
    masks, read = att.own_pass(300)
    got = att.sdpa(q[None, :, :300], padded(k, read), padded(v, read), masks[12])[0]
    assert torch.equal(got, want[:, :300])


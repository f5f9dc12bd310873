"""The paged attention kernels (moestream.kernels.triton_paged_attention) under Triton's CPU
interpreter (TRITON_INTERPRET=1), at tiny sizes: decode and prefill agree with the torch reference
(tests/paged_attention_reference.py) over shuffled physical blocks, several sequences, windows,
sinks, soft-caps, GQA groups of 1, 2 and 8 and head sizes that are not powers of two; a row's bits
never depend on the other rows of the call or on its place among them; store_kv writes exactly the
rows' slots.

Unless this process was started with TRITON_INTERPRET=1, a single test runs this file again in a
child process that is. Float32 is checked tightly; bfloat16 only loosely, because the interpreter
truncates float32 -> bfloat16 where the GPU rounds to nearest (tests/gpu checks bf16 and fp16)."""

import pytest
import torch

pytest.importorskip("triton")

from interpret import gen, interpreted_module, randn, relative_error, run_file_interpreted  # noqa: E402
from paged_attention_reference import paged_cache, reference_paged_attention, reference_store_kv  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # max |y - ref| / max |ref|
SMALL_SPLITS = {"min_chunk": 32, "max_splits": 3}  # several splits per row at these lengths


def test_paged_attention_kernels_under_the_interpreter():
    run_file_interpreted(__file__)


@pytest.fixture(scope="module")
def pa():
    return interpreted_module("moestream.kernels.triton_paged_attention")


def case(seed, *, G, Nkv=1, D=40, Dv=24, BS=16, seqs=(70, 33, 100), dtype=torch.float32):
    """(q [T, Nq, D], k_cache, v_cache, block_table, positions, seq_of_row, sinks [Nq]) with rows of
    every sequence at various positions (first, last, middle)."""
    g = gen(seed)
    k_cache, v_cache, table = paged_cache(g, seqs=list(seqs), BS=BS, Nkv=Nkv, D=D, Dv=Dv, dtype=dtype)
    rows = [(0, seqs[0] - 1), (1, 0), (2, seqs[2] - 1), (1, seqs[1] - 1), (2, seqs[2] // 2), (0, 17)]
    seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows], dtype=torch.int32)
    q = randn(len(rows), G * Nkv, D, g=g, dtype=dtype)
    sinks = randn(G * Nkv, g=g)
    return q, k_cache, v_cache, table, pos, seq, sinks


OPTIONS = {"plain": {}, "window-short": {"window": 20}, "window-long": {"window": 500}, "sinks": {"sinks": True},
           "softcap": {"softcap": 1.5}, "all": {"window": 9, "sinks": True, "softcap": 2.0}}


def options(name, sinks):
    opts = dict(OPTIONS[name])
    if opts.pop("sinks", False):
        opts["sinks"] = sinks
    return opts


# -- against the reference ------------------------------------------------------------------------

SHAPES = {"mha-d40": (1, 2, 40, 24, 16), "g2-d64-bs8": (2, 2, 64, 64, 8), "g8-d48-dv80-bs64": (8, 1, 48, 80, 64)}
DECODE_CASES = [("mha-d40", o) for o in OPTIONS] + [("g2-d64-bs8", o) for o in ("plain", "all")] + \
    [("g8-d48-dv80-bs64", o) for o in ("plain", "window-short", "sinks", "all")]
PREFILL_CASES = [("mha-d40", o) for o in OPTIONS] + [("g8-d48-dv80-bs64", o) for o in ("plain", "all")]


@pytest.mark.parametrize("shape,opts", DECODE_CASES)
def test_decode_matches_the_reference(pa, shape, opts):
    G, Nkv, D, Dv, BS = SHAPES[shape]
    q, k_cache, v_cache, table, pos, seq, sinks = case(G * D + BS, G=G, Nkv=Nkv, D=D, Dv=Dv, BS=BS)
    kw = options(opts, sinks)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.3, out_rows=8, **kw)
    for splits in (SMALL_SPLITS, {}):
        out = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.3, out_rows=8, **kw, **splits)
        assert out.shape == (8, G * Nkv * Dv) and out.dtype == q.dtype
        assert relative_error(out, ref) < TOL[torch.float32]
        assert not out[q.shape[0]:].any()


@pytest.mark.parametrize("shape,opts", PREFILL_CASES)
def test_prefill_matches_the_reference(pa, shape, opts):
    """A prompt chunk of one sequence (consecutive positions) with rows of two others among it."""
    G, Nkv, D, Dv, BS = SHAPES[shape]
    q, k_cache, v_cache, table, _, _, sinks = case(G * D + BS + 1, G=G, Nkv=Nkv, D=D, Dv=Dv, BS=BS)
    seq = torch.tensor([2] * 12 + [0, 1] + [2] * 9)
    pos = torch.cat([torch.arange(60, 72), torch.tensor([69, 32]), torch.arange(72, 81)])
    q = randn(seq.numel(), G * Nkv, D, g=gen(3))
    kw = options(opts, sinks)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.25, out_rows=27, **kw)
    out = pa.paged_prefill(q, k_cache, v_cache, table, pos, seq, scale=0.25, out_rows=27, **kw)
    assert out.shape == (27, G * Nkv * Dv)
    assert relative_error(out, ref) < TOL[torch.float32]
    assert not out[seq.numel():].any()


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_bf16_matches_the_reference(pa, kernel):
    q, k_cache, v_cache, table, pos, seq, sinks = case(5, G=2, Nkv=2, D=64, Dv=64, dtype=torch.bfloat16)
    fn = pa.paged_attention if kernel == "decode" else pa.paged_prefill
    for kw in ({}, {"window": 12, "sinks": sinks, "softcap": 3.0}):
        out = fn(q, k_cache, v_cache, table, pos, seq, scale=0.125, **kw)
        ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.125, **kw)
        assert out.dtype == torch.bfloat16
        assert relative_error(out, ref) < TOL[torch.bfloat16]


def test_strided_rows_and_values_inside_the_key_cache(pa):
    """q as a strided view of a wider projection, v_cache a view of the first Dv features of k_cache
    (latent attention keeps one cache), int64 positions: the same as the reference."""
    q, k_cache, _, table, pos, seq, _ = case(7, G=4, Nkv=1, D=72, Dv=8)
    wide = torch.zeros(q.shape[0], q.shape[1], 80)
    wide[:, :, 8:] = q
    q = wide[:, :, 8:]
    v_cache = k_cache[..., :56]
    pos = pos.to(torch.int64)
    for fn in (pa.paged_attention, pa.paged_prefill):
        out = fn(q, k_cache, v_cache, table, pos, seq, scale=0.2, window=30)
        ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.2, window=30)
        assert relative_error(out, ref) < TOL[torch.float32]


# -- row independence -----------------------------------------------------------------------------

@pytest.mark.parametrize("splits", [SMALL_SPLITS, {}], ids=["small-splits", "default"])
def test_a_decode_rows_bits_do_not_depend_on_the_other_rows(pa, splits):
    """Each row alone, all rows, the rows in reverse and in a shuffled order with some repeated:
    every row's output has the same bits."""
    q, k_cache, v_cache, table, pos, seq, sinks = case(11, G=2, Nkv=2, D=40, Dv=24)
    kw = {"scale": 0.3, "window": 40, "sinks": sinks, **splits}
    every = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, **kw)
    T = q.shape[0]
    for t in range(T):
        alone = pa.paged_attention(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1], seq[t:t + 1], **kw)
        assert torch.equal(alone[0], every[t]), t
    for order in (torch.arange(T - 1, -1, -1), torch.tensor([3, 0, 5, 3, 1, 2, 4, 0])):
        got = pa.paged_attention(q[order], k_cache, v_cache, table, pos[order], seq[order], out_rows=16, **kw)
        assert torch.equal(got[:order.numel()], every[order])


def test_drafted_rows_of_one_sequence_get_the_bits_of_single_steps(pa):
    """Consecutive positions of one sequence (a step verifying drafted tokens) in one call: rows whose
    split sizes differ (the span crosses a size) share a program; each row has the bits of its own step."""
    q, k_cache, v_cache, table, _, _, sinks = case(17, G=2, Nkv=2, D=40, Dv=24)
    pos = torch.arange(60, 76)
    seq = torch.full((16,), 2)
    q = randn(16, 4, 40, g=gen(18))
    kw = {"scale": 0.3, "sinks": sinks, **SMALL_SPLITS}
    every = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, **kw)
    assert relative_error(every, reference_paged_attention(q, k_cache, v_cache, table, pos, seq, scale=0.3,
                                                           sinks=sinks)) < TOL[torch.float32]
    for t in (0, 3, 4, 15):
        alone = pa.paged_attention(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1], seq[t:t + 1], **kw)
        assert torch.equal(alone[0], every[t]), t


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_slots_no_row_sees_are_never_used(pa, kernel):
    """Rows of one sequence whose windows do not meet share a program; every slot of the pool that no
    row may see (between their windows, past the sequences, spare blocks) is NaN: the same bits."""
    q, k_cache, v_cache, table, _, _, sinks = case(19, G=2, Nkv=2, D=40, Dv=24, BS=8)
    seq = torch.tensor([2, 2, 0, 2])
    pos = torch.tensor([20, 90, 69, 99])
    window = 6
    fn = pa.paged_attention if kernel == "decode" else pa.paged_prefill
    kw = {"scale": 0.3, "window": window, "sinks": sinks}
    clean = fn(q[:4], k_cache, v_cache, table, pos, seq, **kw)
    visible = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for s, p in zip(seq.tolist(), pos.tolist()):
        for n in range(p - window + 1, p + 1):
            visible[table[s, n // 8], n % 8] = True
    k_nan, v_nan = k_cache.clone(), v_cache.clone()
    k_nan[~visible] = float("nan")
    v_nan[~visible] = float("nan")
    assert torch.equal(fn(q[:4], k_nan, v_nan, table, pos, seq, **kw), clean)
    assert clean.isfinite().all()


def test_a_prefill_rows_bits_do_not_depend_on_the_other_rows_of_its_tile(pa):
    """A prefill row gets the same bits alone, among others (other sequences, positions, queries, in
    any order) and at any place in its tile."""
    q, k_cache, v_cache, table, _, _, sinks = case(13, G=8, Nkv=1, D=48, Dv=80, BS=64)
    assert pa.prefill_tile(torch.float32, 8, 48, 80).block_r > 1  # several rows share a tile here
    seq = torch.tensor([2] * 6 + [0, 1, 2])
    pos = torch.tensor([40, 41, 42, 43, 44, 45, 69, 32, 99])
    q = randn(seq.numel(), 8, 48, g=gen(14))
    kw = {"scale": 0.3, "softcap": 2.5, "sinks": sinks}
    every = pa.paged_prefill(q, k_cache, v_cache, table, pos, seq, **kw)
    g = gen(15)
    for t in range(seq.numel()):
        others = torch.randperm(seq.numel(), generator=g)
        others = others[others != t][:seq.numel() - 1]
        order = torch.cat([others[:t], torch.tensor([t]), others[t:]])
        q2 = q[order] + (torch.arange(seq.numel()) != t).float()[:, None, None]  # the other rows' queries changed
        got = pa.paged_prefill(q2, k_cache, v_cache, table, pos[order], seq[order], **kw)
        assert torch.equal(got[t], every[t]), t
        alone = pa.paged_prefill(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1], seq[t:t + 1], **kw)
        assert torch.equal(alone[0], every[t]), t
    shuffled = torch.randperm(seq.numel(), generator=g)
    assert torch.equal(pa.paged_prefill(q[shuffled], k_cache, v_cache, table, pos[shuffled], seq[shuffled], **kw),
                       every[shuffled])


# -- the cache write --------------------------------------------------------------------------------

def test_store_kv_writes_the_rows_slots_only(pa):
    """store_kv against the reference's writes, nothing else changed; a row past the table is dropped;
    then a prefill over what was written matches the reference."""
    g = gen(21)
    Nkv, D, Dv, BS = 2, 40, 24, 8
    k_cache, v_cache, table = paged_cache(g, seqs=[30, 20], BS=BS, Nkv=Nkv, D=D, Dv=Dv, dtype=torch.float32)
    seq = torch.tensor([1, 1, 1, 0, 0])
    pos = torch.tensor([17, 18, 19, 0, 29])
    kv = randn(5, Nkv, 128, g=g)
    k, v = kv[:, :, :D], kv[:, :, 64:64 + Dv]  # strided views of one projection
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference_store_kv(k, v, pos, seq, table, ref_k, ref_v)
    pa.store_kv(k, v, pos, seq, table, k_cache, v_cache)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    pa.store_kv(k[:1], v[:1], torch.tensor([table.shape[1] * BS]), seq[:1], table, k_cache, v_cache)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    q = randn(5, 4, D, g=g)
    out = pa.paged_prefill(q, k_cache, v_cache, table, pos, seq, scale=0.2)
    assert relative_error(out, reference_paged_attention(q, ref_k, ref_v, table, pos, seq, scale=0.2)) < 1e-5


def test_bad_arguments_are_refused(pa):
    q, k_cache, v_cache, table, pos, seq, sinks = case(1, G=2, Nkv=2)
    args = (k_cache, v_cache, table, pos, seq)
    with pytest.raises(ValueError, match="kv heads"):
        pa.paged_attention(q[:, :3], *args, scale=1.0)
    with pytest.raises(ValueError, match="block_table"):
        pa.paged_attention(q, k_cache, v_cache, table.long(), pos, seq, scale=1.0)
    with pytest.raises(ValueError, match="positions"):
        pa.paged_prefill(q, k_cache, v_cache, table, pos[:2], seq, scale=1.0)
    with pytest.raises(ValueError, match="window"):
        pa.paged_attention(q, *args, scale=1.0, window=0)
    with pytest.raises(ValueError, match="sinks"):
        pa.paged_attention(q, *args, scale=1.0, sinks=sinks[:2])
    with pytest.raises(ValueError, match="out_rows"):
        pa.paged_prefill(q, *args, scale=1.0, out_rows=2)
    with pytest.raises(ValueError, match="k_cache"):
        pa.paged_attention(q, k_cache.double(), v_cache, table, pos, seq, scale=1.0)
    with pytest.raises(ValueError, match="min_chunk"):
        pa.paged_attention(q, *args, scale=1.0, min_chunk=48)
    with pytest.raises(ValueError, match="expected"):
        pa.store_kv(q, q, pos, seq, table, k_cache, v_cache)

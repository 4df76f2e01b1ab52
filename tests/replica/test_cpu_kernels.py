"""The fused CPU kernels against plain PyTorch references (float64 where rounding matters)."""

import math
import os
import platform

import pytest
import torch
import torch.nn.functional as F

from fleetserve.replica.kernels import cpu_ops, unavailable_reason

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {unavailable_reason()}")

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 64, 37])  # vector width multiples and a scalar tail
def test_rms_norm_and_fused_add(dtype, n):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, n, generator=g).to(dtype)
    r = torch.randn(33, n, generator=g).to(dtype)
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)

    def ref(v):
        v = v.double()
        return (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()

    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5).double(), ref(x), **tol(dtype))
    x0, r0 = x.clone(), r.clone()
    y, s = ops.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched
    torch.testing.assert_close(s, x + r, atol=0, rtol=0)  # the residual add rounds exactly like torch's
    torch.testing.assert_close(y.double(), ref(x + r), **tol(dtype))
    # One rounding, like torch's own fused rms_norm: bf16 results equal it except where the two
    # float sums (different summation orders; torch's depends on the CPU) straddle a rounding
    # boundary, which moves an element by one bf16 step. Rounding twice would move many.
    ours, theirs = ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5)
    if dtype == torch.bfloat16:
        differ = ours != theirs
        assert differ.float().mean() <= 0.002
        one_step = theirs.float().abs() * 2.0**-7
        assert ((ours.float() - theirs.float()).abs()[differ] <= one_step[differ]).all()
    else:
        torch.testing.assert_close(ours, theirs, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_in_place_on_a_strided_view(dtype, head_dim):
    from fleetserve.replica.layers import RotaryEmbedding

    rope = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0})
    T, H, KVH = 7, 4, 2
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(T, (H + 2 * KVH) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 5, 6, 100, 101, 102, 511])
    qk = qkv[:, : (H + KVH) * head_dim].view(T, H + KVH, head_dim)  # rows strided: v follows
    v_before = qkv[:, (H + KVH) * head_dim :].clone()
    cos, sin = rope.cos_sin(positions, torch.float64)
    expected = RotaryEmbedding.rotate(qk.double(), cos.double(), sin.double())
    ops.rotary_embedding_(qk, rope.cos_sin_cache, positions)
    torch.testing.assert_close(qk.double(), expected, **tol(dtype))
    assert torch.equal(qkv[:, (H + KVH) * head_dim :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="position 512 out of range"):
        ops.rotary_embedding_(qk, rope.cos_sin_cache, torch.full((T,), 512))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1536, 24])
def test_silu_and_mul(dtype, d):
    x = torch.randn(9, 2 * d, generator=torch.Generator().manual_seed(2)).mul(4).to(dtype)
    gate, up = x.double().chunk(2, -1)
    torch.testing.assert_close(ops.silu_and_mul(x).double(), F.silu(gate) * up, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [49152, 1000, 17, 16, 7, 1])  # whole vectors, tails, shorter than a vector
def test_argmax_rows_is_torch_argmax(dtype, n):
    """The greedy sampler's argmax: torch.argmax(x, -1) exactly, ties (first index), NaN (the
    first NaN, as torch), all -inf rows, and a narrowed view (a padded LM head's logits)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, n, generator=g).to(dtype)
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    ties = (x.float() * 2).round().clamp(-2, 2).to(dtype)  # many equal maxima per row
    assert torch.equal(ops.argmax_rows(ties), ties.argmax(-1))
    special = x.clone()
    special[1] = float("-inf")
    special[2, n - 1] = float("inf")
    special[3, n // 2] = float("nan")
    special[4, n - 1] = float("nan")
    special[4, n // 3] = float("nan")
    special[5, 0] = float("nan")
    got = ops.argmax_rows(special)
    assert torch.equal(got, special.argmax(-1)), (got, special.argmax(-1))
    assert got[1] == 0 and got[2] == n - 1 and got[3] == n // 2 and got[5] == 0
    wide = torch.randn(9, n + 40, generator=g).to(dtype)
    assert torch.equal(ops.argmax_rows(wide[:, :n]), wide[:, :n].argmax(-1))
    assert ops.argmax_rows(x[:0]).shape == (0,)


def test_bf16_stores_round_half_to_even_and_keep_specials():
    """Every vector path's bf16 store (AVX-512's and AVX2's own rounding code) against torch's
    add: float sums that sit exactly halfway between two bf16 values round to the even one, and
    inf / NaN come through (a rounding bias of half a step in every residual add would drift
    a whole forward away from the reference)."""
    n = 64  # whole vectors on every path
    ones = torch.ones(4, n, dtype=torch.bfloat16)
    # 1 + k * 2^-8: exactly halfway between bf16 neighbours (step 2^-7) for odd k.
    half_steps = (torch.arange(4 * n).view(4, n) % 7) * 2.0**-8
    x = ones.clone()
    r = half_steps.to(torch.bfloat16)
    x[0, 3], r[1, 5], x[2, 9], r[3, 11] = float("nan"), float("inf"), float("-inf"), float("nan")
    w = torch.ones(n, dtype=torch.bfloat16)
    _, s = ops.fused_add_rms_norm(x, r, w, 1e-5)
    torch.testing.assert_close(s, x + r, atol=0, rtol=0, equal_nan=True)
    assert s[0, 3].isnan() and s[1, 5] == float("inf") and s[2, 9] == float("-inf") and s[3, 11].isnan()
    # NaN in a gate comes out NaN, never clamped into a number by the exp's range limits.
    g = torch.randn(2, 2 * n).to(torch.bfloat16)
    g[1, 7] = float("nan")
    y = ops.silu_and_mul(g)
    assert y[1, 7].isnan() and not y[0].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(dtype):
    KVH, NB, BS, D, T = 3, 10, 4, 8, 5
    k_cache = torch.zeros(KVH, NB, BS, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.randn(T, 2 * KVH * D).to(dtype)
    k, v = kv[:, : KVH * D].view(T, KVH, D), kv[:, KVH * D :].view(T, KVH, D)
    slots = torch.tensor([0, 5, 39, 17, -1])
    ops.reshape_and_cache_(k, v, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(k_cache[:, s // BS, s % BS], k[t]) and torch.equal(v_cache[:, s // BS, s % BS], v[t])
    assert int((k_cache != 0).any(-1).sum()) == 4 * KVH  # nothing else written
    with pytest.raises(RuntimeError, match="out of range"):
        ops.reshape_and_cache_(k, v, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 40]))


def reference_decode(q, k_cache, v_cache, tables, lens, scale, window=0, softcap=0.0):
    """Row b's query over its first lens[b] keys (its last `window` of them when window > 0),
    scores soft-capped when softcap > 0, in float64."""
    KVH, _, BS, D = k_cache.shape
    B, H, _ = q.shape
    G = H // KVH
    out = torch.empty(B, H, D, dtype=torch.float64)
    for b in range(B):
        n = lens[b]
        first = max(0, n - window) if window else 0
        blocks = torch.tensor(tables[b][: -(-n // BS)])
        keys = k_cache[:, blocks].reshape(KVH, -1, D)[:, first:n].double()
        vals = v_cache[:, blocks].reshape(KVH, -1, D)[:, first:n].double()
        for h in range(H):
            s = keys[h // G] @ q[b, h].double() * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            out[b, h] = torch.softmax(s, -1) @ vals[h // G]
    return out.view(B, H * D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 8), (6, 2, 24, 16), (10, 2, 64, 16), (8, 1, 128, 32)],
)
def test_paged_attention_decode_rows(dtype, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(3)
    NB = 64
    k_cache = torch.randn(kv_heads, NB, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(kv_heads, NB, block_size, head_dim, generator=g).to(dtype)
    lens = [1, 15, 16, 17, 100, 3 * block_size + 5]
    perm = torch.randperm(NB - 1, generator=g) + 1
    tables, pos = [], 0
    for n in lens:
        nb = -(-n // block_size) + 1  # one spare block in the table: must be ignored
        tables.append(perm[pos : pos + nb].tolist())
        pos += nb
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    # q as a strided view, like the model passes it (rows of the qkv projection).
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = ops.paged_attention(q, k_cache, v_cache, table, torch.tensor(lens), None, scale)
    assert out.shape == (len(lens), heads * head_dim) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference_decode(q, k_cache, v_cache, tables, lens, scale), **tol(dtype))
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_attention(q, k_cache, v_cache, table[:, :1], torch.tensor(lens), None, scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_prefill_chunks_and_decodes(dtype):
    """Tokens of several requests in one call: a prefill from scratch, a continuation over cached
    context and a decode; each token sees its request's keys up to its own position (causal)."""
    KVH, H, D, BS, NB = 2, 6, 64, 16, 32
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(KVH, NB, BS, D, generator=g).to(dtype)
    v_cache = torch.randn(KVH, NB, BS, D, generator=g).to(dtype)
    # (context, new tokens, blocks)
    reqs = [(0, 20, [3, 7]), (30, 5, [1, 9, 4]), (40, 1, [11, 12, 13])]
    table = torch.tensor([b + [0] * (3 - len(b)) for _, _, b in reqs])
    token_req, seq_lens = [], []
    for r, (ctx, n, _) in enumerate(reqs):
        token_req += [r] * n
        seq_lens += [ctx + i + 1 for i in range(n)]
    T = len(token_req)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    out = ops.paged_attention(q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(token_req), 0.125)
    per_token_tables = [reqs[r][2] for r in token_req]
    expected = reference_decode(q, k_cache, v_cache, per_token_tables, seq_lens, 0.125)
    torch.testing.assert_close(out.double(), expected, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (6, 2, 24), (8, 1, 128), (2, 1, 256)])
def test_paged_attention_chunk_tokens_match_lone_tokens_bit_for_bit(dtype, heads, kv_heads, head_dim):
    """A run of one request's tokens (a prompt chunk, drafts being verified) is attended as one
    tile, sharing value passes between tokens; a token alone (a decode) is its own tile. Either
    way each token's output is the same bits: verifying drafts computes exactly what decoding
    them one by one would, whatever the chunk's length, with scores past any 16 keys. Row-major
    keys, and tiled keys where this build has them."""
    tiled = dtype == torch.bfloat16 and ops.k_tiled_supported(dtype, 16, head_dim)
    for layout in ("rows", "k_tiled") if tiled else ("rows",):
        _chunk_vs_lone(dtype, layout, heads, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (13, 0.0), (40, 0.0), (0, 5.0), (21, 2.5)])
def test_paged_attention_sliding_window_and_softcap(dtype, window, softcap):
    """window > 0: each token sees only its last `window` keys (transformers' sliding window:
    key j for the query at p when p - window < j <= p), prefills, continuations past the window
    and decodes alike; softcap > 0: scores s -> softcap * tanh(s / softcap). Against the float64
    reference, in row-major keys and in the tiled layout where the build has it; and a chunk's
    tokens are the same bits as the same tokens alone (the task's first key read depends on its
    tile, a token's result must not)."""
    layouts = ["rows"] + (["k_tiled"] if dtype == torch.bfloat16 and ops.k_tiled_supported(dtype, 16, 64) else [])
    for layout in layouts:
        _chunk_vs_lone(dtype, layout, 6, 2, 64, window=window, softcap=softcap)
        # blocks of 32: a task's first key (a multiple of 16) can be mid-block, tiled too
        _chunk_vs_lone(dtype, layout, 4, 2, 64, window=window, softcap=softcap, block_size=32)
    # blocks of 8 (a task's first key mid-block) and a head_dim with no vector path
    _chunk_vs_lone(dtype, "rows", 4, 4, 24, window=window, softcap=softcap, block_size=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_window_skips_keys_before_it(dtype):
    """Under a window the kernel reads a request's cache from (16 keys at most before) the first
    key its tokens see: keys and values before that are never loaded, so a long context costs a
    window's worth per token. NaN there would reach the output if they were read at all."""
    KVH, H, D, BS, W = 2, 4, 64, 16, 20
    for layout in ["rows"] + (["k_tiled"] if dtype == torch.bfloat16 and ops.k_tiled_supported(dtype, BS, D) else []):
        g = torch.Generator().manual_seed(12)
        k = torch.randn(101, KVH, D, generator=g).to(dtype)
        v = torch.randn(101, KVH, D, generator=g).to(dtype)
        k_cache = torch.zeros(KVH, 8, BS, D, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        table = torch.tensor([[7, 2, 5, 1, 6, 3, 4]])
        slots = torch.tensor([int(table[0, i // BS]) * BS + i % BS for i in range(101)])
        ops.reshape_and_cache_(k, v, k_cache, v_cache, slots, layout == "k_tiled")
        rows_k = k_cache.clone()
        for positions, lens in ((range(64), [91 + i for i in range(10)]), (range(80), [101])):
            nan_k, nan_v = k_cache.clone(), v_cache.clone()
            for p in positions:  # before every token's window, rounded down to 16
                nan_k[:, table[0, p // BS], p % BS] = float("nan")  # (a tiled block: whole blocks here)
                nan_v[:, table[0, p // BS], p % BS] = float("nan")
            q = torch.randn(len(lens), H, D, generator=g).to(dtype)
            tr = torch.zeros(len(lens), dtype=torch.long)
            out = ops.paged_attention(q, nan_k, nan_v, table, torch.tensor(lens), tr, 0.125, layout == "k_tiled", W)
            if layout == "k_tiled":
                rows_k = k_cache.view(KVH, 8, D // 2, BS, 2).transpose(2, 3).reshape(KVH, 8, BS, D)
            ref = reference_decode(q, rows_k, v_cache, [table[0].tolist()] * len(lens), lens, 0.125, W)
            torch.testing.assert_close(out.double(), ref, **tol(dtype))


def _chunk_vs_lone(dtype, layout, heads, kv_heads, head_dim, window=0, softcap=0.0, block_size=16):
    KVH, H, D, BS, NB = kv_heads, heads, head_dim, block_size, 160 // block_size * 8
    g = torch.Generator().manual_seed(8)
    reqs = [(0, 45), (19, 9), (3, 2), (60, 1), (0, 17)]  # (cached context, new tokens)
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    k_cache = torch.zeros(KVH, NB, BS, D, dtype=dtype)
    v_cache = torch.zeros(KVH, NB, BS, D, dtype=dtype)
    tables, token_req, seq_lens, pos = [], [], [], 0
    for r, (ctx, n) in enumerate(reqs):
        nb = -(-(ctx + n) // BS)
        tables.append(perm[pos : pos + nb])
        pos += nb
        k = torch.randn(ctx + n, KVH, D, generator=g).to(dtype)
        v = torch.randn(ctx + n, KVH, D, generator=g).to(dtype)
        slots = torch.tensor([tables[r][i // BS] * BS + i % BS for i in range(ctx + n)])
        ops.reshape_and_cache_(k, v, k_cache, v_cache, slots, layout == "k_tiled")
        token_req += [r] * n
        seq_lens += [ctx + i + 1 for i in range(n)]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    T = len(token_req)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    extra = (layout == "k_tiled", window, softcap) if window or softcap else (True,) if layout == "k_tiled" else ()
    scale = 1 / math.sqrt(D)
    chunked = ops.paged_attention(
        q, k_cache, v_cache, table, torch.tensor(seq_lens), torch.tensor(token_req), scale, *extra
    )
    # Every token on its own: a batch of lone tokens (one block-table row each), in reverse order.
    order = list(reversed(range(T)))
    lone = ops.paged_attention(
        q[order],
        k_cache,
        v_cache,
        table[[token_req[t] for t in order]],
        torch.tensor([seq_lens[t] for t in order]),
        None,
        scale,
        *extra,
    )
    assert torch.equal(chunked, lone.flip(0))
    # and right (the tiled layout's own reference check: test_tiled_keys_written_and_read)
    if layout == "rows" or window or softcap:
        if layout == "k_tiled":  # the reference reads row-major keys
            k_cache = k_cache.view(KVH, NB, D // 2, BS, 2).transpose(2, 3).reshape(KVH, NB, BS, D)
        per_token = [tables[r] for r in token_req]
        ref = reference_decode(q, k_cache, v_cache, per_token, seq_lens, scale, window, softcap)
        torch.testing.assert_close(chunked.double(), ref, **tol(dtype))


def test_kv_caches_are_zeroed_with_huge_pages_advised():
    from fleetserve.replica.model_loader.weights import allocate_kv_caches
    from fleetserve.replica.testing import tiny_llama_config

    caches = allocate_kv_caches(tiny_llama_config(), 512, 16, torch.bfloat16)
    assert all(int(c.count_nonzero()) == 0 for c in caches)
    assert isinstance(ops.advise_hugepages(torch.empty(8 << 20, dtype=torch.uint8)), bool)


def test_build_file_names_no_checkout_path():
    """Two checkouts of one source share one build: ninja's file names the cache's copy of the
    source, not a checkout's path (which made checkouts rebuild each other's library)."""
    from fleetserve.replica import kernels

    if kernels.cpu_ops() is None:
        pytest.skip(f"kernels unavailable: {kernels.unavailable_reason()}")
    ninja = (kernels.build_dir() / "build.ninja").read_text()
    assert str(kernels.SOURCE.parent) not in ninja and str(kernels.build_dir() / "cpu_ops.cpp") in ninja


def test_isa_names_the_paths_built():
    """The native build has the best paths this CPU has; a FLEETSERVE_CPU_MARCH build (from
    test_cpu_kernel_isas.py) has the ones that -march implies."""
    from fleetserve.replica import kernels

    expected = os.environ.get("FLEETSERVE_EXPECT_CPU_ISA")
    if expected is None:
        if kernels.march() != "native":
            pytest.skip(f"built for -march={kernels.march()}")
        flags = set(kernels._cpu_flags().split())
        if "avx512f" not in flags:
            expected = "avx2" if {"avx2", "fma"} <= flags else "scalar"
        else:
            expected = "avx512_bf16" if "avx512_bf16" in flags else "avx512"
        if platform.machine().lower() not in ("x86_64", "amd64"):
            expected = "scalar"
    assert ops.isa() == expected == kernels.isa()


def _bf16_linear_case(n, k, m, gen, bias=True):
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    return w, b, x


def test_small_m_linear_bf16_matches_float64_and_is_batch_invariant():
    """x W^T + b at decode batch sizes: every output within one bf16 step of the float64
    result (float accumulation, one rounding), any N (tiles of 32 plus a tail), odd K, more
    rows than one pass holds, strided rows; and a row's result does not depend on its batch."""
    g = torch.Generator().manual_seed(0)
    if ops.isa() != "avx512_bf16":  # the fallback builds refuse it clearly; the layers never call it
        w, b, x = _bf16_linear_case(40, 16, 2, g)
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            ops.linear_bf16(x, ops.pack_linear_bf16(w), b, 40)
        from fleetserve.replica.layers.linear import _can_pack_small_m

        assert not _can_pack_small_m(w)
        return
    for n, k in [(96, 64), (80, 48), (37, 33), (5, 2), (960, 576)]:
        for bias in (True, False):
            w, b, x = _bf16_linear_case(n, k, 21, g, bias)
            packed = ops.pack_linear_bf16(w)
            got = ops.linear_bf16(x, packed, b, n)
            assert got.dtype == torch.bfloat16 and got.shape == (21, n)
            ref = x.double() @ w.double().t() + (b.double() if bias else 0)
            step = ref.abs() * 2.0**-8 + 1e-3  # half a bf16 step, plus float accumulation
            assert ((got.double() - ref).abs() <= 2 * step).all(), (n, k, bias)
            for m in (1, 3, 8, 9, 21):  # rows alone, in chunks, and past one 8-row pass
                assert torch.equal(ops.linear_bf16(x[:m], packed, b, n), got[:m])
            assert torch.equal(ops.linear_bf16(x[20:21], packed, b, n)[0], got[20])
            wide = torch.randn(21, k + 7, generator=g).to(torch.bfloat16)
            wide[:, :k] = x
            assert torch.equal(ops.linear_bf16(wide[:, :k], packed, b, n), got)  # strided rows
            # float_out: the same accumulators unrounded (logits), which round to `got`.
            full = ops.linear_bf16(x, packed, b, n, True)
            assert full.dtype == torch.float32 and torch.equal(full.to(torch.bfloat16), got)
            torch.testing.assert_close(full.double(), ref, atol=1e-3, rtol=1e-5)
    assert ops.linear_bf16(x[:0], packed, None, n).shape == (0, n)
    # Prefill-sized batches: past 256 rows the kernel splits rows into blocks across threads;
    # every row still gets the same result as alone.
    w, b, x = _bf16_linear_case(80, 48, 600, g)
    packed = ops.pack_linear_bf16(w)
    got = ops.linear_bf16(x, packed, b, 80)
    ref = x.double() @ w.double().t() + b.double()
    assert ((got.double() - ref).abs() <= 2 * (ref.abs() * 2.0**-8 + 1e-3)).all()
    for lo, hi in [(0, 1), (250, 262), (255, 257), (256, 600), (599, 600)]:
        assert torch.equal(ops.linear_bf16(x[lo:hi], packed, b, 80), got[lo:hi]), (lo, hi)


def test_small_m_linear_bf16_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(1)
    w, b, x = _bf16_linear_case(40, 16, 2, g)
    packed = ops.pack_linear_bf16(w)  # packing is plain tensor code, in every build
    assert packed.shape == (2, 8, 32, 2)
    if ops.isa() != "avx512_bf16":  # (a fallback build from test_cpu_kernel_isas.py)
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            ops.linear_bf16(x, packed, b, 40)
        return
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16(torch.randn(2, 18).to(torch.bfloat16), packed, b, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_bf16(x, packed, b, 70)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.linear_bf16(x.float(), packed, b, 40)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16(x, packed, b[:3], 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.pack_linear_bf16(w.float())


def test_fused_gate_up_silu_mul_matches_float64_and_is_batch_invariant():
    """linear_bf16_silu_mul: silu(x G^T + bg) * (x U^T + bu) of a merged [gate; up] weight, packed
    after interleave_gate_up, in one kernel: within a bf16 step of the float64 result and closer
    to it than the matmul followed by silu_and_mul (gate and up unrounded); any d (tiles of 16
    and a tail), odd K, bias or none, prefill-sized batches; a row's result does not depend on
    its batch; a mismatched weight or bias is refused."""
    from fleetserve.replica.layers.linear import interleave_gate_up

    g = torch.Generator().manual_seed(5)
    w, b, x = _bf16_linear_case(2 * 37, 33, 21, g)
    if ops.isa() != "avx512_bf16":  # fallback builds refuse it; the MLP then takes the two ops
        with pytest.raises(RuntimeError, match="AVX-512 BF16"):
            ops.linear_bf16_silu_mul(x, ops.pack_linear_bf16(interleave_gate_up(w, 37)), b, 37)
        return
    for d, k, m in [(37, 33, 21), (64, 48, 9), (1536, 576, 300), (5, 2, 3)]:
        for bias in (True, False):
            w, b, x = _bf16_linear_case(2 * d, k, m, g, bias)
            w = w * 0.2  # pre-activations of a few units, where SiLU bends
            packed = ops.pack_linear_bf16(interleave_gate_up(w, d))
            got = ops.linear_bf16_silu_mul(x, packed, b, d)
            assert got.dtype == torch.bfloat16 and got.shape == (m, d)
            pre = x.double() @ w.double().t() + (b.double() if bias else 0)
            ref = F.silu(pre[:, :d]) * pre[:, d:]
            step = ref.abs() * 2.0**-8 + 1e-2
            assert ((got.double() - ref).abs() <= 2 * step).all(), (d, k, bias)
            two_ops = ops.silu_and_mul(ops.linear_bf16(x, ops.pack_linear_bf16(w), b, 2 * d))
            assert (got.double() - ref).abs().mean() <= (two_ops.double() - ref).abs().mean()
            for lo, hi in [(0, 1), (0, 8), (3, 12), (m - 1, m)]:
                assert torch.equal(ops.linear_bf16_silu_mul(x[lo:hi], packed, b, d), got[lo:hi]), (d, lo, hi)
    assert ops.linear_bf16_silu_mul(x[:0], packed, None, d).shape == (0, d)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_bf16_silu_mul(x, packed, None, d + 16)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16_silu_mul(x, packed, torch.zeros(d, dtype=torch.bfloat16), d)


def test_small_m_linear_f32_matches_float64_and_is_batch_invariant():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(37, 33, generator=g)
    packed = ops.pack_linear_f32(w)
    tw = packed.shape[2]  # tiles of 2 vectors of outputs, each transposed, rows past 37 zero
    padded = torch.cat([w, torch.zeros(-37 % tw, 33)])
    assert torch.equal(packed, padded.view(-1, tw, 33).permute(0, 2, 1))
    assert torch.equal(ops.pack_linear_f32(w.t().contiguous().t()), packed)  # any strides
    if ops.isa() == "scalar":  # no vector path: it refuses; the layers never pack it
        with pytest.raises(RuntimeError, match="AVX2"):
            ops.linear_f32(torch.randn(2, 33), packed, None, 37)
        from fleetserve.replica.layers.linear import _can_pack_small_m

        assert not _can_pack_small_m(w)
        return
    for n, k in [(96, 64), (80, 48), (37, 33), (5, 2), (960, 576)]:
        for bias in (True, False):
            w = torch.randn(n, k, generator=g)
            b = torch.randn(n, generator=g) if bias else None
            x = torch.randn(21, k, generator=g)
            packed = ops.pack_linear_f32(w)
            got = ops.linear_f32(x, packed, b, n)
            ref = x.double() @ w.double().t() + (b.double() if bias else 0)
            torch.testing.assert_close(got.double(), ref, atol=1e-4, rtol=1e-5)
            for m in (1, 3, 4, 5, 6, 7, 8, 9, 12, 13, 21):  # passes of 6 rows (AVX2) or 8 (AVX-512)
                assert torch.equal(ops.linear_f32(x[:m], packed, b, n), got[:m])
            wide = torch.randn(21, k + 7, generator=g)
            wide[:, :k] = x
            assert torch.equal(ops.linear_f32(wide[:, :k], packed, b, n), got)
    x = torch.randn(600, k, generator=g)  # past 256 rows: row blocks across threads
    got = ops.linear_f32(x, packed, b, n)
    torch.testing.assert_close(
        got.double(), x.double() @ w.double().t() + (b.double() if bias else 0), atol=1e-4, rtol=1e-5
    )
    # row blocks of 256 rows (AVX-512, 8 a pass) or 252 (AVX2, 6 a pass)
    for lo, hi in [(0, 1), (251, 253), (255, 257), (256, 600), (504, 600)]:
        assert torch.equal(ops.linear_f32(x[lo:hi], packed, b, n), got[lo:hi]), (lo, hi)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.linear_f32(x, packed, b, 3)
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_f32(torch.randn(2, k + 1), packed, b, n)


TILED = ops is not None and ops.k_tiled_supported(torch.bfloat16, 16, 64)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 4, 32, 32), (8, 1, 128, 16), (10, 2, 64, 16), (2, 1, 256, 16)],
)
def test_tiled_keys_written_and_read(heads, kv_heads, head_dim, block_size):
    """k_tiled: reshape_and_cache_ stores each key block as [D/2][BS][2] (values unchanged) and
    paged_attention reads it back: the float64 reference's answer within bf16 rounding, and the
    row-major layout's answer to within an ulp, for prefills, a continuation and decodes. A build
    without AVX-512 BF16 (the fallback builds of test_cpu_kernel_isas.py) has no tiled layout and
    says so."""
    KVH, H, D, BS, NB = kv_heads, heads, head_dim, block_size, 48
    if not TILED:
        from fleetserve.replica.layers.attention import kv_cache_layout

        assert not ops.k_tiled_supported(torch.bfloat16, BS, D) and kv_cache_layout(torch.bfloat16, BS, D) == "rows"
        kc = torch.zeros(KVH, NB, BS, D, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="k_tiled"):
            ops.paged_attention(
                torch.zeros(1, H, D, dtype=torch.bfloat16),
                kc,
                kc.clone(),
                torch.tensor([[0]]),
                torch.tensor([1]),
                None,
                0.125,
                True,
            )
        return
    g = torch.Generator().manual_seed(6)
    reqs = [(0, 37), (2 * BS + 3, 4), (3 * BS - 1, 1), (0, 1)]  # (cached context, new tokens)
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    tables, caches = [], {}
    for tiled in (False, True):
        caches[tiled] = [torch.zeros(KVH, NB, BS, D, dtype=torch.bfloat16) for _ in range(2)]
    token_req, seq_lens, pos = [], [], 0
    for r, (ctx, n) in enumerate(reqs):
        nb = -(-(ctx + n) // BS)
        tables.append(perm[pos : pos + nb])
        pos += nb
        k = torch.randn(ctx + n, KVH, D, generator=g).bfloat16()
        v = torch.randn(ctx + n, KVH, D, generator=g).bfloat16()
        slots = torch.tensor([tables[r][i // BS] * BS + i % BS for i in range(ctx + n)])
        for tiled, (kc, vc) in caches.items():
            ops.reshape_and_cache_(k, v, kc, vc, slots, tiled)
        token_req += [r] * n
        seq_lens += [ctx + i + 1 for i in range(n)]
    (k_rows, v_rows), (k_tiled, v_tiled) = caches[False], caches[True]
    assert torch.equal(v_rows, v_tiled)
    assert torch.equal(k_tiled.view(KVH, NB, D // 2, BS, 2), k_rows.view(KVH, NB, BS, D // 2, 2).permute(0, 1, 3, 2, 4))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(token_req), H, D, generator=g).bfloat16()
    args = (table, torch.tensor(seq_lens), torch.tensor(token_req), 1 / math.sqrt(D))
    tiled_out = ops.paged_attention(q, k_tiled, v_tiled, *args, True)
    rows_out = ops.paged_attention(q, k_rows, v_rows, *args)
    expected = reference_decode(q, k_rows, v_rows, [tables[r] for r in token_req], seq_lens, 1 / math.sqrt(D))
    torch.testing.assert_close(tiled_out.double(), expected, **tol(torch.bfloat16))
    ulp = rows_out.float().abs().clamp_min(1e-30) * 2.0**-7
    assert bool(((tiled_out.float() - rows_out.float()).abs() <= ulp).all())


def test_tiled_keys_refused_where_unsupported():
    """A tiled key cache exists only for bf16 with AVX-512 BF16, blocks of 16k, head_dim 32-256:
    asked for anything else, the ops raise rather than read or write a layout they lack."""
    q = torch.randn(1, 2, 64)
    kc, vc = torch.zeros(1, 4, 16, 64), torch.zeros(1, 4, 16, 64)
    table, lens = torch.tensor([[0]]), torch.tensor([1])
    assert not ops.k_tiled_supported(torch.float32, 16, 64)
    assert not ops.k_tiled_supported(torch.bfloat16, 8, 64)
    with pytest.raises(RuntimeError, match="k_tiled"):
        ops.paged_attention(q, kc, vc, table, lens, None, 0.125, True)
    with pytest.raises(RuntimeError, match="k_tiled"):
        ops.reshape_and_cache_(q[:, :1], q[:, :1], kc, vc, torch.tensor([0]), True)
    kb = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="k_tiled"):
        ops.paged_attention(q.bfloat16(), kb, kb.clone(), table, lens, None, 0.125, True)


def test_kv_cache_layout_follows_the_kernels():
    from fleetserve.replica import kernels
    from fleetserve.replica.layers.attention import kv_cache_layout

    assert kv_cache_layout(torch.bfloat16, 16, 64) == ("k_tiled" if TILED else "rows")
    assert kv_cache_layout(torch.bfloat16, 32, 32) == ("k_tiled" if TILED else "rows")
    assert kv_cache_layout(torch.float32, 16, 64) == "rows"
    assert kv_cache_layout(torch.bfloat16, 8, 64) == "rows"
    assert kv_cache_layout(torch.bfloat16, 16, 48) == "rows"
    with kernels.disabled():
        assert kv_cache_layout(torch.bfloat16, 16, 64) == "rows"


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_how_tasks_are_split_between_threads(dtype):
    """The linears, attention and argmax hand out their tasks by work stealing (each thread
    starts on its own share; one that finishes early takes tasks from the back of another's,
    so a thread that the OS preempts does not hold up the step). Whichever thread runs a task,
    every task must run exactly once and compute the same bits: with 1, 2 and 7 threads (more
    than this machine's cores, so threads get preempted and their tasks taken), the outputs are
    identical and right. Every output stays alive, so no call can find an earlier call's
    result in reused memory."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(700, 96, generator=g)
    x = torch.randn(600, 96, generator=g)  # past 256 rows: tiles x row blocks
    KVH, H, D, BS, NB = 2, 6, 64, 16, 128
    k_cache = torch.randn(KVH, NB, BS, D, generator=g).to(dtype)
    v_cache = torch.randn(KVH, NB, BS, D, generator=g).to(dtype)
    lens = [(i * 37) % 200 + 1 for i in range(40)]
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    tables, pos = [], 0
    for n in lens:
        nb = -(-n // BS)
        tables.append((perm * 4)[pos : pos + nb])  # blocks shared between rows: fine for reading
        pos += nb
    table = torch.tensor([t + [0] * (13 - len(t)) for t in tables])
    q = torch.randn(len(lens), H, D, generator=g).to(dtype)
    logits = torch.randn(50, 3001, generator=g).to(dtype)
    vector_f32 = ops.isa() != "scalar"

    def run():
        out = {
            "attn": ops.paged_attention(q, k_cache, v_cache, table, torch.tensor(lens), None, 0.125),
            "argmax": ops.argmax_rows(logits),
        }
        if vector_f32:
            packed = ops.pack_linear_f32(w)
            out["linear"] = ops.linear_f32(x, packed, None, 700)
            out["linear_small"] = ops.linear_f32(x[:64], packed, None, 700)
        return out

    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 7, 2, 7):
            torch.set_num_threads(threads)
            results.append(run())
    finally:
        torch.set_num_threads(before)
    first = results[0]
    for other in results[1:]:
        for name, got in other.items():
            assert torch.equal(got, first[name]), name
    torch.testing.assert_close(
        first["attn"].double(), reference_decode(q, k_cache, v_cache, tables, lens, 0.125), **tol(dtype)
    )
    assert torch.equal(first["argmax"], logits.argmax(-1))
    if vector_f32:
        torch.testing.assert_close(first["linear"].double(), x.double() @ w.double().t(), atol=1e-4, rtol=1e-5)

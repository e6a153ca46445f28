"""specd's GGUF block kernels (specd/csrc/quants.c) against independent oracles: gguf's numpy
dequantiser for the weights, a numpy transcription of ggml's reference quantisers for the
activations, float64 for the products; and the batch invariance the verifier rests on: a row's
result has the same bits whatever rows share its call, on both builds and any thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from specd import native, quants

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"no kernels: {native.available()}")

TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]
PACKED = [T.Q8_0, T.Q5_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K]  # types with panel kernels (quants.c, specd_repack)
MARCHES = [native.NATIVE, "haswell"]
N, K = 53, 512  # N odd and not a multiple of the column chunk or the row tile


def _fp16_bytes(rng, shape) -> np.ndarray:
    return rng.uniform(1e-3, 1e-2, shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def make_weight(kind: T, n: int = N, k: int = K, seed: int = 0) -> np.ndarray:
    """[n, row bytes] uint8: a GGUF tensor of type `kind`. gguf's quantiser where it has one, else
    random blocks whose fp16 scales are overwritten with sane values (every bit pattern of the
    integer fields is then exercised, e.g. Q6_K's int8 scales of either sign)."""
    rng = np.random.default_rng(seed + int(kind))
    if kind in (T.F32, T.F16, T.BF16, T.Q8_0, T.Q5_0, T.Q4_0):
        w = rng.standard_normal((n, k)).astype(np.float32)
        return np.ascontiguousarray(gguf_quants.quantize(w, kind)).view(np.uint8).reshape(n, -1)
    return random_blocks(kind, n, k, rng)


def random_blocks(kind: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row bytes] uint8 of random blocks with sane fp16 scales: every bit pattern of the
    integer fields (Q8_0's -128, Q6_K's int8 scales of either sign, all 5th bits set, ...)."""
    q = quants.quant_type(kind)
    raw = rng.integers(0, 256, (n, k // q.block, q.type_size), dtype=np.uint8)
    if kind in (T.Q8_0, T.Q5_0, T.Q4_0):
        raw[..., 0:2] = _fp16_bytes(rng, raw.shape[:2])
        return raw.reshape(n, -1)
    if kind == T.Q6_K:
        raw[..., 208:210] = _fp16_bytes(rng, raw.shape[:2])  # d (last field)
    else:
        raw[..., 0:2] = _fp16_bytes(rng, raw.shape[:2])  # d
        raw[..., 2:4] = _fp16_bytes(rng, raw.shape[:2])  # dmin
    return raw.reshape(n, -1)


# ---- numpy transcriptions of ggml's activation quantisers ----

def ref_q8_K(x: np.ndarray):
    """quantize_row_q8_K_ref: (d [B], qs [B, 256], bsums [B, 16]) per 256-value block."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    mag = np.abs(blocks)
    first = mag.argmax(axis=1)  # ggml keeps the first value of largest |x|
    top = blocks[np.arange(len(blocks)), first]
    zero = mag.max(axis=1) == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.float32(-127.0) / np.where(zero, np.float32(1), top)
        q = np.rint(iscale[:, None] * blocks)  # nearest_int: round half to even
    qs = np.where(zero[:, None], 0, np.minimum(q, 127)).astype(np.int8)
    d = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    bsums = qs.astype(np.int32).reshape(-1, 16, 16).sum(-1).astype(np.int16)
    return d, qs, bsums


def ref_q8_0(x: np.ndarray):
    """quantize_row_q8_0_ref: (d as the float of its fp16 [B], qs [B, 32]) per 32-value block."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = np.abs(blocks).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (blocks * inv[:, None]).astype(np.float64)
    qs = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)  # roundf: half away from zero (exact in f64)
    return d.astype(np.float16).astype(np.float32), qs


def split_q8_K(buf: torch.Tensor):
    rec = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
    blocks = buf.numpy().reshape(-1).view(rec)
    return blocks["d"], blocks["qs"], blocks["bsums"]


def split_q8_0(buf: torch.Tensor):
    blocks = buf.numpy().reshape(-1).view(np.dtype([("d", "<f4"), ("qs", "i1", 32)]))
    return blocks["d"], blocks["qs"]


def activation_values(x: torch.Tensor, act: int) -> np.ndarray:
    """The values the kernel multiplies: d * qs of the reference quantisation, in float64."""
    xn = x.numpy()
    if act == quants.ACT_F32:
        return xn.astype(np.float64)
    if act == quants.ACT_Q8_0:
        d, qs = ref_q8_0(xn)
    else:
        d, qs, _ = ref_q8_K(xn)
    return (d.astype(np.float64)[:, None] * qs).reshape(xn.shape)


def tricky_rows(k: int, seed: int = 1) -> torch.Tensor:
    """Rows with a zero block, ties for the largest |x| (negative first), exact halves and wide range."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, k)) * rng.choice([1e-3, 1.0, 30.0], (6, 1))).astype(np.float32)
    x[1, :256] = 0
    x[2, :32] = 0
    x[3, 5], x[3, 9] = -4.0, 4.0  # |max| tie: ggml's max is the first, -4
    x[3, :256] = np.clip(x[3, :256], -3.9, 3.9)
    x[3, 5], x[3, 9] = -4.0, 4.0
    halves = np.arange(-63.5, 64, 0.5, dtype=np.float32)[:255]
    x[4, :255] = halves  # Q8_K: max -63.5 -> iscale 2: exact halves * 2 are integers; Q8_0 sees .5s
    x[4, 255] = -127
    x[5, :32] = np.float32(127) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[5, 0] = 127  # Q8_0: d = 1, x * id exact: halves round away from zero
    x[5, 1:8] = [0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5]
    return torch.from_numpy(x)


# ---- (a) dequantisation ----

@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
def test_dequantize_rows_equals_gguf(kind, march):
    raw = make_weight(kind)
    oracle = quants.reference_dequantize(raw, kind, (N, K))
    rows = np.array([0, N - 1, 7, 7, 30])
    got = quants.dequantize_rows(raw, kind, N, K, rows, march).numpy()
    assert np.array_equal(got, oracle[rows])
    assert np.array_equal(quants.dequantize_rows(raw, kind, N, K, np.arange(N), march).numpy(), oracle)


# ---- (b) activation quantisation ----

@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_K_equals_ggml_reference(march, threads):
    x = torch.cat([tricky_rows(K), torch.randn(130, K) * 3])
    d, qs, bsums = split_q8_K(quants.quantize_rows(x, quants.ACT_Q8_K, march, threads))
    rd, rqs, rbsums = ref_q8_K(x.numpy())
    assert np.array_equal(d.view(np.uint32), rd.view(np.uint32))
    assert np.array_equal(qs, rqs) and np.array_equal(bsums, rbsums)


@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("threads", [1, 2])
def test_q8_0_equals_ggml_reference(march, threads):
    x = torch.cat([tricky_rows(K), torch.randn(130, K) * 3])
    d, qs = split_q8_0(quants.quantize_rows(x, quants.ACT_Q8_0, march, threads))
    rd, rqs = ref_q8_0(x.numpy())
    assert np.array_equal(d.view(np.uint32), rd.view(np.uint32))
    assert np.array_equal(qs, rqs)


def test_q8_0_matches_gguf_quantiser():
    """Our transcription agrees with gguf's (bit-exact with ggml by its own claim) on the stored bytes."""
    x = torch.cat([tricky_rows(K), torch.randn(20, K)]).numpy()
    stored = gguf_quants.quantize(x, T.Q8_0).reshape(-1, 34)
    d, qs = ref_q8_0(x)
    assert np.array_equal(stored[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1), d)
    assert np.array_equal(stored[:, 2:].view(np.int8), qs)


def test_act_formats():
    lib = native.library()
    for kind in TYPES:
        assert lib.specd_act_of(int(kind)) == quants.quant_type(kind).act
    assert lib.specd_act_row_bytes(quants.ACT_Q8_K, 512) == 2 * 292
    assert lib.specd_act_row_bytes(quants.ACT_Q8_0, 512) == 16 * 36
    assert lib.specd_act_row_bytes(quants.ACT_F32, 512) == 512 * 4


# ---- (c) products: the only error is float rounding ----

def assert_float64_product(got: np.ndarray, raw: np.ndarray, kind: T, x: torch.Tensor, n: int, k: int):
    w = quants.reference_dequantize(raw, kind, (n, k)).astype(np.float64)
    xv = activation_values(x, quants.quant_type(kind).act)
    want = xv @ w.T
    scale = np.abs(xv) @ np.abs(w).T  # the size of the terms summed: float rounding is relative to it
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), float(np.max(np.abs(got - want) / (scale + 1e-30)))


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("packed", [False, True], ids=["stored", "packed"])
def test_matmul_equals_float64_of_dequantised(kind, march, packed):
    raw = make_weight(kind)
    x = torch.cat([tricky_rows(K), torch.randn(11, K)])
    got = quants.matmul(x, raw, kind, N, K, march=march, packed=packed).numpy()
    assert_float64_product(got, raw, kind, x, N, K)


@pytest.mark.parametrize("kind", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
def test_packed_random_blocks_equal_float64(kind, march):
    """Every bit pattern of the stored integers (random blocks) survives the repack: the panels'
    product is the float64 product of gguf's dequantisation, at N = 70 (a padded last panel)."""
    n, k = 70, 768
    raw = random_blocks(kind, n, k, np.random.default_rng(int(kind)))
    x = torch.cat([tricky_rows(k), torch.randn(5, k) * 5])
    got = quants.matmul(x, raw, kind, n, k, march=march, packed=True).numpy()
    assert_float64_product(got, raw, kind, x, n, k)



def extreme_blocks(kind: T, n: int, k: int, scale_byte: int) -> np.ndarray:
    """Blocks whose every stored integer is at its largest (nibbles 15, fifth bits set, Q6_K's
    values 63) and whose sub-block scales are all `scale_byte`: the products the AVX2 build sums in
    int16 at their bound."""
    raw = random_blocks(kind, n, k, np.random.default_rng(0)).reshape(n, k // 256, -1)
    if kind == T.Q6_K:
        raw[..., :192] = 0xFF
        raw[..., 192:208] = scale_byte  # int8 scales
    else:
        raw[..., 4:] = 0xFF
        raw[..., 4:16] = scale_byte  # packed 6-bit scales and mins
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
@pytest.mark.parametrize("scale_byte", [0xFF, 0x80, 0x7F])
def test_packed_extremes_equal_float64(kind, march, scale_byte):
    """Largest weights times activations of +-127 everywhere (rows of one value quantise to -127
    or 127): no partial sum of any build overflows, at any row count of a tile."""
    n, k = 40, 512
    raw = extreme_blocks(kind, n, k, scale_byte)
    x = torch.ones(6, k) * torch.tensor([[1.0], [-1.0], [3.0], [-0.5], [1.0], [-1.0]])
    x[4, 1::2] = -1.0  # alternating signs
    got = quants.matmul(x, raw, kind, n, k, march=march, packed=True).numpy()
    assert_float64_product(got, raw, kind, x, n, k)


@pytest.mark.parametrize("kind", PACKED, ids=lambda t: t.name)
def test_builds_agree_bit_for_bit(kind):
    """The AVX2 build (maddubs with int16 sums) and this CPU's widest build take different integer
    paths to the same exact integers, then the same float steps: equal bits, so a deployment that
    mixes hosts verifies what its drafters computed."""
    n, k = 70, 768
    raw = random_blocks(kind, n, k, np.random.default_rng(int(kind)))
    x = torch.cat([tricky_rows(k), torch.randn(10, k) * 5])
    wide = quants.matmul(x, raw, kind, n, k, march=native.NATIVE, packed=True)
    assert torch.equal(quants.matmul(x, raw, kind, n, k, march="haswell", packed=True), wide)


# ---- (d) batch invariance ----

def assert_rows_invariant(kind: T, march: str, packed: bool, n: int, k: int):
    raw = make_weight(kind, n, k)
    x = torch.cat([tricky_rows(k), torch.randn(123, k) * torch.rand(123, 1) * 10])  # 129 rows
    single = torch.cat([quants.matmul(x[i:i + 1], raw, kind, n, k, march=march, packed=packed)
                        for i in range(len(x))])
    for threads in (1, 2):
        for M in [*range(1, 17), 33, 64, 129]:
            start = (M * 7) % (len(x) - M + 1)  # rows land in different tiles than in other calls
            y = quants.matmul(x[start:start + M], raw, kind, n, k, march=march, threads=threads, packed=packed)
            assert torch.equal(y, single[start:start + M]), (M, threads)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
def test_rows_are_batch_invariant(kind, march):
    assert_rows_invariant(kind, march, False, N, K)


@pytest.mark.parametrize("kind", PACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
def test_packed_rows_are_batch_invariant(kind, march):
    """The panels' tiles (several rows, one or two strips of columns) give every row the bits of
    its one-row product; N = 70 leaves a padded last panel (and an odd strip count)."""
    assert_rows_invariant(kind, march, True, 70, K)


@pytest.mark.parametrize("march", MARCHES)
def test_repack_sizes(march):
    """Panels of 16 columns (the last one padded), each its blocks' integers then their scales,
    rounded to 64 bytes; types without panels report 0 and quants.repack leaves them as stored."""
    lib = native.library(march)
    per_block = {T.Q4_K: 2048 + 320, T.Q5_K: 2560 + 320, T.Q6_K: 3072 + 288, T.Q8_0: 512 + 32,
                 T.Q5_0: 320 + 32, T.Q4_0: 256 + 32}
    for kind, size in per_block.items():
        nb = 768 // quants.quant_type(kind).block
        assert lib.specd_repack_bytes(int(kind), 70, 768) == 5 * (-(-nb * size // 64) * 64)
        assert lib.specd_repack_bytes(int(kind), 70, 768 + 16) == 0  # not whole blocks
    for kind in (T.F32, T.F16, T.BF16):
        assert lib.specd_repack_bytes(int(kind), 70, 768) == 0
        raw = make_weight(kind, 70, 768)
        w = native.Linear(raw.ctypes.data, int(kind), 70, 768, None)
        assert quants.repack(w, march) is None and not w.packed


@pytest.mark.parametrize("kind", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("march", MARCHES)
def test_float_weights_any_K(kind, march):
    """Float weights take any K: the K % 16 tail has its own fixed-order sum."""
    k = 77
    raw = make_weight(kind, k=k)
    w = quants.reference_dequantize(raw, kind, (N, k)).astype(np.float64)
    x = torch.randn(9, k)
    got = quants.matmul(x, raw, kind, N, k, march=march)
    scale = np.abs(x.numpy().astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(got.numpy() - x.numpy().astype(np.float64) @ w.T) <= 1e-5 * scale)
    single = torch.cat([quants.matmul(x[i:i + 1], raw, kind, N, k, march=march) for i in range(9)])
    assert torch.equal(got, single)


# ---- (e) bias ----

@pytest.mark.parametrize("kind", [T.F16, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("packed", [False, True], ids=["stored", "packed"])
def test_bias_is_added_last(kind, packed):
    raw = make_weight(kind)
    x = torch.randn(5, K)
    bias = torch.randn(N)
    plain = quants.matmul(x, raw, kind, N, K, packed=packed)
    assert torch.equal(quants.matmul(x, raw, kind, N, K, bias=bias, packed=packed), plain + bias)


# ---- (f) refusal ----

@pytest.mark.parametrize("kind", [T.IQ2_XS, T.Q2_K, T.Q4_1])
def test_unsupported_type_is_refused_by_name(kind):
    with pytest.raises(quants.UnsupportedTensorType, match=f"blk.0.attn_q.weight has type {kind.name}"):
        quants.quant_type(int(kind), "blk.0.attn_q.weight")
    with pytest.raises(ValueError, match=kind.name):
        quants.quant_type(int(kind))
    assert native.library().specd_act_of(int(kind)) == -1


def test_registry_rows_match_gguf():
    for ggml_type, kind in quants.REGISTRY.items():
        assert (kind.block, kind.type_size) == gguf_quants.GGML_QUANT_SIZES[T(ggml_type)]
        assert quants.quant_type(ggml_type) is kind and T(ggml_type).name == kind.name


def test_march_from_environment(monkeypatch):
    """SPECD_MARCH picks the build (the AVX2 one on an AVX-512 host); anything but a -march name is
    refused before it reaches the compiler's argv."""
    monkeypatch.delenv("SPECD_MARCH", raising=False)
    assert native.default_march() == native.NATIVE
    monkeypatch.setenv("SPECD_MARCH", "haswell")
    assert native.default_march() == "haswell"
    for bad in ("haswell -o /tmp/x", "-fplugin=evil.so", "", "x" * 40):
        monkeypatch.setenv("SPECD_MARCH", bad)
        with pytest.raises(RuntimeError, match="SPECD_MARCH"):
            native.default_march()

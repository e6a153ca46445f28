import pytest
import torch

from specd import native, sparse
from specd.sampling import SamplingParams, top1, warp
from specd.validation import InvalidParams


def test_warp_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert torch.allclose(warp(logits, SamplingParams(temperature=1.0)), torch.exp(logits))
    top2 = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([[5 / 7, 2 / 7, 0, 0, 0]]))
    nucleus = warp(logits, SamplingParams(temperature=1.0, top_p=0.8))  # 0.5 + 0.2 < 0.8 <= 0.85
    assert torch.allclose(nucleus, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]) / 0.85)
    sharp = warp(logits, SamplingParams(temperature=0.5))
    assert sharp[0, 0] > 0.5 and torch.allclose(sharp.sum(), torch.tensor(1.0))


def _rows_with_ties_and_nans() -> torch.Tensor:
    """Rows a 152k vocabulary's logits can hold: ties for the maximum (the first wins), a NaN (it wins,
    the first of two), a head's -inf fill, and a vocabulary not a multiple of the vector width."""
    torch.manual_seed(0)
    rows = torch.randn(5, 151_937) * 4
    rows[0, [9, 70_000, 151_936]] = 30.0
    rows[1, [151_930, 151_936]] = 30.0  # a tie in the last whole vector and in the scalar tail after it
    rows[2, [40, 90_000]] = float("nan")
    rows[3, 1000:] = float("-inf")
    return rows


def test_top1_is_torch_argmax_and_its_softmax_probability():
    if native.loaded() is None:
        pytest.fail(f"specd's C library does not build here: {native.available()}")
    rows = _rows_with_ties_and_nans()
    tokens, p = top1(rows)  # the C library's pass
    assert tokens == rows.argmax(-1).tolist() == [9, 151_930, 40, int(rows[3, :1000].argmax()), int(rows[4].argmax())]
    want = torch.softmax(rows.double(), -1).amax(-1)
    assert torch.allclose(torch.tensor(p, dtype=torch.float64)[[0, 1, 3, 4]], want[[0, 1, 3, 4]], rtol=1e-5)
    assert torch.tensor(p)[2].isnan()
    torch_tokens, torch_p = top1(rows.double())  # torch's path: the same choice
    assert torch_tokens == tokens and torch.allclose(torch.tensor(torch_p, dtype=torch.float64)[[0, 1, 3, 4]], want[[0, 1, 3, 4]])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-0.1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.01),
        SamplingParams(top_k=-1),
        SamplingParams(seed=-1),
    ],
)
def test_invalid_params_are_refused_with_a_message(params):
    with pytest.raises(InvalidParams, match="must be"):
        params.validate()


def test_sparse_round_trip_keeps_the_mass_and_is_deterministic():
    q = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3, 0)
    row = sparse.encode(q)
    decoded = sparse.decode(row, 1000)
    assert row.nbytes <= 6 * sparse.MAX_SUPPORT and row.nbytes < 6 * 1000
    assert float(decoded.sum()) == pytest.approx(1.0)
    assert float((decoded - q.double()).abs().sum()) < 5e-3  # float16 rounding plus the dropped tail
    assert torch.equal(decoded, sparse.decode(sparse.SparseDist(row.token_ids, row.probs), 1000))


def test_sparse_one_hot_is_six_bytes():
    q = torch.zeros(151936)
    q[42] = 1.0
    row = sparse.encode(q)
    assert row.nbytes == 6 and int(sparse.decode(row, 151936).argmax()) == 42


@pytest.mark.parametrize(
    "ids, probs",
    [
        ([1, 2], [0.5]),  # length mismatch
        ([], []),  # empty
        ([1, 1], [0.5, 0.5]),  # duplicate ids
        ([5000], [1.0]),  # outside the vocabulary
        ([1], [float("nan")]),
        ([1, 2], [0.0, 0.0]),
    ],
)
def test_sparse_decode_refuses_malformed_rows(ids, probs):
    row = sparse.SparseDist(
        torch.tensor(ids, dtype=torch.int32).numpy().astype("<i4").tobytes(),
        torch.tensor(probs, dtype=torch.float16).numpy().astype("<f2").tobytes(),
    )
    with pytest.raises(ValueError, match="draft distribution"):
        sparse.decode(row, 1000)


def test_a_top_p_below_float32_range_keeps_the_most_likely_token():
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=5e-324))  # 0.0 as a float32
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_a_temperature_too_small_to_divide_by_decodes_greedily():
    assert SamplingParams(temperature=5e-324).validate().greedy  # logits / 5e-324 would be inf
    assert not SamplingParams(temperature=1e-3).greedy
    probs = warp(torch.tensor([[0.5, 2.0, -1.0, 1.0]]), SamplingParams(temperature=1e-3))
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))

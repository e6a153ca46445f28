"""benchmarks/quality.py (`specd bench --quality`): llama-perplexity's protocol, and the short form of the
run on tiny GGUF files, with transformers on the F32 file as the float32 reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import quality, report
from specd.gguf_model import GGUFModel
from tests.tiny_gguf import hf_logits, write_tiny

CTX = 64


def test_the_scored_rows_are_the_second_half_less_the_last():
    assert list(quality.scored(8)) == [4, 5, 6]  # llama-perplexity: first = n_ctx/2, n_ctx - 1 - first rows
    assert list(quality.scored(768))[::382] == [384, 766] and len(quality.scored(768)) == 383


def test_chunks_are_whole_windows_each_starting_with_bos():
    tokens = list(range(20))
    assert quality.chunks(tokens, 8, bos=99) == [[99, *range(1, 8)], [99, *range(9, 16)]]  # 16..19 dropped
    assert quality.chunks(tokens, 8, bos=None) == [list(range(8)), list(range(8, 16))]
    with pytest.raises(ValueError, match="2 × ctx"):
        quality.chunks(tokens, 11, bos=None)


def test_each_scored_row_scores_the_next_token():
    """A hand-computed case: ctx 8, a vocabulary of 20; row p's logits are 0 but for p at token 3p mod 20."""
    ctx, vocab, bos = 8, 20, 17
    text_chunks = quality.chunks([i % 16 for i in range(20)], ctx, bos)
    asked = []

    def logits(chunk: list[int], keep: int) -> torch.Tensor:
        asked.append((chunk, keep))
        rows = torch.zeros(keep, vocab)
        for r, p in enumerate(range(ctx - keep, ctx)):
            rows[r, 3 * p % vocab] = float(p)
        return rows

    scores = quality.score(logits, text_chunks, ctx)
    assert asked == [(c, 4) for c in text_chunks]  # rows 4..7 of each chunk; row 7 scores nothing
    expected = []
    for chunk in text_chunks:
        row = []
        for j in (4, 5, 6):  # row j against token j + 1
            lse = math.log(vocab - 1 + math.exp(j))
            row.append(lse - (j if chunk[j + 1] == 3 * j % vocab else 0.0))
        expected.append(row)
    np.testing.assert_allclose(scores.nll, expected, rtol=1e-12)
    assert scores.argmax.tolist() == [[12, 15, 18]] * 2
    assert scores.perplexity == pytest.approx(math.exp(np.mean(expected)), rel=1e-12)
    assert scores.running() == pytest.approx([math.exp(np.mean(expected[0])), math.exp(np.mean(expected))])
    with pytest.raises(ValueError, match="scored positions"):
        quality.score_chunk(torch.zeros(2, vocab), text_chunks[0], ctx)


def test_the_sample_is_seeded_sorted_and_scored():
    sample = quality.sample_positions(3, CTX, 20, seed=0)
    assert sample == quality.sample_positions(3, CTX, 20, seed=0) == sorted(set(sample)) and len(sample) == 20
    assert all(c in range(3) and j in quality.scored(CTX) for c, j in sample)
    assert len(quality.sample_positions(1, 8, 68)) == 3  # never more than there are


def test_llama_perplexity_output_is_parsed():
    output = ("perplexity: calculating perplexity over 2 chunks, n_ctx=768, batch_size=768, n_seq=1\n"
              "perplexity: 12.57 seconds per pass - ETA 0.42 minutes\n[1]1.4715,[2]1.4748,\n"
              "Final estimate: PPL = 1.4748 +/- 0.05575\n")
    assert quality.parse_perplexity(output) == (1.4748, [1.4715, 1.4748], 2)
    with pytest.raises(RuntimeError):
        quality.parse_perplexity("failed to load model\n")


def test_llama_perplexity_saved_log_probabilities_are_read(tmp_path):
    """The --kl-divergence-base layout (perplexity.cpp: log_softmax, process_logits): header, tokens, then
    per chunk and scored row the scale and minimum as two floats and a uint16 per token, padded to even."""
    ctx, vocab, n_chunk = 8, 5, 2
    rows, nv = len(quality.scored(ctx)), 2 * ((vocab + 1) // 2) + 4
    top = [[3, 0, 4], [1, 1, 2]]
    data = np.zeros((n_chunk, rows, nv), dtype=np.uint16)
    for c in range(n_chunk):
        for r in range(rows):
            data[c, r, :4] = np.frombuffer(np.array([16 / 65535, -20.0], dtype=np.float32).tobytes(), dtype=np.uint16)
            data[c, r, 4 + top[c][r]] = 65535
            data[c, r, 4 + (top[c][r] + 1) % vocab] = 65535 if (c, r) == (1, 2) else 1000  # one tie
    path = tmp_path / "logits.bin"
    tokens = np.arange(n_chunk * ctx, dtype=np.int32)
    path.write_bytes(b"_logits_" + np.array([ctx, vocab, n_chunk], dtype=np.int32).tobytes() + tokens.tobytes()
                     + data.tobytes())
    n_ctx, saved_tokens, argmax, ties = quality.read_saved(path)
    assert n_ctx == ctx and saved_tokens.tolist() == tokens.tolist()
    assert argmax.tolist() == top and ties == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """An F32 and a Q4_K qwen2 file of the same float model (one seed)."""
    root = tmp_path_factory.mktemp("quality")
    return {kind: write_tiny(root / f"{kind}.gguf", "qwen2", kind, seed=0) for kind in ("F32", "Q4_K")}


def _greedy_text(path: Path, starts: list[int]) -> list[int]:
    """Per chunk, what the float model writes greedily from one token: a text it predicts well, so that
    a quantised model's perplexity on it has room to be worse."""
    model, tokens = GGUFModel(path), []
    for first in starts:
        cache, chunk = model.new_cache(), [first]
        row = model.forward([cache], [chunk], [1])[0]
        while len(chunk) < CTX:
            chunk.append(int(row[-1].argmax()))
            row = model.forward([cache], [chunk[-1:]], [1])[0]
        tokens += chunk
    return tokens


def test_the_short_form_on_tiny_files(tiny, tmp_path):
    tokens = _greedy_text(tiny["F32"], [114, 40, 263])
    texts = {"greedy": quality.Text("greedy", tokens, quality.chunks(tokens, CTX, None))}
    chunked = {name: t.chunks for name, t in texts.items()}
    reference = quality.run_engine(lambda: lambda chunk, keep: hf_logits(tiny["F32"], chunk)[-keep:], chunked, CTX)
    for kind in ("F32", "Q4_K"):
        specd_scores = quality.run_engine(lambda: quality.specd_engine(tiny[kind]), chunked, CTX)
        scores = {"float32": reference, "specd": specd_scores}
        per_text = quality.summarise(texts, scores, CTX, sample=16)
        text = per_text["greedy"]
        assert (text["tokens"], text["chunks"], text["positions"], text["sample"]) == (3 * CTX, 3, 3 * 31, 16)
        specd = text["engines"]["specd"]
        assert set(specd) >= {"perplexity", "ratio", "agreement", "agreement_sample", "per_chunk"}
        assert text["engines"]["float32"]["ratio"] == 1.0 and text["engines"]["float32"]["agreement"] == 1.0
        if kind == "F32":  # specd's engine on the F32 file is transformers' model, to float rounding
            assert specd["ratio"] == pytest.approx(1.0, abs=1e-4)
            assert specd["agreement"] == 1.0 and specd["agreement_sample"] == 1.0
        else:  # the Q4_K file's model is a perturbed one: worse on the float model's own text
            assert math.isfinite(specd["ratio"]) and specd["ratio"] > 1.0
            assert specd["agreement"] < 1.0
    # what the README's block renders from
    (tmp_path / "quality.json").write_text(json.dumps(_result(per_text)))
    block = report.quality("quality")(tmp_path)
    assert f"{specd['ratio']:.4f}" in block and "specd perplexity ≤ 1.012× float32's, every text: not met" in block
    assert quality.goals(per_text)[1]["met"] is None  # no llama.cpp in this run

    # with llama.cpp: a stand-in whose pass is float32's argmax everywhere, at 1.01× its perplexity
    ref = reference["greedy"]
    at_sample = [int(ref.argmax[c, j - CTX // 2]) for c, j in quality.sample_positions(3, CTX, 16)]
    stand_in = lambda **kw: quality.LlamaRun(  # noqa: E731
        perplexity=ref.perplexity * 1.01, per_chunk=[1.0] * 3, chunks=3, ties=0, tokens=3 * CTX,
        all_argmax=ref.argmax, argmax=at_sample, **kw)
    same = quality.summarise(texts, scores, CTX, sample=16,
                             llama={"greedy": stand_in(saved_tokens_match=True, tokens_match=True)})
    llama = same["greedy"]["engines"]["llama.cpp"]
    assert llama["ratio"] == pytest.approx(1.01) and llama["agreement"] == llama["agreement_sample"] == 1.0
    assert llama["only_llama_differs"] == 0 and llama["only_specd_differs"] == specd["differs"]["positions"] > 0
    assert llama["same_argmax_as_specd"] == specd["agreement"]
    goals = quality.goals(same)
    assert "every scored position" in goals[1]["goal"] and goals[1]["met"] is False
    (tmp_path / "quality.json").write_text(json.dumps(_result(same)))
    block = " ".join(report.quality("quality")(tmp_path).split())  # the paragraphs' lines joined
    assert "every text to the same ids as specd" in block
    only = specd["differs"]["positions"]
    assert f"it is specd alone at {only} positions and llama.cpp alone at 0 (greedy)" in block

    # tokenised differently: no ratio, no position-by-position comparison; the goal falls back to the sample
    differ = quality.summarise(texts, scores, CTX, sample=16, llama={"greedy": stand_in(
        saved_tokens_match=False, tokens_match=False, first_difference=5)})
    llama = differ["greedy"]["engines"]["llama.cpp"]
    assert llama["ratio"] is None and llama["agreement"] is None and llama["agreement_sample"] == 1.0
    assert "the sample" in quality.goals(differ)[1]["goal"]
    # ... unless llama-server was asked every position of our tokens
    asked = quality.summarise(texts, scores, CTX, sample=16, llama={"greedy": stand_in(
        saved_tokens_match=False, tokens_match=False, first_difference=5, all_source="llama-server")})
    llama = asked["greedy"]["engines"]["llama.cpp"]
    assert llama["ratio"] is None and llama["agreement"] == 1.0 and llama["argmax_from"] == "llama-server"
    assert llama["server_same_as_perplexity_sample"] is None
    assert "every scored position" in quality.goals(asked)[1]["goal"]
    (tmp_path / "quality.json").write_text(json.dumps(_result(differ)))
    assert "greedy differently from specd (first at token 5" in " ".join(report.quality("quality")(tmp_path).split())


def _result(per_text: dict) -> dict:
    return {"date": "2025-01-01T00:00:00+00:00", "duration_s": 1.0,
            "machine": {"cpu": "test", "cores": 2, "threads": 1, "torch": torch.__version__},
            "settings": {"ctx": CTX, "scored_rows": [32, 63], "sample": 16, "seed": 0, "llama_bin": None},
            "model": {"file": "Q4_K.gguf", "sha256": "0" * 16, "bytes": 1, "architecture": "qwen2",
                      "tensor_types": ["14 Q4_K", "12 F32"], "bos": None},
            "texts": per_text, "goals": quality.goals(per_text)}


def test_the_texts_are_tokenised_as_the_file_says(tiny, tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20 + "\n")
    texts = quality.load_texts(tiny["F32"], [path], 32)
    text = texts["text"]
    assert text.text == path.read_text()[:-1]  # llama-perplexity's -f drops one trailing newline
    assert text.tokens == quality.tokenizer_of(tiny["F32"]).encode(text.text).ids
    assert quality.bos_of(tiny["F32"]) is None  # tiny files say add_bos_token false
    assert text.chunks == quality.chunks(text.tokens, 32, None) and len(text.chunks) == len(text.tokens) // 32


def test_specd_bench_quality_hands_over_to_the_quality_run(monkeypatch):
    from benchmarks import bench

    seen = []
    monkeypatch.setattr(quality, "main", lambda argv=None: seen.append(argv) or 0)
    assert bench.main(["--quality", "--ctx", "64", "--no-llama"]) == 0
    assert seen == [["--quality", "--ctx", "64", "--no-llama"]]


def test_specd_bench_help_lists_quality(capsys):
    from benchmarks import bench

    with pytest.raises(SystemExit) as exited:
        bench.main(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--quality run benchmarks/quality.py instead: teacher-forced perplexity" in shown

"""specd bench --quality: teacher-forced perplexity and next-token agreement with float32, per engine.

    .venv/bin/specd bench --quality [--texts FILE ...] [--ctx 768] [--target PATH] [--no-llama] [--no-float32]
    .venv/bin/python -m benchmarks.quality ...      (the same)

On held-out texts kept in benchmarks/texts/ (see its README: a licence and a standard-library
module, written by none of us), one GGUF file (default: the fetched target) is scored by

- float32: transformers' model of the same file, its weights dequantised to float32 (the reference);
- specd: specd's GGUF engine, the file's tensors run as stored (specd/gguf_model.py), in process;
- llama.cpp: `llama-perplexity` on the same text (its perplexity, and its argmax at every scored
  position from the log-probabilities it saves with --kl-divergence-base), and `llama-server` for
  the argmax at a seeded sample of the scored positions, given our tokens.

The protocol is llama-perplexity's (tools/perplexity/perplexity.cpp, `perplexity`): the text (one
trailing newline dropped, as its `-f` does) is tokenised with the special tokens the file asks for
(a BOS when `tokenizer.ggml.add_bos_token` says so), cut into len // ctx chunks of ctx tokens (the
rest is dropped), each chunk's first token replaced by BOS when the model adds one, each chunk fed
from an empty cache, and in each chunk the logits of rows j in [ctx/2, ctx - 1) score token j + 1.
Perplexity is exp(mean nll) over every scored position of every chunk; `per_chunk` is the running
figure after each chunk, as llama-perplexity prints `[1]x,[2]y,...`.

Agreement: the fraction of scored positions whose argmax equals the float32 model's argmax, over
every scored position and over the sample (`--sample` per text). Where llama.cpp tokenises a text
differently from the file's tokenizer sidecar (the tokens llama-perplexity saves; llama-server's
/tokenize), its perplexity is of its own tokens (no ratio is given) and its argmax at every position
is asked of llama-server instead, on our tokens. The goals the issue set: specd's perplexity at most
1.012× float32's on every text, and its agreement at least llama.cpp's. Writes
benchmarks/results/<name>.json (`python -m benchmarks.report` renders it into benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from benchmarks import llama_server

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ROOT / "benchmarks" / "texts"
DEFAULT_TEXTS = (TEXTS / "apache-2.0.txt", TEXTS / "textwrap_py.txt")
LLAMA_BIN = Path.home() / ".cache" / "specd" / "llama.cpp" / "build" / "bin"
CTX = 768
SAMPLE = 68  # scored positions per text asked of llama-server
SEED = 0
MAX_RATIO = 1.012  # the issue's bound on specd's perplexity against float32's
REFERENCE = "float32"

# (a chunk's tokens, keep) -> float32 logits [keep, vocab] of the chunk's last `keep` rows, fed from an empty cache
Logits = Callable[[list[int], int], torch.Tensor]


# -- the protocol ----------------------------------------------------------------------------------

def read_text(path: Path) -> str:
    """The text as llama-perplexity's `-f` reads it: the file, less one trailing newline."""
    text = Path(path).read_text()
    return text[:-1] if text.endswith("\n") else text


def chunks(tokens: Sequence[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: len(tokens) // ctx windows of ctx tokens (the rest dropped), each one's
    first token replaced by `bos` (when the model adds one)."""
    if len(tokens) < 2 * ctx:
        raise ValueError(f"{len(tokens)} tokens: llama-perplexity needs at least 2 × ctx = {2 * ctx}")
    out = []
    for i in range(len(tokens) // ctx):
        chunk = list(tokens[i * ctx:(i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def scored(ctx: int) -> range:
    """The rows j of a chunk whose logits are scored (against token j + 1): [ctx/2, ctx - 1)."""
    return range(ctx // 2, ctx - 1)


@dataclass
class Scores:
    """One engine on one text: per chunk and scored position, the nll of the next token and the argmax."""

    nll: np.ndarray  # float64 [chunks, positions]
    argmax: np.ndarray  # int64 [chunks, positions]
    margin: np.ndarray | None = None  # float32 [chunks, positions]: top-1 logit minus top-2
    seconds: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(float(self.nll.mean()))

    def running(self) -> list[float]:
        """The perplexity over the chunks so far, after each chunk (llama-perplexity's [1]x,[2]y,...)."""
        sums = np.cumsum(self.nll.sum(axis=1))
        counts = np.arange(1, len(sums) + 1) * self.nll.shape[1]
        return [math.exp(s / c) for s, c in zip(sums, counts)]


def score_chunk(logits: torch.Tensor, chunk: Sequence[int], ctx: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nll, argmax, top-1 minus top-2 logit) of the scored rows, from the logits of the chunk's rows
    [ctx/2, ctx) (the last, which scores nothing, may be left out): row j against token j + 1."""
    rows = scored(ctx)
    logits = logits[:len(rows)]
    if logits.shape[0] != len(rows):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(rows)} scored positions")
    targets = torch.tensor(list(chunk[rows.start + 1:rows.stop + 1]), dtype=torch.int64)
    log_probs = logits.double().log_softmax(-1)  # llama's log_softmax sums expf in double: the same to ~1e-7
    nll = -log_probs.gather(1, targets[:, None])[:, 0]
    top2 = logits.topk(2, dim=-1).values
    return nll.numpy(), logits.argmax(-1).numpy(), (top2[:, 0] - top2[:, 1]).numpy()


def score(logits: Logits, text_chunks: Sequence[Sequence[int]], ctx: int) -> Scores:
    """Feed each chunk from an empty cache and score its second half."""
    keep = ctx - scored(ctx).start
    start = time.perf_counter()
    nll, argmax, margin = [], [], []
    for chunk in text_chunks:
        n, a, m = score_chunk(logits(list(chunk), keep), chunk, ctx)
        nll.append(n)
        argmax.append(a)
        margin.append(m)
    return Scores(np.stack(nll), np.stack(argmax), np.stack(margin), time.perf_counter() - start)


def sample_positions(n_chunks: int, ctx: int, count: int, seed: int = SEED) -> list[tuple[int, int]]:
    """A seeded sample of (chunk, row j) scored positions, in the order a prompt cache likes."""
    population = [(c, j) for c in range(n_chunks) for j in scored(ctx)]
    return sorted(random.Random(seed).sample(population, min(count, len(population))))


def _at(array: np.ndarray, positions: Sequence[tuple[int, int]], ctx: int) -> np.ndarray:
    first = scored(ctx).start
    return np.array([array[c, j - first] for c, j in positions], dtype=np.int64)


# -- the engines -----------------------------------------------------------------------------------

def specd_engine(path: Path) -> Logits:
    """specd's GGUF engine (the file's tensors as stored)."""
    from specd.gguf_model import GGUFModel

    model = GGUFModel(path)

    def logits(chunk: list[int], keep: int) -> torch.Tensor:
        return model.forward([model.new_cache()], [chunk], [keep])[0]

    return logits


def float32_engine(path: Path) -> Logits:
    """transformers' model of the same file, its weights dequantised to float32 (eager attention, the
    reference implementation of every architecture)."""
    from transformers import AutoModelForCausalLM

    path = Path(path).resolve()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval().requires_grad_(False)

    @torch.inference_mode()
    def logits(chunk: list[int], keep: int) -> torch.Tensor:
        out = model(input_ids=torch.tensor([chunk], dtype=torch.int64), use_cache=False, logits_to_keep=keep)
        return out.logits[0].float()

    return logits


def run_engine(load: Callable[[], Logits], texts: dict[str, list[list[int]]], ctx: int) -> dict[str, Scores]:
    """Load an engine, score every text, let it go (the next engine may need its memory)."""
    start = time.perf_counter()
    logits = load()
    loaded = time.perf_counter() - start
    try:
        scores = {name: score(logits, text_chunks, ctx) for name, text_chunks in texts.items()}
    finally:
        del logits
        gc.collect()
    print(f"  loaded in {loaded:.0f} s; " + ", ".join(f"{name}: ppl {s.perplexity:.4f} ({s.seconds:.0f} s)"
                                                      for name, s in scores.items()), flush=True)
    return scores


# -- llama.cpp ------------------------------------------------------------------------------------

@dataclass
class LlamaRun:
    """llama.cpp on one text: llama-perplexity's figures and argmax at every scored position (from the
    log-probabilities it saves), and llama-server's argmax at the sample."""

    perplexity: float | None = None
    per_chunk: list[float] | None = None
    chunks: int | None = None
    seconds: float = 0.0
    all_argmax: np.ndarray | None = None  # [chunks, positions], llama-perplexity's own pass ...
    all_source: str = "llama-perplexity"  # ... or llama-server's, given our tokens, where its tokens differ
    ties: int | None = None  # positions whose top two log-probabilities it saved as equal
    saved_tokens_match: bool | None = None  # the tokens llama-perplexity saved equal ours
    tokens: int | None = None  # llama-server's /tokenize of the same text
    tokens_match: bool | None = None  # ... equal to ours, id for id
    first_difference: int | None = None  # the first token index where they differ
    argmax: list[int] | None = None  # llama-server's, at the sample positions


def parse_perplexity(output: str) -> tuple[float, list[float], int]:
    """(final estimate, running figure per chunk, chunks) from llama-perplexity's output."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+|nan|inf)", output)
    counted = re.search(r"calculating perplexity over (\d+) chunks", output)
    if not final or not counted:
        raise RuntimeError(f"no perplexity in llama-perplexity's output:\n{output[-3000:]}")
    per_chunk = [float(v) for _, v in re.findall(r"\[(\d+)\]([0-9.]+|nan|inf),", output)]
    return float(final.group(1)), per_chunk, int(counted.group(1))


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, threads: int,
                     save: Path | None = None) -> tuple[float, list[float], int, float]:
    """(final estimate, running figure per chunk, chunks, seconds) of `llama-perplexity -c ctx -b ctx`;
    with `save`, it also writes its log-probabilities there (--kl-divergence-base: see read_saved)."""
    command = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    command += ["--kl-divergence-base", str(save)] if save else []
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return (*parse_perplexity(done.stdout + done.stderr), time.perf_counter() - start)


def read_saved(path: Path) -> tuple[int, np.ndarray, np.ndarray, int]:
    """(ctx, tokens, argmax [chunks, positions], ties) from llama-perplexity's --kl-divergence-base file:
    "_logits_", int32 n_ctx, n_vocab, n_chunk, the n_chunk * n_ctx tokens it tokenised (before any BOS
    replacement), then per chunk and scored row nv = 2 * ceil(n_vocab / 2) + 4 uint16: the float32 scale
    and minimum log-probability, and each token's log-probability as round((logit - min) / scale), its
    maximum 65535 at the top logit (so tokens within ~1e-4 of the top come out tied: `ties` counts them)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
    n_ctx, n_vocab, n_chunk = int(n_ctx), int(n_vocab), int(n_chunk)
    tokens = np.fromfile(path, dtype=np.int32, count=n_chunk * n_ctx, offset=20)
    nv, rows = 2 * ((n_vocab + 1) // 2) + 4, len(scored(n_ctx))
    saved = np.memmap(path, dtype=np.uint16, mode="r", offset=20 + 4 * n_chunk * n_ctx, shape=(n_chunk, rows, nv))
    argmax, ties = np.empty((n_chunk, rows), dtype=np.int64), 0
    for c in range(n_chunk):
        values = np.asarray(saved[c, :, 4:4 + n_vocab])
        argmax[c] = values.argmax(-1)
        ties += int(((values == values.max(-1, keepdims=True)).sum(-1) > 1).sum())
    del saved
    return n_ctx, tokens, argmax, ties


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as reply:
        return json.loads(reply.read())


def llama_server_argmax(url: str, chunk: Sequence[int], j: int, cache: bool = True) -> int:
    """llama.cpp's argmax of row j of `chunk` (its raw logits' top token; greedy, one token). `cache`: go on
    from the slot's cached prefix (the caller's last prompt, which must be a prefix of this one)."""
    reply = _post(url + "/completion", {"prompt": list(chunk[:j + 1]), "n_predict": 1, "temperature": 0.0,
                                        "top_k": 1, "n_probs": 1, "cache_prompt": cache, "return_tokens": True})
    probs = reply.get("completion_probabilities") or []
    if probs and probs[0].get("top_logprobs"):
        return int(probs[0]["top_logprobs"][0]["id"])
    return int(reply["tokens"][0])


def _ask(url: str, text_chunks: Sequence[Sequence[int]], positions: Sequence[tuple[int, int]]) -> list[int]:
    """llama-server's argmax at (chunk, row) positions, sorted: each chunk's first from an empty cache, the
    next ones going on from it. (Its cache cut back to another chunk's prefix has been seen to give other
    tokens, at 5 % of Gemma 3's positions, than the same prompts from an empty cache.)"""
    out, last = [], None
    for c, j in positions:
        out.append(llama_server_argmax(url, text_chunks[c], j, cache=last is not None and last[0] == c and last[1] < j))
        last = (c, j)
    return out


def run_llama(bin_dir: Path, gguf: Path, texts: dict[str, "Text"], ctx: int, threads: int,
              samples: dict[str, list[tuple[int, int]]]) -> dict[str, LlamaRun]:
    runs = {name: LlamaRun() for name in texts}
    for name, text in texts.items():
        run = runs[name]
        with tempfile.TemporaryDirectory(prefix="specd-quality-") as tmp:
            saved = Path(tmp) / "logits.bin"
            run.perplexity, run.per_chunk, run.chunks, run.seconds = llama_perplexity(
                bin_dir / "llama-perplexity", gguf, text.path, ctx, threads, saved)
            n_ctx, tokens, run.all_argmax, run.ties = read_saved(saved)
        run.saved_tokens_match = n_ctx == ctx and tokens.tolist() == list(text.tokens[:len(tokens)])
        print(f"  llama-perplexity {name}: {run.perplexity:.4f} over {run.chunks} chunks ({run.seconds:.0f} s); "
              f"its tokens equal ours: {run.saved_tokens_match}; {run.ties} tied top-2", flush=True)
    with llama_server.serve(bin_dir / "llama-server", gguf, threads, context=ctx, swa_full=True) as server:
        url = server.url
        for name, text in texts.items():
            run = runs[name]
            # as llama-perplexity tokenises: common_tokenize(ctx, text, add_special=true, parse_special=false)
            asked = {"content": text.text, "add_special": True, "parse_special": False}
            theirs = _post(url + "/tokenize", asked)["tokens"]
            theirs = [t if isinstance(t, int) else t["id"] for t in theirs]
            run.tokens, run.tokens_match = len(theirs), theirs == list(text.tokens)
            run.first_difference = next((i for i, (a, b) in enumerate(zip(theirs, text.tokens)) if a != b),
                                        None if len(theirs) == len(text.tokens) else min(len(theirs), len(text.tokens)))
            if run.saved_tokens_match is False:  # its pass ran on other tokens: every position of ours, asked
                run.all_argmax = np.array(_ask(url, text.chunks, [(c, j) for c in range(len(text.chunks))
                                                                  for j in scored(ctx)]), dtype=np.int64)
                run.all_argmax = run.all_argmax.reshape(len(text.chunks), len(scored(ctx)))
                run.all_source = "llama-server"
                run.argmax = [int(run.all_argmax[c, j - scored(ctx).start]) for c, j in samples[name]]
            else:
                run.argmax = _ask(url, text.chunks, samples[name])
            print(f"  llama-server {name}: {len(theirs)} tokens (ours {len(text.tokens)}, same ids: "
                  f"{run.tokens_match}); argmax at {len(samples[name])} positions"
                  + (", and at every scored one" if run.all_source == "llama-server" else ""), flush=True)
    return runs


# -- the run --------------------------------------------------------------------------------------

@dataclass
class Text:
    name: str
    tokens: list[int]
    chunks: list[list[int]]
    path: Path | None = None
    text: str | None = None


def tokenizer_of(gguf: Path):
    """The file's tokenizer: its sidecar `<file>.tokenizer.json`, else built from its metadata."""
    from tokenizers import Tokenizer

    from specd import gguf_meta

    sidecar = gguf_meta.tokenizer_sidecar(gguf)
    if sidecar.is_file():
        return Tokenizer.from_file(str(sidecar))
    with gguf_meta.read(gguf) as meta:
        return Tokenizer.from_str(gguf_meta.tokenizer_json(meta))


def bos_of(gguf: Path) -> int | None:
    """The BOS id each chunk starts with, when the file says its model adds one (llama_vocab_get_add_bos)."""
    from specd import gguf_meta

    with gguf_meta.read(gguf) as meta:
        add = meta.get("tokenizer.ggml.add_bos_token")
        if add is None:
            add = meta.get("tokenizer.ggml.model") == "llama"  # sentencepiece vocabularies add one unless told
        return int(meta.get("tokenizer.ggml.bos_token_id")) if add else None


def load_texts(gguf: Path, paths: Sequence[Path], ctx: int) -> dict[str, Text]:
    tokenizer, bos = tokenizer_of(gguf), bos_of(gguf)
    texts = {}
    for path in paths:
        text = read_text(path)
        tokens = tokenizer.encode(text, add_special_tokens=True).ids
        texts[Path(path).stem] = Text(Path(path).stem, tokens, chunks(tokens, ctx, bos), Path(path), text)
    return texts


def _differs(argmax: np.ndarray, reference: Scores) -> dict:
    """Where an engine's argmax is not float32's: how many, and float32's own top-1 minus top-2 logit
    there (small: a near tie that any rounding may flip)."""
    where = argmax != reference.argmax
    gaps = reference.margin[where] if reference.margin is not None else np.array([])
    return {"positions": int(where.sum()),
            "float32_top2_gap": {"median": float(np.median(gaps)), "max": float(gaps.max())} if gaps.size else None}


def _share_equal(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    return None if a is None or b is None else float((a == b).mean())


def _only(a: np.ndarray | None, b: np.ndarray | None, reference: Scores | None) -> int | None:
    """Positions where `a`'s argmax differs from float32's and `b`'s does not."""
    if a is None or b is None or reference is None:
        return None
    return int(((a != reference.argmax) & (b == reference.argmax)).sum())


def summarise(texts: dict[str, Text], scores: dict[str, dict[str, Scores]], ctx: int, sample: int = SAMPLE,
              seed: int = SEED, llama: dict[str, LlamaRun] | None = None) -> dict[str, dict]:
    """Per text: its counts and, per engine, perplexity, ratio to float32's, agreement with float32's
    argmax over every scored position and over the sample, and the running figure per chunk. llama.cpp's
    agreement is llama-perplexity's own pass (every position), its sample agreement llama-server's."""
    out = {}
    for name, text in texts.items():
        n_chunks = len(text.chunks)
        positions = sample_positions(n_chunks, ctx, sample, seed)
        reference = scores.get(REFERENCE, {}).get(name)
        ref_ppl = reference.perplexity if reference else None
        ref_at = _at(reference.argmax, positions, ctx) if reference else None
        engines = {}
        for engine, by_text in scores.items():
            s = by_text[name]
            engines[engine] = {
                "perplexity": s.perplexity,
                "ratio": s.perplexity / ref_ppl if ref_ppl else None,
                "agreement": _share_equal(s.argmax, reference.argmax if reference else None),
                "agreement_sample": _share_equal(_at(s.argmax, positions, ctx), ref_at),
                "differs": _differs(s.argmax, reference) if reference else None,
                "per_chunk": s.running(),
                "seconds": round(s.seconds, 1),
            }
        run = (llama or {}).get(name)
        if run is not None:
            ours = scores["specd"][name].argmax if "specd" in scores else None
            server = np.array(run.argmax, dtype=np.int64) if run.argmax is not None else None
            # llama-perplexity's pass is comparable position by position only on the same tokens; else its
            # perplexity is of its own tokenisation (no ratio), its agreement llama-server's at the sample
            same_tokens = run.saved_tokens_match is not False
            whole = run.all_argmax if same_tokens or run.all_source == "llama-server" else None
            engines["llama.cpp"] = {
                "perplexity": run.perplexity,
                "ratio": run.perplexity / ref_ppl if ref_ppl and run.perplexity is not None and same_tokens else None,
                "agreement": _share_equal(whole, reference.argmax if reference else None),
                "agreement_sample": _share_equal(server, ref_at),
                "differs": _differs(whole, reference) if reference and whole is not None else None,
                "per_chunk": run.per_chunk,
                "seconds": round(run.seconds, 1),
                "chunks": run.chunks,
                "argmax_from": run.all_source if whole is not None else None,
                "tied_top2": run.ties,
                "saved_tokens_match": run.saved_tokens_match,
                "tokens": run.tokens,
                "tokens_match": run.tokens_match,
                "first_token_difference": run.first_difference,
                "same_argmax_as_specd": _share_equal(whole, ours),
                # positions only one of the two gets wrong (against float32): what decides their difference
                "only_specd_differs": _only(ours, whole, reference),
                "only_llama_differs": _only(whole, ours, reference),
                "same_argmax_as_specd_sample": _share_equal(server, _at(ours, positions, ctx) if ours is not None
                                                            else None),
                "server_same_as_perplexity_sample": _share_equal(server, _at(whole, positions, ctx))
                if whole is not None and run.all_source == "llama-perplexity" else None,
            }
        out[name] = {
            "file": _relative(text.path) if text.path else None,
            "sha256": _sha256(text.path)[:16] if text.path else None,
            "tokens": len(text.tokens),
            "chunks": n_chunks,
            "positions": n_chunks * len(scored(ctx)),
            "sample": len(positions),
            "engines": engines,
        }
    return out


def goals(per_text: dict[str, dict]) -> list[dict]:
    """The issue's two goals, on every text (None where an engine did not run). Agreement is compared
    over every scored position where llama.cpp's pass gave its argmax there, else over the sample."""
    specd = [t["engines"].get("specd", {}) for t in per_text.values()]
    llama = [t["engines"].get("llama.cpp", {}) for t in per_text.values()]
    ratios = [e.get("ratio") for e in specd]
    whole = all(e.get("agreement") is not None for e in llama)
    key = "agreement" if whole else "agreement_sample"
    ours, theirs = [e.get(key) for e in specd], [e.get(key) for e in llama]
    met_ratio = None if None in ratios else all(r <= MAX_RATIO for r in ratios)
    met_agree = None if None in ours + theirs else all(a >= b for a, b in zip(ours, theirs))
    over = "every scored position" if whole else "the sample"
    return [{"goal": f"specd perplexity ≤ {MAX_RATIO}× float32's, every text", "measured": ratios, "met": met_ratio},
            {"goal": f"specd argmax agreement with float32 ≥ llama.cpp's ({over}), every text",
             "measured": {"specd": ours, "llama.cpp": theirs}, "met": met_agree}]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _relative(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def code_state() -> dict:
    """Which specd ran: the commit, and a digest of specd's sources as they were (the tree may differ from it)."""
    digest = hashlib.sha256()
    for path in sorted([*(ROOT / "specd").rglob("*.py"), *(ROOT / "specd" / "csrc").glob("*.[ch]")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "specd"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip() != ""
    except OSError:
        commit, dirty = "", None
    return {"commit": commit or None, "specd_modified": dirty, "specd_sources_sha256": digest.hexdigest()[:16]}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        found = re.search(r"^Model name:\s*(.+)$", out, re.MULTILINE)
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return "unknown"


def measure(target: Path, text_paths: Sequence[Path], ctx: int = CTX, threads: int | None = None,
            float32: bool = True, llama_bin: Path | None = LLAMA_BIN, sample: int = SAMPLE, seed: int = SEED) -> dict:
    """The whole run on one GGUF file: float32, then specd, then llama.cpp, one at a time."""
    from specd.gguf_model import GGUFModel

    started, wall = datetime.now(timezone.utc), time.perf_counter()
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    code = code_state()  # before the engines run: the sources they were built from
    texts = load_texts(target, text_paths, ctx)
    for text in texts.values():
        print(f"{text.name}: {len(text.tokens)} tokens, {len(text.chunks)} chunks of {ctx}", flush=True)
    chunked = {name: text.chunks for name, text in texts.items()}
    probe = GGUFModel(target)
    model_info = {"file": target.name, "sha256": _sha256(target)[:16], "bytes": target.stat().st_size,
                  "architecture": probe.architecture, "tensor_types": probe.tensor_types(),
                  "bos": bos_of(target)}
    del probe
    scores: dict[str, dict[str, Scores]] = {}
    if float32:
        print("float32 (transformers, the file dequantised) ...", flush=True)
        scores[REFERENCE] = run_engine(lambda: float32_engine(target), chunked, ctx)
    print("specd (GGUF engine) ...", flush=True)
    scores["specd"] = run_engine(lambda: specd_engine(target), chunked, ctx)
    llama = None
    if llama_bin is not None:
        print("llama.cpp ...", flush=True)
        samples = {name: sample_positions(len(t.chunks), ctx, sample, seed) for name, t in texts.items()}
        llama = run_llama(Path(llama_bin), target, texts, ctx, threads, samples)
    per_text = summarise(texts, scores, ctx, sample, seed, llama)
    return {
        "date": started.isoformat(timespec="seconds"),
        "duration_s": round(time.perf_counter() - wall, 1),
        "code": code,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__},
        "settings": {"ctx": ctx, "scored_rows": [scored(ctx).start, scored(ctx).stop], "sample": sample, "seed": seed,
                     "llama_bin": str(llama_bin) if llama_bin else None},
        "model": model_info,
        "texts": per_text,
        "goals": goals(per_text),
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks import common
    from services import models

    parser = argparse.ArgumentParser(prog="specd bench --quality", description=__doc__.splitlines()[0])
    parser.add_argument("--quality", action="store_true", help=argparse.SUPPRESS)  # passed on by `specd bench`
    parser.add_argument("--texts", type=Path, nargs="+", default=list(DEFAULT_TEXTS), help="held-out texts "
                        "(default: benchmarks/texts/apache-2.0.txt, textwrap_py.txt)")
    parser.add_argument("--ctx", type=int, default=CTX, help="tokens per chunk (llama-perplexity's -c)")
    parser.add_argument("--target", type=Path, help="the GGUF file (default: the fetched target)")
    parser.add_argument("--no-llama", action="store_true", help="skip llama.cpp (llama-perplexity, llama-server)")
    parser.add_argument("--no-float32", action="store_true",
                        help="skip the float32 reference (no ratios, no agreement)")
    parser.add_argument("--llama-bin", type=Path, default=LLAMA_BIN, help="the folder of llama-perplexity and "
                        "llama-server (../shared/tools/build-llama-server)")
    parser.add_argument("--sample", type=int, default=SAMPLE, help="scored positions per text asked of llama-server")
    parser.add_argument("--seed", type=int, default=SEED, help="of the sample")
    parser.add_argument("--threads", type=int, help="threads of every engine (default: all cores)")
    parser.add_argument("--name", default="quality", help="result name under benchmarks/results/")
    args = parser.parse_args(argv)
    target = args.target or models.model_path("target")
    result = measure(target, args.texts, args.ctx, args.threads, not args.no_float32,
                     None if args.no_llama else args.llama_bin, args.sample, args.seed)
    for name, text in result["texts"].items():
        for engine, e in text["engines"].items():
            print(f"{name:>12} {engine:>9}: ppl {e['perplexity']:.4f}  ratio {_fmt(e['ratio'])}  agreement "
                  f"{_fmt(e['agreement'])} (sample {_fmt(e['agreement_sample'])})")
    print(json.dumps(result["goals"], indent=2))
    print(f"wrote {common.write(args.name, result)}")
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    sys.exit(main())

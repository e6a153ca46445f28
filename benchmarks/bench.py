"""specd bench: plain, fixed-K, adaptive and Hugging Face assisted decoding, compared in one run.

One program: its steps (prompts, HF in process, the services, llama-server, the lossless check) in the order a run takes them; over 350 lines for that.

    .venv/bin/specd bench [--tokens 64] [--ks 1,2,4,8] [--prompts-per-class 1] [--concurrency 8] [--repeats 1]
    .venv/bin/python -m benchmarks.bench ...      (the same)

Prompts (benchmarks/prompts.json) come in three classes: code, prose (stories), chat (through the
target's chat template). All are tokenized here with the target's tokenizer and sent as token ids,
so every configuration, HF included, sees exactly the same prompt.

1. Hugging Face assisted generation runs first, in this process, while no service is up:
   `target.generate(assistant_model=draft, do_sample=False)` on the models *as the services build
   them* (transformers reading the same files in float32, dequantised; the draft in int8), plus HF plain decoding.
2. Then the services (`specd up` on free ports, or `--address` of running ones), requests one
   after another, streamed (`Generate`): plain target decoding (`speculation: false`), each fixed K,
   adaptive K. Before a prompt's runs two tiny probes measure the prompt's prefill on each service
   (plain, 1 token: the target's; K = 1, 2 tokens: the draft's), so the per-step times below are
   steady-state decoding, not diluted by one prefill per request.
3. Concurrency: N sessions at once vs the same N one after another (adaptive K).

`--repeats R` runs steps 1 and 2 R times, interleaved (every configuration once, then again), and
pools each configuration's requests: its tokens/s is all its tokens over all its seconds. On a
shared machine one slow minute (a neighbour's load, a verification at 1.4 s instead of 0.9 s)
moves a single request's figure by 30 %; pooled repeats spread it over every configuration.

Every greedy output must equal plain decoding's (services' plain run) token for token, HF assisted
and the concurrent runs included; otherwise the result is still written and the run exits non-zero.

Reported per class and configuration: tokens/s and speedup vs plain (end to end, prefill included;
and the decode phase after the first token), α = accepted / judged drafts, mean acceptance length,
TTFT, TPOT p50/p99 (each token of a streamed chunk is charged the chunk's gap / its token count),
rounds; the theoretical speedup S(K) = E(α,K)·T_plain / (K·draft_step + verify(K)) of
specd/policy/cost.py from the measured α and step times; the coordinator+gRPC+Redis overhead per round
(round wall time minus model compute) as a fraction of one target step. Writes
benchmarks/results/<name>.json and <name>_speedup.png, <name>_tpot.png."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks import common, llama_server
from benchmarks.common import machine, rss_bytes, specd_up, vector_extensions, write
from benchmarks.summary import (
    HF_ASSISTED, HF_PLAIN, LLAMA_NGRAM, LLAMA_PLAIN, LLAMA_SPEC, PLAIN, Measured, class_summary, goals, plot, rounded,
    STAT_FIELDS, service_configs,
)
from services.coordinator.model_info import load_model_info
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from specd import kernels
from services import models
from services.models import fetch

PROMPTS = Path(__file__).resolve().parent / "prompts.json"


@dataclass(frozen=True)
class Prompt:
    name: str
    kind: str  # code | prose | chat
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class BenchConfig:
    tokens: int = 64
    ks: tuple[int, ...] = (1, 2, 4, 8)
    prompts_per_class: int = 1
    concurrency: int = 8
    repeats: int = 1  # of the HF and service runs, interleaved; figures pool the repeats
    address: str | None = None  # running coordinator; None: start `specd up` on free ports
    up_flags: tuple[str, ...] = ()  # extra `specd up` flags
    draft_dir: Path | None = None  # None: the fetched pair (`specd models fetch`)
    target_dir: Path | None = None
    hf: bool = True
    llama_server: Path | None = None  # llama.cpp's llama-server binary: its plain, speculative and n-gram runs too
    draft_model: bool = True  # False: the target alone (`specd up --draft-replicas 0`), the model-free drafter's
    threads: int = os.cpu_count() or 1  # llama-server's threads (specd's are its services' own settings)
    prompts: Path = PROMPTS
    name: str = "bench"  # benchmarks/results/<name>.json and plots
    progress: bool = True


class LosslessViolation(SystemExit):
    pass


# --- prompts -------------------------------------------------------------------------------


def load_prompts(target: Path, per_class: int, path: Path = PROMPTS) -> list[Prompt]:
    """Tokenised as the coordinator tokenises (a GGUF file or an HF directory alike)."""
    model = load_model_info(target)
    prompts = []
    for kind, entries in json.loads(path.read_text()).items():
        for entry in entries[:per_class]:
            prompts.append(Prompt(entry["name"], kind, tuple(_tokenize(model, entry))))
    return prompts


def _tokenize(model, entry: dict) -> list[int]:
    if "messages" in entry:  # chat: the template the REST chat endpoint applies too
        return model.chat_prompt(entry["messages"])
    return model.encode(entry["text"])


# --- Hugging Face assisted generation, in process -----------------------------------------


class _Arrivals(BaseStreamer):
    """Arrival time of every batch of tokens `generate` emits (the first `put` is the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.times: list[tuple[float, int]] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append((time.perf_counter() - self.start, value.numel()))
        self._prompt_seen = True

    def end(self) -> None:
        pass


def hf_models(draft_dir: Path, target_dir: Path):
    """The pair as a Hugging Face user runs it on a CPU: transformers' float32 reading of the same
    files (a GGUF dequantised), the draft in dynamic int8, the small-row linears specd's dense path uses."""
    target, draft = _hf_model(target_dir), kernels.quantize_int8(_hf_model(draft_dir))
    for model in (target, draft):
        kernels.use_small_row_matmul(model)
    eos = sorted(load_model_info(target_dir).eos_token_ids)
    return target, draft, eos


def _hf_model(path: Path):
    where = dict(pretrained_model_name_or_path=path.parent, gguf_file=path.name) if path.is_file() else \
        dict(pretrained_model_name_or_path=path)
    return AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()


def hf_generate(models, prompt: Prompt, tokens: int, assisted: bool) -> Measured:
    target, draft, eos = models
    ids = torch.tensor([prompt.token_ids])
    streamer = _Arrivals()
    with torch.inference_mode():
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
            eos_token_id=eos, pad_token_id=eos[0], assistant_model=draft if assisted else None, streamer=streamer,
        )
    wall = time.perf_counter() - streamer.start
    output = tuple(out[0, len(prompt.token_ids) :].tolist())
    config = HF_ASSISTED if assisted else HF_PLAIN
    return Measured(config, prompt.name, prompt.kind, output, wall, tuple(streamer.times))


def hf_runs(cfg: BenchConfig, prompts: list[Prompt], draft_dir: Path, target_dir: Path, bar) -> list[Measured]:
    models = hf_models(draft_dir, target_dir)
    warm = Prompt("warmup", "warmup", prompts[0].token_ids)
    for assisted in (False, True):  # the first call of each kind pays for allocations
        hf_generate(models, warm, 4, assisted)
    runs = []
    for prompt in prompts * cfg.repeats:
        for assisted in (False, True):
            bar.set_description(f"HF {'assisted' if assisted else 'plain'} {prompt.name}")
            runs.append(hf_generate(models, prompt, cfg.tokens, assisted))
            bar.update()
    del models
    gc.collect()
    return runs


# --- through the services ------------------------------------------------------------------


def stream(stub, config: str, prompt: Prompt, tokens: int, **fields) -> Measured:
    request = coordinator_pb2.GenerateRequest(
        token_ids=coordinator_pb2.TokenIds(ids=prompt.token_ids), max_tokens=tokens, **fields
    )
    output, arrivals, stats = [], [], None
    start = time.perf_counter()
    for reply in stub.Generate(request, timeout=3600):
        if reply.token_ids:
            arrivals.append((time.perf_counter() - start, len(reply.token_ids)))
            output += reply.token_ids
        if reply.finish_reason:
            stats = reply.stats
    wall = time.perf_counter() - start
    numbers = {name: getattr(stats, name) for name in STAT_FIELDS}
    if not fields:  # adaptive: where the policy ended (a pinned K or plain request leaves it as inherited)
        numbers["mode"] = stats.mode
    return Measured(config, prompt.name, prompt.kind, tuple(output), wall, tuple(arrivals), numbers)


def prefill_probes(stub, prompt: Prompt) -> dict[str, float]:
    """Model time of the prompt's prefill on each service: a request's first round pays it."""
    target = stream(stub, "probe", prompt, 1, speculation=False)
    draft = stream(stub, "probe", prompt, 2, num_draft_tokens=1)
    return {"target_s": target.stats["verify_compute_s"], "draft_s": draft.stats["draft_compute_s"]}


def warm_up(stub, prompt: Prompt) -> None:
    """First calls pay for allocations; the adaptive warm-up leaves the deployment timings to inherit."""
    for fields in ({}, {"speculation": False}):
        stream(stub, "warmup", prompt, 16, **fields)


def service_runs(stub, cfg: BenchConfig, prompts: list[Prompt], bar, peers: dict[str, str]) -> tuple[list[Measured], dict]:
    """specd's configurations and then the llama-server peers (config -> URL) on each prompt in turn."""
    warm_up(stub, prompts[0])
    for url in peers.values():
        llama_server.stream(url, prompts[0].token_ids, 16)
    runs, probes = [], {}
    for prompt in prompts * cfg.repeats:
        if prompt.name not in probes:
            probes[prompt.name] = prefill_probes(stub, prompt)
        for config, fields in service_configs(cfg.ks, cfg.draft_model).items():
            bar.set_description(f"{config} {prompt.name}")
            runs.append(stream(stub, config, prompt, cfg.tokens, **fields))
            bar.update()
        for config, url in peers.items():
            bar.set_description(f"{config} {prompt.name}")
            runs.append(peer_stream(url, config, prompt, cfg.tokens))
            bar.update()
    return runs, probes


def peer_stream(url: str, config: str, prompt: Prompt, tokens: int) -> Measured:
    output, wall, arrivals = llama_server.stream(url, prompt.token_ids, tokens)
    return Measured(config, prompt.name, prompt.kind, output, wall, arrivals)


def concurrency_runs(stub, cfg: BenchConfig, prompts: list[Prompt], bar) -> dict:
    """N adaptive sessions one after another, then the same N at once: aggregate tokens/s."""
    batch = [prompts[i % len(prompts)] for i in range(cfg.concurrency)]
    start = time.perf_counter()
    sequential = []
    for prompt in batch:
        bar.set_description(f"sequential {prompt.name}")
        sequential.append(stream(stub, "sequential", prompt, cfg.tokens))
        bar.update()
    sequential_s = time.perf_counter() - start
    bar.set_description(f"{cfg.concurrency} concurrent")
    start = time.perf_counter()
    with ThreadPoolExecutor(cfg.concurrency) as pool:
        concurrent = list(pool.map(lambda p: stream(stub, "concurrent", p, cfg.tokens), batch))
    concurrent_s = time.perf_counter() - start
    bar.update(cfg.concurrency)
    tokens = sum(len(r.output) for r in concurrent)
    result = {
        "sessions": cfg.concurrency,
        "sequential_tokens_per_s": round(sum(len(r.output) for r in sequential) / sequential_s, 3),
        "concurrent_tokens_per_s": round(tokens / concurrent_s, 3),
        "ratio": round((tokens / concurrent_s) / (sum(len(r.output) for r in sequential) / sequential_s), 3),
        "runs": sequential + concurrent,
    }
    if cfg.llama_server:
        result |= _llama_concurrent(cfg, batch)
    return result


def _llama_concurrent(cfg: BenchConfig, batch: list[Prompt]) -> dict:
    """The same N requests at once against `llama-server -np N` (plain), aggregate tokens/s."""
    target_gguf, _ = gguf_files()
    with llama_server.serve(cfg.llama_server, target_gguf, cfg.threads, parallel=cfg.concurrency) as server:
        llama_server.stream(server.url, batch[0].token_ids, 8)
        start = time.perf_counter()
        with ThreadPoolExecutor(cfg.concurrency) as pool:
            runs = list(pool.map(lambda p: peer_stream(server.url, LLAMA_PLAIN, p, cfg.tokens), batch))
        seconds = time.perf_counter() - start
        rss = rss_bytes(server.pid)
    ours = sum(len(r.output) for r in runs) / seconds
    return {"llama_concurrent_tokens_per_s": round(ours, 3), "llama_concurrent_rss_gb": round(rss / 1e9, 2)}


@contextmanager
def coordinator(cfg: BenchConfig, draft_dir: Path, target_dir: Path) -> Iterator:
    """A coordinator stub and the resident memory of each local service (a callable: bytes by role)."""
    if cfg.address:
        with grpc.insecure_channel(cfg.address) as channel:
            yield coordinator_pb2_grpc.CoordinatorStub(channel), dict  # remote services: memory unknown
        return
    flags = ("--draft-model", str(draft_dir), "--target-model", str(target_dir), *cfg.up_flags,
             *(() if cfg.draft_model else ("--draft-replicas", "0")))
    with specd_up(*flags) as up:
        yield up.stub, up.rss


@contextmanager
def peers(cfg: BenchConfig) -> Iterator[dict[str, llama_server.Server]]:
    """llama-server plain, speculative (the draft model) and n-gram on the pair's GGUF files, when the
    bench has a binary."""
    if cfg.llama_server is None:
        yield {}
        return
    target_gguf, draft_gguf = gguf_files()
    with llama_server.serve(cfg.llama_server, target_gguf, cfg.threads) as plain, \
            llama_server.serve(cfg.llama_server, target_gguf, cfg.threads, draft_gguf=draft_gguf) as speculative, \
            llama_server.serve(cfg.llama_server, target_gguf, cfg.threads, spec_args=llama_server.NGRAM_ARGS) as ngram:
        yield {LLAMA_PLAIN: plain, LLAMA_SPEC: speculative, LLAMA_NGRAM: ngram}


def gguf_files() -> tuple[Path, Path]:
    """The verified GGUF files of the target and the draft (downloaded again if fetch removed them)."""
    return models.gguf_path("target"), models.gguf_path("draft")


# --- losslessness --------------------------------------------------------------------------


def peer_lossless(runs: list[Measured], config: str = LLAMA_SPEC) -> dict[str, bool]:
    """Per prompt: llama-server's speculative greedy text (`config`) equals its own plain text (its kernels
    are not batch-invariant: this is a measurement, not a check specd's runs must pass)."""
    plain = {r.prompt: r.output for r in runs if r.config == LLAMA_PLAIN}
    return {r.prompt: r.output == plain[r.prompt] for r in runs if r.config == config}


def mismatches(reference: dict[str, tuple[int, ...]], runs: list[Measured]) -> list[str]:
    """Every run whose output differs from plain decoding's for its prompt, said where."""
    problems = []
    for run in runs:
        expected = reference[run.prompt]
        if run.output != expected:
            shorter = min(len(run.output), len(expected))
            at = next((i for i, (a, b) in enumerate(zip(run.output, expected)) if a != b), shorter)
            problems.append(
                f"{run.config} on {run.prompt}: differs from plain decoding at output token {at} "
                f"(got {list(run.output[at:at + 4])}, plain has {list(expected[at:at + 4])}; "
                f"lengths {len(run.output)} vs {len(expected)})"
            )
    return problems


# --- the run -------------------------------------------------------------------------------


def run(cfg: BenchConfig) -> dict:
    """Run everything, write the JSON and plots; raise LosslessViolation after writing if any
    output differs from plain decoding."""
    started = time.perf_counter()
    draft_dir, target_dir = _model_dirs(cfg)
    prompts = load_prompts(target_dir, cfg.prompts_per_class, cfg.prompts)
    per_prompt = len(service_configs(cfg.ks, cfg.draft_model)) + 2 * cfg.hf + 3 * (cfg.llama_server is not None)
    total = cfg.repeats * len(prompts) * per_prompt + 2 * cfg.concurrency
    with tqdm(total=total, unit="req", disable=not cfg.progress) as bar:
        hf = hf_runs(cfg, prompts, draft_dir, target_dir, bar) if cfg.hf else []
        with coordinator(cfg, draft_dir, target_dir) as (stub, memory), peers(cfg) as servers:
            runs, probes = service_runs(stub, cfg, prompts, bar, {name: s.url for name, s in servers.items()})
            rss = {role: round(size / 1e9, 2) for role, size in memory().items()}
            rss |= {name: round(rss_bytes(s.pid) / 1e9, 2) for name, s in servers.items()}
            scaling = concurrency_runs(stub, cfg, prompts, bar) if cfg.concurrency > 0 else None
    result = _result(cfg, prompts, runs + hf, probes, scaling, time.perf_counter() - started, rss)
    write(cfg.name, result)
    if problems := result["lossless"]["mismatches"]:
        raise LosslessViolation("LOSSLESS VIOLATION: " + "; ".join(problems))
    return result


def _model_dirs(cfg: BenchConfig) -> tuple[Path, Path]:
    if cfg.draft_dir and cfg.target_dir:
        return cfg.draft_dir, cfg.target_dir
    paths = fetch()
    return cfg.draft_dir or paths["draft"], cfg.target_dir or paths["target"]


def _result(cfg, prompts, runs, probes, scaling, duration_s, rss) -> dict:
    # Each deployment against its own plain decoding: the services' numerics (the file's blocks) are
    # not Hugging Face's float32, which the HF configurations run.
    reference = {r.prompt: r.output for r in runs if r.config == PLAIN}
    hf_reference = {r.prompt: r.output for r in runs if r.config == HF_PLAIN}
    others = (LLAMA_PLAIN, LLAMA_SPEC, LLAMA_NGRAM, HF_PLAIN, HF_ASSISTED)
    ours = [r for r in runs + (scaling["runs"] if scaling else []) if r.config not in others]
    hf_assisted = [r for r in runs if r.config == HF_ASSISTED]
    classes = {kind: class_summary(kind, runs, probes, cfg.ks) for kind in dict.fromkeys(p.kind for p in prompts)}
    plots = plot(classes, runs, cfg.name)
    return {
        # Above ~2 on a 2-core machine, something besides this benchmark was using the cores.
        "machine": machine() | {"load_average_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()]},
        "settings": {
            "tokens": cfg.tokens, "ks": list(cfg.ks), "prompts": {p.name: p.kind for p in prompts},
            "concurrency": cfg.concurrency, "repeats": cfg.repeats, "greedy": True,
            "services": cfg.address or "specd up " + " ".join(cfg.up_flags) + ("" if cfg.draft_model else " --draft-replicas 0"),
            "threads": {role: _flag(cfg.up_flags, f"--{role}-threads") or f"torch default ({os.cpu_count()} cores)"
                        for role in ("draft", "target")},
            "llama_server": cfg.llama_server and f"{cfg.llama_server} -t {cfg.threads} (plain; speculative adds "
                                                 f"--spec-type draft-simple -md DRAFT --spec-draft-n-max {llama_server.SPEC_DRAFT_MAX}"
                                                 f"; n-gram adds {' '.join(llama_server.NGRAM_ARGS)})",
            "hf_assisted": "transformers generate(assistant_model=draft, do_sample=False), default "
                           "num_assistant_tokens=20, schedule constant, assistant_confidence_threshold=0.4; "
                           "the same files read by transformers (float32 target, dequantised; int8 draft)",
        },
        "duration_s": round(duration_s, 1),
        "lossless": {"checked": len(ours) + len(hf_assisted),
                     "mismatches": mismatches(reference, ours) + mismatches(hf_reference, hf_assisted),
                     "llama_spec_equals_its_plain": peer_lossless(runs),
                     "llama_ngram_equals_its_plain": peer_lossless(runs, LLAMA_NGRAM)},
        "rss_gb": rss,
        "classes": classes,
        "concurrency": scaling and {k: v for k, v in scaling.items() if k != "runs"},
        "goals": goals(classes, scaling, rss, vector_extensions()),
        "prefill_probes_s": rounded(probes),
        "runs": [_run_json(r) for r in runs + (scaling["runs"] if scaling else [])],
        "plots": [p.name for p in plots],  # next to this file
    }


def _flag(flags: tuple[str, ...], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _run_json(run: Measured) -> dict:
    return {
        "config": run.config, "prompt": run.prompt, "class": run.kind, "tokens": len(run.output),
        "wall_s": round(run.wall_s, 3), "ttft_s": round(run.ttft_s, 3), "chunks": len(run.arrivals),
        **rounded(run.stats),
    }


# --- command line --------------------------------------------------------------------------


def _positive(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import load, quality, round_parts

    args = sys.argv[1:] if argv is None else list(argv)
    if "--quality" in args:  # perplexity and agreement: benchmarks/quality.py
        return quality.main(args)
    if "--round-parts" in args:  # where a round's time goes: benchmarks/round_parts.py
        return round_parts.main(args)
    if "--load" in args:  # adaptive against plain with N sessions at once: benchmarks/load.py
        return load.main(args)
    parser = argparse.ArgumentParser(prog="specd bench", description=__doc__.splitlines()[0])
    # Handed over above, before this parser reads anything: listed so that `specd bench -h` tells of it.
    summary = quality.__doc__.splitlines()[0].removeprefix("specd bench --quality: ")
    parser.add_argument("--quality", action="store_true",
                        help=f"run benchmarks/quality.py instead: {summary} Its flags: --quality -h")
    parser.add_argument("--load", action="store_true",
                        help="run benchmarks/load.py instead: adaptive against plain with 8 and 16 sessions at "
                             "once. Its flags: --load -h")
    parser.add_argument("--round-parts", action="store_true",
                        help="run benchmarks/round_parts.py instead: where a round's time goes (target pass, "
                             "queue, RPC, save, coordinator, delivery). Its flags: --round-parts -h")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--ks", default="1,2,4,8", help="fixed K values to compare (1..8)")
    parser.add_argument("--prompts-per-class", type=int, default=1, help="of benchmarks/prompts.json")
    parser.add_argument("--concurrency", type=int, default=8, help="sessions in the concurrency scenario (0: skip)")
    parser.add_argument("--repeats", type=_positive, default=1, help="runs of every HF and service configuration, "
                        "interleaved; figures pool them")
    parser.add_argument("--address", help="coordinator host:port of running services (default: start specd up)")
    parser.add_argument("--draft-model", "--draft-model-dir", type=Path,
                        help="a GGUF file or HF directory (default: the fetched draft; --draft-model-dir: the old name)")
    parser.add_argument("--target-model", "--target-model-dir", type=Path,
                        help="a GGUF file or HF directory (default: the fetched target; --target-model-dir: the old name)")
    parser.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation")
    parser.add_argument("--name", default="bench", help="result name under benchmarks/results/")
    parser.add_argument("--draft-threads", type=int, help="torch threads of the draft service (default: all cores)")
    parser.add_argument("--target-threads", type=int, help="torch threads of the target service (default: all cores)")
    parser.add_argument("--core-turns", default="on", choices=("on", "off"),
                        help="the draft and target services take turns at the cores (specd up's default)")
    parser.add_argument("--draft-confidence", help="adaptive K's confidence stop (default: the coordinator's)")
    parser.add_argument("--audit-rate", default="0", help="the coordinator's lossless audit (default 0 here: its "
                        "background re-decodes would share the cores with the requests being timed)")
    parser.add_argument("--target-quantize", help="the target's numerics: none | auto (default: specd up's)")
    parser.add_argument("--draft-quantize", help="the draft's numerics: none | int8 | auto | q4_0 (default: specd up's)")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary (../shared/tools/"
                        "build-llama-server): run it plain and speculative on the same GGUF files, side by side")
    parser.add_argument("--prompts", type=Path, default=PROMPTS, help="prompt set (benchmarks/prompts.json; "
                        "held out: benchmarks/prompts_heldout.json; output that repeats its context: "
                        "benchmarks/prompts_repeat.json, held out: prompts_repeat_heldout.json)")
    parser.add_argument("--target-alone", action="store_true", help="no draft model (specd up --draft-replicas 0): "
                        "plain and adaptive, whose drafts are the model-free drafter's")
    args = parser.parse_args(argv)
    up_flags = ("--core-turns", args.core_turns, "--audit-rate", args.audit_rate) + tuple(
        ("--draft-confidence", args.draft_confidence) if args.draft_confidence is not None else ()
    ) + tuple(
        arg for role in ("draft", "target") if getattr(args, f"{role}_quantize")
        for arg in (f"--{role}-quantize", getattr(args, f"{role}_quantize"))
    ) + tuple(
        arg for role in ("draft", "target") if getattr(args, f"{role}_threads")
        for arg in (f"--{role}-threads", str(getattr(args, f"{role}_threads")))
    )
    cfg = BenchConfig(
        tokens=args.tokens, ks=tuple(int(k) for k in args.ks.split(",")), prompts_per_class=args.prompts_per_class,
        concurrency=args.concurrency, repeats=args.repeats, address=args.address, up_flags=up_flags,
        draft_dir=args.draft_model, target_dir=args.target_model, hf=not args.no_hf, name=args.name,
        llama_server=args.llama_server, threads=args.target_threads or os.cpu_count() or 1, prompts=args.prompts,
        draft_model=not args.target_alone,
    )
    result = run(cfg)
    print(json.dumps({k: result[k] for k in ("duration_s", "lossless", "concurrency", "goals")}, indent=2))
    print(f"wrote {common.RESULTS / (cfg.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

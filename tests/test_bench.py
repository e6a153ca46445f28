"""`specd bench` end to end on the tiny pair: real `specd up` processes, HF assisted in process,
the JSON's fields and the losslessness check. No timing assertions: the figures are the bench's job."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import bench, common
from benchmarks.bench import BenchConfig, mismatches
from benchmarks.common import vector_extensions
from benchmarks.summary import (ADAPTIVE, ADAPTIVE_MODEL, HF_ASSISTED, LLAMA_PLAIN, LLAMA_SPEC, PLAIN, Measured, goals,
                                peer_goals)

pytestmark = pytest.mark.slow  # whole benchmark runs through specd up

FAKE_LLAMA_SERVER = Path(__file__).parent / "data" / "fake_llama_server.py"


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    # `specd up --redis-url` with the suite's throwaway Redis (no AOF): its coordinator would refuse it
    monkeypatch.setenv("SPECD_REQUIRE_DURABLE_STORE", "off")
    return tmp_path


def test_bench_runs_end_to_end_and_reports_every_figure(tiny_pair, redis_url, results_dir):
    draft_dir, target_dir = tiny_pair
    cfg = BenchConfig(
        tokens=6, ks=(1, 2), concurrency=2, repeats=2, draft_dir=draft_dir, target_dir=target_dir, name="tiny", progress=False,
        up_flags=("--draft-threads", "1", "--target-threads", "1", "--redis-url", redis_url),
    )
    bench.run(cfg)

    result = json.loads((results_dir / "tiny.json").read_text())
    # specd's 5 configurations against its plain decoding, HF assisted against HF plain (each
    # deployment against its own numerics): 2 repeats x 3 prompts x 6, and the concurrency runs.
    assert result["lossless"]["mismatches"] == [] and result["lossless"]["checked"] == 2 * 3 * 6 + 2 * 2
    assert set(result["classes"]) == {"code", "prose", "chat"}
    for summary in result["classes"].values():
        assert set(summary["configs"]) == {PLAIN, "K=1", "K=2", ADAPTIVE, ADAPTIVE_MODEL, HF_ASSISTED, "hf_plain"}
        assert {row["requests"] for row in summary["configs"].values()} == {2}  # the repeats, pooled
        for config in ("K=1", "K=2", ADAPTIVE):
            row = summary["configs"][config]
            for key in ("tokens_per_s", "speedup", "alpha", "mean_acceptance_length", "ttft_s", "tpot_p50_s",
                        "tpot_p99_s", "rounds", "theoretical_speedup", "achieved_over_theoretical",
                        "overhead_fraction_of_target_step"):
                assert key in row, (config, key)
        assert {"draft_step", PLAIN, "K=1", "K=2"} <= set(summary["step_times_s"])
    assert result["concurrency"]["sessions"] == 2 and "ratio" in result["concurrency"]
    assert result["goals"]
    for run in result["runs"]:
        if run["config"].startswith("K="):
            assert run["judged_tokens"] >= run["accepted_tokens"] and run["draft_compute_s"] > 0
            assert run["round_wall_s"] >= run["draft_compute_s"] + run["verify_compute_s"]
    assert all((results_dir / name).stat().st_size > 0 for name in result["plots"])
    assert all(result["rss_gb"][role] > 0 for role in ("draft", "target", "coordinator"))
    assert not any("RSS" in row["goal"] for row in result["goals"])  # a ratio to llama-server's, which did not run


def test_llama_server_runs_side_by_side_plain_speculative_and_concurrent(tiny_pair, redis_url, results_dir, tmp_path,
                                                                         monkeypatch):
    """The peer's plumbing, with a stand-in llama-server (tests/data/fake_llama_server.py): the real
    one needs the real pair's GGUF files, which `specd bench --llama-server` uses."""
    binary = tmp_path / "llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_LLAMA_SERVER} "$@"\n')
    binary.chmod(0o755)
    monkeypatch.setattr(bench, "gguf_files", lambda: (tmp_path / "target.gguf", tmp_path / "draft.gguf"))
    draft_dir, target_dir = tiny_pair
    cfg = BenchConfig(
        tokens=4, ks=(1,), concurrency=2, draft_dir=draft_dir, target_dir=target_dir, hf=False, llama_server=binary,
        threads=1, name="peers", progress=False,
        up_flags=("--draft-threads", "1", "--target-threads", "1", "--redis-url", redis_url),
    )
    bench.run(cfg)

    result = json.loads((results_dir / "peers.json").read_text())
    assert result["lossless"]["mismatches"] == []  # specd's own runs; the peer's are not held to it
    prompts = {run["prompt"]: run for run in result["runs"] if run["config"] == LLAMA_PLAIN}
    assert len(prompts) == 3
    first_tokens = {p.name: p.token_ids[0] for p in bench.load_prompts(target_dir, 1)}
    assert result["lossless"]["llama_spec_equals_its_plain"] == {name: first_tokens[name] % 2 == 0 for name in prompts}
    for summary in result["classes"].values():
        assert {LLAMA_PLAIN, LLAMA_SPEC} <= set(summary["configs"])
        assert all(summary["configs"][peer]["tokens_per_s"] > 0 for peer in (LLAMA_PLAIN, LLAMA_SPEC))
    goals = {row["goal"] for row in result["goals"]}
    code = peer_goals(vector_extensions())["code"]  # this host's bound
    assert f"code: adaptive vs llama-server plain ≥ {code}×" in goals and "code: adaptive ahead of llama-server speculative" in goals
    assert "2 concurrent vs llama-server -np 2 ≥ 1.0×" in goals
    assert "code: specd plain vs llama-server plain ≥ 1.1×" in goals
    assert "draft + target + coordinator RSS ≤ 1.0× llama-server's with the draft" in goals
    assert result["concurrency"]["llama_concurrent_tokens_per_s"] > 0
    assert result["rss_gb"][LLAMA_PLAIN] > 0 and result["rss_gb"][LLAMA_SPEC] > 0


def test_a_target_alone_runs_plain_and_the_model_free_drafter(tiny_pair, redis_url, results_dir):
    draft_dir, target_dir = tiny_pair
    cfg = BenchConfig(
        tokens=6, ks=(1, 2), concurrency=0, draft_dir=draft_dir, target_dir=target_dir, hf=False, draft_model=False,
        name="alone", progress=False, up_flags=("--target-threads", "1", "--redis-url", redis_url),
    )
    bench.run(cfg)

    result = json.loads((results_dir / "alone.json").read_text())
    assert result["settings"]["services"].endswith("--draft-replicas 0")
    assert result["lossless"]["mismatches"] == [] and result["lossless"]["checked"] == 3 * 2
    for summary in result["classes"].values():
        assert set(summary["configs"]) == {PLAIN, ADAPTIVE}  # no fixed K: they are the draft model's
    assert result["rss_gb"]["draft"] == 0 and result["goals"]


def _run(config: str, output: tuple[int, ...]) -> Measured:
    return Measured(config, "p", "code", output, 1.0, ((0.1, 1),))


def test_an_output_that_differs_from_plain_decoding_is_reported():
    plain = {"p": (5, 6, 7, 8)}
    assert mismatches(plain, [_run("K=2", (5, 6, 7, 8))]) == []
    (problem,) = mismatches(plain, [_run("K=2", (5, 6, 9, 8))])
    assert problem.startswith("K=2 on p") and "token 2" in problem
    (shorter,) = mismatches(plain, [_run(HF_ASSISTED, (5, 6, 7))])
    assert "token 3" in shorter and "lengths 3 vs 4" in shorter
    assert bench.LosslessViolation("LOSSLESS VIOLATION").code != 0


def test_every_benchmark_request_comes_from_an_api_key_of_its_own(tmp_path):
    """The model-free drafter keeps each key's recent outputs: a repeated prompt must not find its answer there."""
    from benchmarks.common import FreshTenants, tenant_keys
    from services.coordinator.auth import ApiKeys

    path, keys = tenant_keys(tmp_path, 5)
    owners = ApiKeys.from_file(path)
    seen = []
    stub = type("Stub", (), {"Complete": lambda self, request, metadata, timeout: seen.append(dict(metadata))})()
    tenants = FreshTenants(stub, keys)
    for _ in range(5):
        tenants.Complete("request", timeout=1)
    assert len({owners.owner(m["authorization"]) for m in seen}) == 5


def test_the_goals_against_llama_server_are_the_hosts():
    """Issue 30's bounds for adaptive against llama-server plain: an AVX2-only host's code and chat ask
    less than an AVX-512 host's (an extra verification row costs more there); prose and the repeating
    classes ask the same."""
    def configs(adaptive: float) -> dict:
        return {"configs": {ADAPTIVE: {"tokens_per_s": adaptive, "speedup": adaptive / 20.0,
                                       "overhead_fraction_of_target_step": 0.03},
                            PLAIN: {"tokens_per_s": 20.0}, LLAMA_PLAIN: {"tokens_per_s": 16.0}}}

    classes = {"code": configs(28.0), "prose": configs(17.0), "chat": configs(22.0)}  # 1.75x / 1.06x / 1.38x
    hosts = {"avx2": ["avx2", "fma"], "avx512": ["avx2", "fma", "avx512f", "avx512bw"]}
    verdicts = {host: {g["goal"]: g["met"] for g in goals(classes, None, {}, extensions)
                       if "adaptive vs llama-server plain" in g["goal"]} for host, extensions in hosts.items()}
    assert verdicts["avx2"] == {"code: adaptive vs llama-server plain ≥ 1.6×": True,
                                "prose: adaptive vs llama-server plain ≥ 1.0×": True,
                                "chat: adaptive vs llama-server plain ≥ 1.3×": True}
    assert verdicts["avx512"] == {"code: adaptive vs llama-server plain ≥ 2.0×": False,
                                  "prose: adaptive vs llama-server plain ≥ 1.0×": True,
                                  "chat: adaptive vs llama-server plain ≥ 1.4×": False}

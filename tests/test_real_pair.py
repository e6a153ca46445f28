"""End to end on the real Qwen2.5-Coder pair: `specd up` as it starts by default (the GGUF files
served as stored, mutual TLS between the services; three processes, real gRPC on loopback) must
produce exactly the tokens the target alone gives: the same file's greedy decoding through
specd's engine in this process, one token a step.

Needs the fetched pair (`specd models fetch`; scripts/test runs it first). A missing pair
is a failure, not a skip: this is the test that keeps the real path working.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from services.common import certs
from services.common.tls import CALLER, TlsFiles, channel_options
from services.coordinator.model_info import load_model_info
from services.models import is_ready, model_path
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2_grpc
from specd.gguf_model import GGUFModel

pytestmark = pytest.mark.real

PROMPTS = ["def quicksort(arr):", "The three primary colors are"]
CHAT = [{"role": "user", "content": "Write a Python one-liner that reverses a string."}]
N_TOKENS = 32
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def target_dir() -> Path:
    missing = [role for role in ("draft", "target") if not is_ready(role)]
    if missing:
        pytest.fail(f"the real pair is not fetched ({missing}): run `specd models fetch` (scripts/test does)")
    return model_path("target")


def greedy(model: GGUFModel, prompt_ids: list[int], n: int) -> list[int]:
    """The target alone: one token a step, each the argmax of the last row."""
    cache, out = model.new_cache(), []
    logits = model.forward([cache], [prompt_ids], [1])[0]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        if out[-1] in model.eos_token_ids:
            break
        logits = model.forward([cache], [[out[-1]]], [1])[0]
    return out


@pytest.fixture(scope="module")
def reference(target_dir) -> dict:
    """Greedy tokens of the target alone, computed before the services load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        info, model = load_model_info(target_dir), GGUFModel(target_dir)
        out = {p: greedy(model, info.encode(p), N_TOKENS) for p in PROMPTS}
        out["chat"] = greedy(model, info.chat_prompt(CHAT), N_TOKENS)
        out["chat_text"] = info.decode(out["chat"])
        return out
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def specd_up(*extra: str, log: list[str] | None = None) -> Iterator[dict[str, int]]:
    """`specd up` on free ports (and `extra` flags); yields the ports by flag name. Its output
    after it is up goes on into `log` (read all along: a full pipe would block the services)."""
    ports = {f"{name}-port": free_port() for name in ("coordinator", "draft", "target", "http", "draft-metrics", "target-metrics")}
    flags = [arg for flag, port in ports.items() for arg in (f"--{flag}", str(port))]
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", *flags, *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_for_line(proc, "specd is up")
        sink = log if log is not None else []
        threading.Thread(target=lambda: sink.extend(proc.stdout), daemon=True).start()
        yield ports
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def deployment(reference, tmp_path_factory) -> Iterator[dict]:
    tls_dir = tmp_path_factory.mktemp("tls")
    certs.make(tls_dir)  # the services speak mutual TLS, as by default; the test calls the target with these
    with specd_up("--tls-dir", str(tls_dir)) as ports:
        yield ports | {"tls": tls_dir}


def _wait_for_line(proc: subprocess.Popen, marker: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            return
        if time.monotonic() > deadline:
            break
    raise AssertionError("specd up did not come up:\n" + "".join(seen[-40:]))


@pytest.fixture(scope="module")
def coordinator(deployment) -> str:
    return f"127.0.0.1:{deployment['coordinator-port']}"


def test_specd_up_serves_the_gguf_file_as_stored(deployment):
    credentials = TlsFiles(deployment["tls"], CALLER).channel_credentials()
    with grpc.secure_channel(f"127.0.0.1:{deployment['target-port']}", credentials,
                             options=channel_options("target")) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetEngineInfo(common_pb2.EngineInfoRequest(), timeout=30)
    assert (info.numerics, info.invariant) == ("gguf", True)
    assert "Q4_K" in info.reason and info.vocab_digest


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_plain_decoding_is_the_target_alone(coordinator, reference, prompt):
    with grpc.insecure_channel(coordinator) as channel:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, speculation=False)
        reply = coordinator_pb2_grpc.CoordinatorStub(channel).Complete(request, timeout=600)
    assert list(reply.token_ids) == reference[prompt]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_real_pair_greedy_is_token_identical_to_the_target_alone(coordinator, reference, prompt):
    with grpc.insecure_channel(coordinator) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, num_draft_tokens=4)
        chunks = list(stub.Generate(request, timeout=600))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[prompt]
    stats = chunks[-1].stats
    print(f"\n{prompt!r}: {stats.rounds} target calls for {len(tokens)} tokens, "
          f"mean acceptance length {stats.mean_acceptance_length:.2f}")
    assert stats.accepted_tokens > 0  # the real draft helps: some drafts are accepted


def test_real_pair_on_code_with_adaptive_k_is_the_target_alone(coordinator, reference):
    prompt = PROMPTS[0]
    with grpc.insecure_channel(coordinator) as channel:
        reply = coordinator_pb2_grpc.CoordinatorStub(channel).Complete(
            coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS), timeout=600
        )
    assert list(reply.token_ids) == reference[prompt]
    # Drafts were verified and accepted. Whether the policy keeps speculating all the way depends on
    # this host's timings (a loaded 2-core VM fell back once with 12 of 12 drafts accepted): the
    # benchmark measures that, not this test.
    assert reply.stats.accepted_tokens > 0


def test_cli_generate_json(coordinator, reference):
    prompt = PROMPTS[0]
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", prompt, "--max-tokens", "8", "--json", "--address", coordinator],
        capture_output=True, text=True, timeout=600, check=True,
    )
    result = json.loads(out.stdout)
    assert result["token_ids"] == reference[prompt][:8]
    assert result["finish_reason"] == "length" and result["stats"]["completion_tokens"] == 8


def test_real_pair_chat_through_the_openai_client_is_the_targets_text(deployment, reference):
    """The REST gateway with Qwen's own chat template, streamed, through the official client."""
    import openai

    base_url = f"http://127.0.0.1:{deployment['http-port']}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused-no-keys-configured", max_retries=0, timeout=600) as client:
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=N_TOKENS, temperature=0, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == reference["chat_text"]

"""End to end on the real Qwen2.5-Coder pair: `specd up` with a float32 target (three processes,
real gRPC on loopback) must produce exactly the tokens HF `generate` gives with the target alone.
(specd up's default numerics, q4: tests/test_real_q4.py.)

Needs the converted pair (`specd models fetch`; scripts/test runs it first). A missing pair
is a failure, not a skip: this is the test that keeps the real path working.
"""

from __future__ import annotations

import contextlib
import gc
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
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.models import is_ready, model_path
from services.protogen.specd.v1 import coordinator_pb2, coordinator_pb2_grpc

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


@pytest.fixture(scope="module")
def reference(target_dir) -> dict:
    """Greedy tokens of the target alone (HF generate, float32), computed before the services load."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # the fetched target is its GGUF file: transformers dequantises it (80-100 s, ~9 GB at peak)
        where = dict(pretrained_model_name_or_path=target_dir.parent, gguf_file=target_dir.name)
        tokenizer = AutoTokenizer.from_pretrained(**where)
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
        chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
        chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
        out = {}
        for key, prompt_ids in [*((p, tokenizer.encode(p)) for p in PROMPTS), ("chat", chat_ids)]:
            ids = torch.tensor([prompt_ids])
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS, do_sample=False)
            out[key] = generated[0, ids.shape[1] :].tolist()
        out["chat_text"] = tokenizer.decode(out["chat"], skip_special_tokens=True)
        return out
    finally:
        del model
        gc.collect()
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
def deployment(reference) -> Iterator[dict[str, int]]:
    with specd_up("--target-quantize", "none") as ports:  # the checkpoint's float32 weights: HF's numerics
        yield ports


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


def test_real_pair_on_code_keeps_speculation_on_with_adaptive_k(coordinator, reference):
    prompt = PROMPTS[0]
    with grpc.insecure_channel(coordinator) as channel:
        reply = coordinator_pb2_grpc.CoordinatorStub(channel).Complete(
            coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS), timeout=600
        )
    assert list(reply.token_ids) == reference[prompt]
    # Speculation stayed on throughout and did most of the work.
    assert reply.stats.mode == "speculative" and reply.stats.fallbacks == 0
    assert reply.stats.accepted_tokens > N_TOKENS / 2


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

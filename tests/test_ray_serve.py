"""The Ray Serve application on a real local Ray (2 CPUs), tiny pair in float64, a real Redis,
two replicas of each model: greedy completions through its HTTP ingress are the target's alone,
token for token, and a multi-turn session stays on its replicas (never resent)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from services.common.redis_server import free_port
from tests.conftest import greedy_reference

pytestmark = pytest.mark.slow  # a local Ray cluster

PROMPTS = ["def add(a, b):", "Once upon a time"]
N_TOKENS = 16


@pytest.fixture(scope="module")
def ray_redis_url(redis_url) -> str:
    """A database of its own: the ingress's start-up calibration writes the deployment's first prior there."""
    return redis_url.rsplit("/", 1)[0] + "/7"


@pytest.fixture(scope="module")
def ray_app(tiny_pair, ray_redis_url):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from services.ray_app import build_app

    draft_dir, target_dir = tiny_pair
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"target_model": str(target_dir), "draft_model": str(draft_dir), "redis_url": ray_redis_url,
                "dtype": "float64", "draft_replicas": "2", "target_replicas": "2", "draft_cpus": "0.5",
                "target_cpus": "0.5", "coordinator_flags": "--default-k 3"}
        serve.run(build_app(args), name="specd", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_through_the_ray_ingress_is_the_targets(ray_app, tiny_pair, prompt):
    from services.coordinator.model_info import load_model_info

    model = load_model_info(tiny_pair[1])
    expected = model.decode(greedy_reference(tiny_pair[1])(model.encode(prompt), N_TOKENS))
    with httpx.Client(base_url=ray_app, timeout=120) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
                "num_draft_tokens": 3}
        reply = client.post("/v1/completions", json=body).json()
    assert reply["choices"][0]["text"] == expected
    assert reply["specd"]["accepted_tokens"] > 0 or reply["specd"]["drafted_tokens"] > 0


def test_a_multi_turn_session_stays_on_its_replicas(ray_app, tiny_pair):
    from services.coordinator.model_info import load_model_info

    model = load_model_info(tiny_pair[1])
    target_alone = greedy_reference(tiny_pair[1])
    history: list[int] = []
    with httpx.Client(base_url=ray_app, timeout=120) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        for text in ["One turn.", " Another turn.", " A third."]:
            body = {"model": name, "prompt": text, "max_tokens": N_TOKENS, "temperature": 0, "ignore_eos": True,
                    "session_id": "ray-multi-turn", "num_draft_tokens": 3}
            reply = client.post("/v1/completions", json=body).json()
            history += model.encode(text)
            expected = target_alone(history, N_TOKENS)
            assert reply["choices"][0]["text"] == model.decode(expected)
            assert reply["specd"]["resyncs"] == 0 and reply["specd"]["drafted_tokens"] > 0
            history += expected


def test_the_ray_ingress_calibrates_at_start_up_as_the_coordinator_does(ray_app, ray_redis_url):
    import redis

    with redis.Redis.from_url(ray_redis_url) as store:
        deadline = time.monotonic() + 120
        while store.get("specd:policy-prior") is None:
            assert time.monotonic() < deadline, "no start-up calibration wrote the deployment's prior"
            time.sleep(0.5)
        prior = json.loads(store.get("specd:policy-prior"))
    assert prior["estimates"]["draft_step_s"] > 0 and len(prior["estimates"]["verify_s"]) > 1


def test_the_coordinator_flags_and_the_draft_head_are_checked_when_the_app_is_built(tiny_pair, redis_url):
    from services.ray_app import build_app

    args = {"target_model": str(tiny_pair[1]), "draft_model": str(tiny_pair[0]), "redis_url": redis_url}
    with pytest.raises(ValueError, match="coordinator_flags"):
        build_app(args | {"coordinator_flags": "--default-k many"})
    with pytest.raises(ValueError, match="head vocabulary must be >= 0"):  # as the draft service's --head-vocab
        build_app(args | {"draft_head_vocab": "-1"})


def test_the_ray_ingress_streams_and_refuses_bad_input(ray_app):
    with httpx.Client(base_url=ray_app, timeout=120) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        assert client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 0}).status_code == 400
        body = {"model": name, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c"])
def test_specd_serve_ray_serves_then_stops_on_a_signal(tiny_pair, redis_url, tmp_path, ctrl_c):
    """The documented command: up, one completion, then SIGTERM to it (a container stop) or SIGINT
    to its whole process group (Ctrl-C in a terminal: Ray's own processes get it too); a clean
    exit with Ray torn down."""
    import subprocess
    import sys

    port = free_port()
    command = [sys.executable, "-m", "services.cli", "serve-ray", "--num-cpus", "2", "--http-port", str(port),
               "--redis-url", redis_url, "--draft-model", str(tiny_pair[0]), "--target-model",
               str(tiny_pair[1]), "--draft-quantize", "none"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    log = tmp_path / "serve-ray.log"
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "is up" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert proc.poll() is None and "is up" in log.read_text(), log.read_text()[-3000:]
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            name = client.get("/v1/models").json()["data"][0]["id"]
            reply = client.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 4})
        assert reply.status_code == 200
        stopping = time.monotonic()
        if ctrl_c:
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopping < 60
        time.sleep(2)
        with pytest.raises(ProcessLookupError):  # nothing of Ray's is left in the command's session
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

"""The Ray Serve application on a real local Ray (2 CPUs), tiny pair in float64, a real Redis:
greedy completions through its HTTP ingress are the target's alone, token for token."""

from __future__ import annotations

import os

import httpx
import pytest

from services.common.redis_server import free_port
from tests.conftest import greedy_reference

PROMPTS = ["def add(a, b):", "Once upon a time"]
N_TOKENS = 16


@pytest.fixture(scope="module")
def ray_app(tiny_pair, redis_url):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from services.ray_app import build_app

    draft_dir, target_dir = tiny_pair
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"target_model_dir": str(target_dir), "draft_model_dir": str(draft_dir), "redis_url": redis_url,
                "dtype": "float64"}
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


def test_the_ray_ingress_streams_and_refuses_bad_input(ray_app):
    with httpx.Client(base_url=ray_app, timeout=120) as client:
        name = client.get("/v1/models").json()["data"][0]["id"]
        assert client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 0}).status_code == 400
        body = {"model": name, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as reply:
            events = [line for line in reply.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3

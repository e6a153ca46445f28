"""Numerics as a deployment setting, through the real services (gRPC on loopback, a real Redis,
tiny pairs): greedy speculation gives the deployment's own plain greedy output for every K, with
GGUF files served as stored and with a Hugging Face target beside an int8 draft; what each model
service runs shows in its metrics, its GetEngineInfo and the gateway's /v1/models; a target
refuses int8 wherever it is started."""

from __future__ import annotations


import grpc
import httpx
import pytest

from specd import numerics
from services import cli
from services.common import compute, model_main, settings
from services.common.metrics import exposition
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, draft_pb2_grpc, target_pb2_grpc
from tests.procs import up_commands, value
from tests.tiny_gguf import write_tiny
from tests.cluster import Cluster

PROMPTS = [
    "def add(a, b):", "Once upon a time", "The quick brown fox jumps", "x = [1, 2, 3]\nfor", "Hej! Ça va?",
    "import numpy as np", "SELECT * FROM users WHERE", "1, 2, 3, 4,", "<html><body>", "// TODO: fix",
    "aaaaaaaaaaaaaaaa", "Q: what is 2 + 2?\nA:",
]
N_TOKENS = 24
STUBS = {"draft": draft_pb2_grpc.DraftServiceStub, "target": target_pb2_grpc.TargetServiceStub}


@pytest.fixture(scope="module", params=["gguf-pair", "dense-target-int8-draft"])
def cluster(request, tiny_pair, tiny_gguf_pair, redis_url):
    if request.param == "gguf-pair":
        c = Cluster(*tiny_gguf_pair, redis_url, dtype="float32", draft_quantize="auto", target_quantize="auto")
    else:
        c = Cluster(*tiny_pair, redis_url, dtype="float32", draft_quantize="int8", target_quantize="none")
    yield c
    c.close()


def complete(c: Cluster, prompt: str, **fields) -> coordinator_pb2.CompleteResponse:
    with grpc.insecure_channel(c.address("coordinator")) as channel:
        request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N_TOKENS, ignore_eos=True, **fields)
        return c.coordinator(channel).Complete(request, timeout=60)


@pytest.fixture(scope="module")
def plain(cluster) -> dict[str, list[int]]:
    """Each prompt's greedy output from this deployment with speculation off: the target's plain steps."""
    return {prompt: list(complete(cluster, prompt, speculation=False).token_ids) for prompt in PROMPTS}


@pytest.mark.parametrize("k", [1, 2, 4, 8, None], ids=lambda k: f"k{k}" if k else "adaptive")
def test_greedy_speculation_gives_the_deployments_plain_greedy_output(cluster, plain, k):
    """A fixed K drafts every round; adaptive K may fall back to plain steps (the policy it
    inherits from earlier sessions in this Redis decides how soon)."""
    fields = {} if k is None else {"num_draft_tokens": k}
    accepted = 0
    for prompt in PROMPTS:
        reply = complete(cluster, prompt, **fields)
        assert list(reply.token_ids) == plain[prompt], prompt
        accepted += reply.stats.accepted_tokens
    assert accepted > 0 or k is None  # kept drafts: a verification's rows decided, not only plain steps


def shown(c: Cluster) -> dict[str, dict]:
    """What each model service says it runs: its GetEngineInfo, which its metric and (the
    target's) the gateway's /v1/models must repeat; and the engine's own choice behind it."""
    answers = {}
    for role, servicer in (("draft", c.draft), ("target", c.target)):
        with grpc.insecure_channel(c.address(role)) as channel:
            info = STUBS[role](channel).GetEngineInfo(common_pb2.EngineInfoRequest(), timeout=10)
        engine, choice = servicer.engine, servicer.engine.numerics
        assert (info.numerics, info.invariant, info.reason) == (choice.mode, choice.invariant, choice.reason)
        assert (info.quantize, info.instance_id) == (engine.config.quantize, engine.instance_id)
        assert tuple(info.compute) == compute.units("cpu") and info.threads >= 1  # what the coordinator weighs
        labels = f'invariant="{str(info.invariant).lower()}",mode="{info.numerics}",quantize="{info.quantize}"'
        served = exposition(servicer.metrics.registry)[0].decode().splitlines()  # what /metrics serves
        assert f"specd:engine_numerics_info{{{labels}}} 1.0" in served
        answers[role] = {"numerics": info.numerics, "quantize": info.quantize, "invariant": info.invariant,
                         "reason": info.reason}
    (card,) = httpx.get(c.base_url + "/v1/models", timeout=10).json()["data"]
    assert card["specd"] == {"target": [answers["target"]]}  # one target replica
    return answers


def test_what_each_service_runs_shows_in_metrics_engine_info_and_models(cluster):
    answers = shown(cluster)
    if cluster.target_engine.model is None:  # the GGUF pair: both files as stored, proven invariant
        for role in ("draft", "target"):
            assert (answers[role]["numerics"], answers[role]["quantize"], answers[role]["invariant"]) == \
                ("gguf", "auto", True)
            assert "batch-invariant by the start-up check" in answers[role]["reason"]
    else:
        assert answers["target"]["numerics"] == "none" and answers["target"]["reason"] == "set by configuration"
        assert answers["draft"] == {"numerics": "int8", "quantize": "int8", "invariant": False,
                                    "reason": "set by configuration"}


def test_the_models_listing_says_when_the_target_does_not_answer(cluster, monkeypatch):
    async def unavailable():
        return [grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())]

    monkeypatch.setattr(cluster.services.verifier, "engines", unavailable)
    (card,) = httpx.get(cluster.base_url + "/v1/models", timeout=10).json()["data"]
    assert card["specd"] == {"target": [{"error": "UNAVAILABLE"}]}  # its code, not its address


# -- the setting: defaults, and a target refusing int8 ------------------------------------------


def refusal(capsys, role: str, *argv: str) -> str:
    """What a model service's command line says as it refuses to start."""
    with pytest.raises(SystemExit):
        model_main.parse(role, 1, ["--model-dir", "m", *argv])
    return capsys.readouterr().err


def test_a_target_refuses_int8_from_a_flag_or_the_environment(monkeypatch, capsys):
    assert "int8 is a draft-only setting" in refusal(capsys, "target", "--quantize", "int8")
    assert model_main.parse("draft", 1, ["--model-dir", "m", "--quantize", "int8"]).quantize == "int8"
    monkeypatch.setenv("SPECD_QUANTIZE", "int8")  # argparse checks no default: the service does
    assert "int8 is a draft-only setting" in refusal(capsys, "target")
    monkeypatch.setenv("SPECD_QUANTIZE", "int4")
    assert "must be one of none, int8, auto" in refusal(capsys, "draft")


def test_specd_up_and_serve_ray_refuse_an_int8_target(capsys):
    for command in ("up", "serve-ray"):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--target-quantize", "int8"])
        assert exit_.value.code == 2 and "int8 is a draft-only setting" in capsys.readouterr().err
    from services import ray_app

    with pytest.raises(ValueError, match="int8 is a draft-only setting"):
        ray_app.build_app({"target_model_dir": "t", "draft_model_dir": "d", "redis_url": "r",
                           "target_quantize": "int8"})


def test_specd_up_runs_without_a_draft_model_and_always_with_a_target(monkeypatch, capsys):
    commands = up_commands(monkeypatch, "--draft-replicas", "0")
    assert not [name for name in commands if name.startswith("draft")]
    assert value(commands["coordinator"], "--draft-addr") == settings.NO_DRAFT
    with pytest.raises(SystemExit):
        cli.main(["up", "--target-replicas", "0"])
    assert "target replicas must be >= 1" in capsys.readouterr().err


def test_specd_up_passes_each_roles_quantize_with_the_defaults_in_one_place(monkeypatch, tmp_path):
    assert settings.QUANTIZE_MODES == numerics.MODES  # the torch-free copy
    assert model_main.parse("target", 1, ["--model-dir", "m"]).quantize == settings.SERVICE_QUANTIZE == "none"
    quantize = lambda commands: {role: value(commands[f"{role}-0"], "--quantize") for role in ("draft", "target")}  # noqa: E731
    assert quantize(up_commands(monkeypatch)) == settings.LAUNCH_QUANTIZE == {"draft": "auto", "target": "auto"}
    files = tuple(str(write_tiny(tmp_path / f"{role}.gguf", "qwen2", "Q4_K")) for role in ("draft", "target"))
    gguf = up_commands(monkeypatch, models=files)  # a GGUF draft runs as Q4_0
    assert quantize(gguf) == settings.LAUNCH_QUANTIZE_GGUF == {"draft": "q4_0", "target": "auto"}
    assert quantize(up_commands(monkeypatch, "--draft-quantize", "auto", models=files))["draft"] == "auto"
    commands = up_commands(monkeypatch, "--target-quantize", "none", "--draft-quantize", "int8")
    assert (value(commands["target-0"], "--quantize"), value(commands["draft-0"], "--quantize")) == ("none", "int8")
    monkeypatch.setenv("SPECD_TARGET_QUANTIZE", "none")
    assert value(up_commands(monkeypatch)["target-0"], "--quantize") == "none"

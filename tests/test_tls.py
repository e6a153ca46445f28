"""Mutual TLS between the coordinator and the model services, on loopback with real processes and
certificates: the coordinator with its certificate gets the target's own output; every other
caller is refused before it can read or rewrite a session's cache, and the session goes on intact.
"""

from __future__ import annotations

import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import certs
from services.common.tls import CA_FILE, CALLER, TlsFiles, channel_options, key_file
from services.protogen.specd.v1 import common_pb2, coordinator_pb2, target_pb2, target_pb2_grpc
from tests.procs import coordinator, specd, stub, tls_model_service, up_commands, value

N = 12
INTRUDER = "intruder"  # a client certificate the deployment's CA signed that is not the coordinator's


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """This deployment's set (plus an intruder's client certificate from its CA), and another deployment's."""
    ours, theirs = tmp_path_factory.mktemp("tls"), tmp_path_factory.mktemp("other-tls")
    certs.make(ours, more_clients=(INTRUDER,))
    certs.make(theirs)
    return ours, theirs


def target_as(address: str, credentials: grpc.ChannelCredentials | None) -> target_pb2_grpc.TargetServiceStub:
    if credentials is None:
        return target_pb2_grpc.TargetServiceStub(grpc.insecure_channel(address))
    return target_pb2_grpc.TargetServiceStub(grpc.secure_channel(address, credentials, options=channel_options("target")))


def refused(call, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as error:
        call()
    assert error.value.code() == code, error.value.details()
    return error.value.details()


def test_model_services_answer_only_the_coordinators_certificate(procs, tiny_pair, tmp_path, pki, redis_url, model,
                                                                 target_alone):
    ours, theirs = pki
    draft_dir, target_dir = tiny_pair
    draft, target = procs(tls_model_service("draft", draft_dir, tmp_path, ours),
                          tls_model_service("target", target_dir, tmp_path, ours))
    (coord,) = procs(coordinator(target_dir, [draft.address], [target.address], redis_url, tmp_path,
                                 "--tls-dir", str(ours)))
    prompt, session = "Only the coordinator may ask.", "tls-victim"
    # drafter "model": the draft service is called from the first round (over TLS too), whatever the timings
    request = coordinator_pb2.GenerateRequest(text=prompt, max_tokens=N, session_id=session, ignore_eos=True,
                                              drafter="model")
    first = stub(coord).Complete(request, timeout=120)
    history = model.encode(prompt)
    assert list(first.token_ids) == target_alone(history, N) and first.stats.drafted_tokens > 0
    history += list(first.token_ids)

    ref = common_pb2.SessionRef(session_id=session)
    crafted = target_pb2.VerifyRequest(  # "the victim's cache holds this other text": would rewrite it
        session_id=session, draft_tokens=[1, 2], sync=common_pb2.SyncPoint(start_pos=0, tokens=[7] * len(history)))
    # No certificate, a certificate without a key, another deployment's coordinator, the draft's own
    # (a server certificate): the handshake fails, so no call reaches the service (gRPC: UNAVAILABLE).
    for who, credentials in {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials((ours / CA_FILE).read_bytes()),
        "another deployment's coordinator": TlsFiles(theirs, CALLER).channel_credentials(),
        "the draft's server certificate": TlsFiles(ours, "draft").channel_credentials(),
    }.items():
        attacker = target_as(target.address, credentials)
        for rpc, message in ((attacker.GetSession, ref), (attacker.Verify, crafted), (attacker.Release, ref)):
            refused(lambda: rpc(message, timeout=5), grpc.StatusCode.UNAVAILABLE)
    # A client certificate of this deployment's CA that is not the coordinator's: UNAUTHENTICATED.
    intruder = target_as(target.address, TlsFiles(ours, INTRUDER).channel_credentials())
    for rpc, message in ((intruder.GetSession, ref), (intruder.Verify, crafted), (intruder.Release, ref),
                         (intruder.GetLoad, common_pb2.LoadRequest())):
        details = refused(lambda: rpc(message, timeout=5), grpc.StatusCode.UNAUTHENTICATED)
        assert "coordinator" in details and "specd-intruder" in details
    # Health stays open: to a verified peer on the TLS port, to anyone on the plaintext health port.
    for channel in (grpc.secure_channel(target.address, TlsFiles(ours, INTRUDER).channel_credentials(),
                                        options=channel_options("target")),
                    grpc.insecure_channel(f"127.0.0.1:{target.health_port}")):
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert specd(["health", target.address, "--tls-dir", str(ours), "--role", "target"]) == 0
    assert specd(["health", f"127.0.0.1:{target.health_port}"]) == 0
    # The only-health port answers nothing else.
    refused(lambda: target_as(f"127.0.0.1:{target.health_port}", None).GetSession(ref, timeout=5),
            grpc.StatusCode.UNIMPLEMENTED)

    # The victim's cache was never touched: it holds the committed text, and the next turn is exact.
    coordinator_view = target_as(target.address, TlsFiles(ours, CALLER).channel_credentials())
    assert coordinator_view.GetSession(ref, timeout=5).position == len(history)
    second = stub(coord).Complete(coordinator_pb2.GenerateRequest(
        text=" Still mine.", max_tokens=N, session_id=session, ignore_eos=True), timeout=120)
    history += model.encode(" Still mine.")
    assert list(second.token_ids) == target_alone(history, N)
    assert second.stats.resyncs == 0


def test_specd_certs_writes_a_set_without_the_cas_key_and_keys_only_the_owner_reads(tmp_path, capsys):
    directory = tmp_path / "tls"
    assert specd(["certs", "--dir", str(directory)]) == 0
    names = sorted(p.name for p in directory.iterdir())
    assert names == sorted([CA_FILE, *(f"{r}.pem" for r in certs.ROLES), *(key_file(r) for r in certs.ROLES)])
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for role in certs.ROLES:
        assert stat.S_IMODE(os.stat(directory / key_file(role)).st_mode) == 0o600
        TlsFiles(directory, role).check()
    before = (directory / CA_FILE).read_bytes()
    assert specd(["certs", "--dir", str(directory), "--keep"]) == 0
    assert (directory / CA_FILE).read_bytes() == before and "nothing changed" in capsys.readouterr().out
    assert specd(["certs", "--dir", str(directory)]) == 0
    assert (directory / CA_FILE).read_bytes() != before  # a new CA: the old set is replaced everywhere


def test_a_model_service_refuses_to_start_without_its_certificate(tmp_path, tiny_pair):
    from services.common.model_main import parse

    certs.make(tmp_path)
    (tmp_path / key_file("target")).unlink()
    with pytest.raises(SystemExit):
        parse("target", 50053, ["--model-dir", str(tiny_pair[1]), "--tls-dir", str(tmp_path)])
    assert parse("draft", 50052, ["--model-dir", str(tiny_pair[0]), "--tls-dir", str(tmp_path)]).tls.role == "draft"


def test_specd_up_runs_every_service_on_mutual_tls_unless_told_not_to(monkeypatch):
    commands = up_commands(monkeypatch, "--draft-replicas", "2")
    assert {name: value(cmd, "--tls-dir") for name, cmd in commands.items()} == {
        name: "tls" for name in ("draft-0", "draft-1", "target-0", "coordinator")}
    assert not any("--tls-dir" in cmd for cmd in up_commands(monkeypatch, "--service-tls", "off").values())
    given = up_commands(monkeypatch, "--tls-dir", "/etc/mine")  # a set of one's own, to call the services too
    assert {value(cmd, "--tls-dir") for cmd in given.values()} == {"/etc/mine"}

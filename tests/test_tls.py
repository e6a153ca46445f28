"""Mutual TLS between the coordinator and the model services, on loopback with real processes and
certificates: the coordinator with its certificate gets the target's own output; every other
caller is refused before it can read or rewrite a session's cache, and the session goes on intact.
"""

from __future__ import annotations

import http.client
import os
import shutil
import ssl
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.serialization import Encoding
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import certs
from services.common.redis_server import free_port
from services.common.tls import CA_FILE, CALLER, TlsFiles, channel_options, key_file
from services.protogen.specd.v1 import (common_pb2, coordinator_pb2, coordinator_pb2_grpc, target_pb2,
                                        target_pb2_grpc)
from tests.procs import (ROOT, coordinator, edge_coordinator, rest, specd, stub, tls_model_service, up_commands,
                         value, wait_rest)

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


OFF_LOOPBACK = ("0.0.0.0", "::", "10.1.2.3", "target.example")
LOOPBACK = ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost")


def no_specd_variables(monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith("SPECD_")]:
        monkeypatch.delenv(name)


def exits_refusing_plaintext(module: str, *argv: str) -> str:
    """`python -m <module> argv` exits at once, non-zero, saying what to pass; its stderr."""
    done = subprocess.run([sys.executable, "-m", module, *argv, "--port", str(free_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0, done.stderr
    assert "plaintext" in done.stderr and "--insecure" in done.stderr and "SPECD_INSECURE" in done.stderr
    return done.stderr


def test_a_model_service_refuses_plaintext_off_loopback_unless_told_insecure(tmp_path, tiny_pair, monkeypatch):
    from services.common.model_main import parse

    no_specd_variables(monkeypatch)
    model = ["--model", str(tiny_pair[1])]
    assert "--tls-dir" in exits_refusing_plaintext("services.target", *model, "--host", "0.0.0.0")
    for host in OFF_LOOPBACK:
        with pytest.raises(SystemExit):
            parse("target", 1, [*model, "--host", host])
    for host in LOOPBACK:  # a laptop's `specd up`, the tests
        assert parse("target", 1, [*model, "--host", host]).tls is None
    certs.make(tmp_path)
    assert parse("draft", 1, [*model, "--host", "0.0.0.0", "--tls-dir", str(tmp_path)]).tls.role == "draft"
    assert parse("target", 1, [*model, "--host", "0.0.0.0", "--insecure"]).insecure
    monkeypatch.setenv("SPECD_INSECURE", "1")
    assert parse("target", 1, [*model, "--host", "0.0.0.0"]).insecure
    monkeypatch.setenv("SPECD_INSECURE", "maybe")  # a typo in a security switch is an error, not "off"
    with pytest.raises(ValueError, match="SPECD_INSECURE"):
        parse("target", 1, [*model, "--host", "0.0.0.0"])


def test_the_coordinator_refuses_a_plaintext_edge_off_loopback_unless_told_insecure(tmp_path, tiny_pair, monkeypatch):
    from services.coordinator import root

    no_specd_variables(monkeypatch)
    base = ["--model", str(tiny_pair[1]), "--redis-url", "redis://127.0.0.1:1/0"]
    exits_refusing_plaintext("services.coordinator", *base, "--host", "0.0.0.0")
    for host in OFF_LOOPBACK:
        with pytest.raises(SystemExit):
            root.parse([*base, "--host", host], edges=True)
    for host in LOOPBACK:
        assert root.parse([*base, "--host", host], edges=True).edge_tls is None
    assert root.parse([*base, "--host", "0.0.0.0", "--insecure"], edges=True).insecure
    ca, cert, key = edge_set(tmp_path)
    given = root.parse([*base, "--host", "0.0.0.0", "--edge-tls-cert", str(cert), "--edge-tls-key", str(key)],
                       edges=True)
    assert given.edge_tls.cert == cert
    # The Ray ingress parses the same flags but serves through Ray's proxy: not its edges to check.
    assert root.parse([*base, "--host", "0.0.0.0"]).edge_tls is None
    for half in (["--edge-tls-cert", str(cert)], ["--edge-tls-key", str(key)],  # one without the other
                 ["--edge-tls-cert", str(cert), "--edge-tls-key", str(tmp_path / "absent.pem")],
                 ["--edge-tls-cert", str(ca), "--edge-tls-key", str(key)]):  # a key that is not the certificate's
        with pytest.raises(SystemExit):
            root.parse([*base, *half], edges=True)


def test_specd_up_passes_insecure_to_every_child_only_when_given(monkeypatch):
    assert all("--insecure" in cmd for cmd in up_commands(monkeypatch, "--host", "0.0.0.0", "--insecure").values())
    assert not any("--insecure" in cmd for cmd in up_commands(monkeypatch).values())


def edge_set(directory: Path) -> tuple[Path, Path, Path]:
    """A CA of its own and, signed by it, a server certificate for the coordinator's edge naming
    localhost and 127.0.0.1 (a deployment would use its ingress's or a public CA's): ca, cert, key."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = certs.new_ca(days=1)
    (directory / CA_FILE).write_bytes(ca.public_bytes(Encoding.PEM))
    cert, key = certs.issue(directory, ca, ca_key, "edge", client=False, days=1, hosts=("localhost", "127.0.0.1"))
    return directory / CA_FILE, cert, key


def trusting(ca: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca))


def coordinator_over_tls(address: str, ca: Path) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(
        grpc.secure_channel(address, grpc.ssl_channel_credentials(ca.read_bytes())))


def test_the_coordinators_edge_serves_tls_and_takes_a_rotated_certificate_without_restart(tmp_path, tiny_pair,
                                                                                       redis_url):
    first_ca, first_cert, first_key = edge_set(tmp_path / "first")
    live = tmp_path / "edge"  # what the coordinator reads: a mounted Secret's files
    live.mkdir()
    cert, key = live / "tls.crt", live / "tls.key"
    shutil.copy(first_cert, cert), shutil.copy(first_key, key)
    coord = edge_coordinator(tiny_pair[1], redis_url, tmp_path, "--edge-tls-cert", str(cert),
                             "--edge-tls-key", str(key)).start()
    try:
        wait_rest(coord, trusting(first_ca))
        unknown = coordinator_pb2.SessionRequest(session_id="no-such-session")
        # REST over https, gRPC over TLS: each reaches the frontend (the session is unknown)
        assert rest(coord, "/v1/sessions/no-such-session", context=trusting(first_ca)) == 404
        refused(lambda: coordinator_over_tls(coord.address, first_ca).GetSession(unknown, timeout=10),
                grpc.StatusCode.NOT_FOUND)
        # and nothing in plaintext
        with pytest.raises((OSError, http.client.HTTPException)):
            rest(coord, "/health")
        refused(lambda: stub(coord).GetSession(unknown, timeout=5), grpc.StatusCode.UNAVAILABLE)

        # A certificate from another CA replaces the files (as a Secret's update does): new
        # connections get it, no restart.
        second_ca, second_cert, second_key = edge_set(tmp_path / "second")
        for source, target in ((second_cert, cert), (second_key, key)):
            shutil.copy(source, live / "next"), os.replace(live / "next", target)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert rest(coord, "/v1/sessions/no-such-session", context=trusting(second_ca)) == 404
                break
            except ssl.SSLError:  # the REST edge looks at its files once a second
                assert time.monotonic() < deadline, "the REST edge still serves the first certificate"
                time.sleep(0.2)
        refused(lambda: coordinator_over_tls(coord.address, second_ca).GetSession(unknown, timeout=10),
                grpc.StatusCode.NOT_FOUND)
        with pytest.raises(ssl.SSLError):
            rest(coord, "/health", context=trusting(first_ca))
        refused(lambda: coordinator_over_tls(coord.address, first_ca).GetSession(unknown, timeout=5),
                grpc.StatusCode.UNAVAILABLE)
        assert coord.proc.poll() is None
    finally:
        coord.stop()

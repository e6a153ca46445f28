"""The coordinator's client edge on TLS from end to end: `specd certs` makes its certificate (the
host names clients use, signed by the deployment's CA), `specd up` serves it on gRPC and REST, and
`specd health --edge-ca` checks it, failing clearly against any other CA."""

from __future__ import annotations

import http.client
import ipaddress
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from benchmarks.common import TINY_UP_ENV, specd_up_logged
from services.common import certs
from services.common.redis_server import free_port
from services.common.tls import CA_FILE, EdgeTrust, cert_file, identity, key_file
from services.protogen.specd.v1 import coordinator_pb2
from tests.procs import ROOT, ServiceProcess, rest, specd, up_commands, value
from tests.test_tls import coordinator_over_tls, trusting

EDGE_CERT, EDGE_KEY = cert_file(certs.EDGE), key_file(certs.EDGE)  # edge.pem, edge-key.pem


def _host(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def verifies(directory: Path, host: str) -> bool:
    """The edge certificate in `directory` chains to its ca.pem and is valid for `host`, as a TLS client
    that trusts that CA checks it."""
    ca = x509.load_pem_x509_certificates((directory / CA_FILE).read_bytes())
    verifier = PolicyBuilder().store(Store(ca)).build_server_verifier(_host(host))
    try:
        verifier.verify(x509.load_pem_x509_certificate((directory / EDGE_CERT).read_bytes()), [])
    except VerificationError:
        return False
    return True


def alt_names(path: Path) -> set[str]:
    alt = x509.load_pem_x509_certificate(path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return {*alt.get_values_for_type(x509.DNSName), *map(str, alt.get_values_for_type(x509.IPAddress))}


def test_specd_certs_writes_an_edge_certificate_for_the_hosts_given_that_the_ca_verifies(tmp_path, capsys):
    given = tmp_path / "given"
    assert specd(["certs", "--dir", str(given), "--edge-host", "api.example.com", "--edge-host", "10.0.0.7"]) == 0
    assert str(given / EDGE_CERT) in capsys.readouterr().out
    assert alt_names(given / EDGE_CERT) == {identity(certs.EDGE), "api.example.com", "10.0.0.7"}
    assert verifies(given, "api.example.com") and verifies(given, "10.0.0.7")
    assert not verifies(given, "localhost")  # the names given replace the default ones
    cert = x509.load_pem_x509_certificate((given / EDGE_CERT).read_bytes())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.SERVER_AUTH]  # it cannot act as the coordinator
    assert stat.S_IMODE(os.stat(given / EDGE_KEY).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(given / EDGE_CERT).st_mode) == 0o644

    default = tmp_path / "default"  # what `specd up` and compose's ports on 127.0.0.1 are reached by
    assert specd(["certs", "--dir", str(default)]) == 0
    assert alt_names(default / EDGE_CERT) == {identity(certs.EDGE), *certs.EDGE_HOSTS} == {
        identity(certs.EDGE), "localhost", "127.0.0.1"}
    assert all(verifies(default, host) for host in certs.EDGE_HOSTS)
    assert not verifies(given, "localhost") and not verifies(default, "api.example.com")

    # A service's own name on the edge's certificate would let its key pass for that service.
    refused = tmp_path / "refused"
    assert specd(["certs", "--dir", str(refused), "--edge-host", "specd-target"]) == 2
    assert "specd-target" in capsys.readouterr().err and not refused.exists()


def test_specd_up_passes_the_edge_certificate_to_the_coordinator_only(monkeypatch, tmp_path):
    certs.make(tmp_path)
    edge = ["--edge-tls-cert", str(tmp_path / EDGE_CERT), "--edge-tls-key", str(tmp_path / EDGE_KEY)]
    commands = up_commands(monkeypatch, "--host", "0.0.0.0", *edge)
    assert (value(commands["coordinator"], "--edge-tls-cert"), value(commands["coordinator"], "--edge-tls-key")) == (
        edge[1], edge[3])
    assert not any("--edge-tls-cert" in cmd for name, cmd in commands.items() if name != "coordinator")
    assert not any("--insecure" in cmd for cmd in commands.values())  # TLS everywhere: nothing to waive
    assert not any("--edge-tls-cert" in cmd for cmd in up_commands(monkeypatch).values())
    # One without the other, or a key that is not the certificate's: `specd up` stops before starting anything.
    for wrong in (edge[:2], edge[2:], [edge[0], str(tmp_path / cert_file("target")), *edge[2:]]):
        assert specd(["up", *wrong]) == 2


def health(*argv: str) -> subprocess.CompletedProcess:
    """`specd health <argv>` as a container's healthcheck runs it."""
    return subprocess.run([sys.executable, "-m", "services.cli", "health", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_specd_up_serves_its_edges_on_tls_which_specd_health_checks_with_the_ca(tiny_pair, redis_url, tmp_path):
    ours, theirs = tmp_path / "tls", tmp_path / "another-deployment"
    assert specd(["certs", "--dir", str(ours)]) == 0 and specd(["certs", "--dir", str(theirs)]) == 0
    names = ("coordinator", "draft", "target", "http", "draft-metrics", "target-metrics")
    ports = {name: free_port() for name in names}
    argv = [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    argv += ["--draft-model", str(tiny_pair[0]), "--target-model", str(tiny_pair[1]), "--redis-url", redis_url,
             "--edge-tls-cert", str(ours / EDGE_CERT), "--edge-tls-key", str(ours / EDGE_KEY)]
    log = tmp_path / "up.log"
    # The suite's throwaway Redis (no AOF): its coordinator would refuse it; no calibration on the tiny pair.
    env = TINY_UP_ENV | {"SPECD_REQUIRE_DURABLE_STORE": "off", "SPECD_CALIBRATE": "off"}
    proc = specd_up_logged(argv, log, env)
    try:
        address = f"127.0.0.1:{ports['coordinator']}"
        rest_url = f"https://127.0.0.1:{ports['http']}/v1"
        deadline = time.monotonic() + 10
        while rest_url not in log.read_text():  # printed just after "specd is up"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        coordinator = ServiceProcess("coordinator", [], tmp_path, ports["coordinator"])
        coordinator.http_port = ports["http"]
        # A client that trusts the deployment's CA: REST over https, gRPC over TLS, through draft and target.
        assert rest(coordinator, "/v1/models", context=trusting(ours / CA_FILE)) == 200
        reply = coordinator_over_tls(address, ours / CA_FILE).Complete(
            coordinator_pb2.GenerateRequest(text="Edge on TLS.", max_tokens=4, ignore_eos=True), timeout=120)
        assert reply.stats.completion_tokens == 4
        with pytest.raises((OSError, http.client.HTTPException)):  # nothing in plaintext
            rest(coordinator, "/health")

        checked = health(address, "--edge-ca", str(ours / CA_FILE))
        assert checked.returncode == 0 and checked.stdout.strip() == "SERVING", checked.stderr
        # Another deployment's CA, or none (plaintext to a TLS port): not serving, said why, no traceback.
        for trust in (["--edge-ca", str(theirs / CA_FILE)], []):
            checked = health(address, *trust)
            assert checked.returncode == 1 and checked.stdout.strip() == "NOT SERVING", checked.stderr
            assert f"specd health: {address}: UNAVAILABLE" in checked.stderr and "Traceback" not in checked.stderr
        missing = health(address, "--edge-ca", str(tmp_path / "absent.pem"))
        assert missing.returncode == 2 and "absent.pem" in missing.stderr and "Traceback" not in missing.stderr
        with pytest.raises(grpc.RpcError):  # and a gRPC client trusting that other CA is refused the same
            coordinator_over_tls(address, theirs / CA_FILE).Complete(coordinator_pb2.GenerateRequest(text="x"),
                                                                       timeout=10)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_an_edge_ca_that_is_not_pem_is_refused_before_any_call(tmp_path):
    (tmp_path / "ca.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match="PEM"):
        EdgeTrust.from_ca(tmp_path / "ca.pem")

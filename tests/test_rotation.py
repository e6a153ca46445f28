"""Secrets rotated under running services, no restart: the API key file is read again when it
changes (or on SIGHUP), and a model service's certificate, key and CA are read again for each new
TLS handshake, so new connections get the rotated set; the coordinator's pools build new
channels with its rotated client certificate."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import time
from pathlib import Path

import grpc
import pytest

from specd.contracts import EngineInfo
from services.common import certs
from services.common.tls import CA_FILE, CALLER, TlsFiles, cert_file, channel_options, key_file
from services.coordinator.auth import ApiKeys, Unauthenticated
from services.protogen.specd.v1 import common_pb2, target_pb2_grpc
from services.target.client import GrpcVerifier
from tests.procs import edge_coordinator, rest, specd, tls_model_service, wait_rest

OLD, NEW, NEWER = "old-key-0123456789abcdef", "new-key-0123456789abcdef", "newer-key-0123456789abcdef"
SESSION = "/v1/sessions/no-such-session"  # 404 past the key check, 401 before it


def replace(path: Path, text: str) -> None:
    """As a k8s Secret update or `mv` does: a new file in one step."""
    path.with_name(path.name + ".next").write_text(text)
    os.replace(path.with_name(path.name + ".next"), path)


def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.1)


def test_api_keys_follow_their_file_and_keep_the_last_good_set_when_it_breaks(tmp_path, caplog):
    path = tmp_path / "api-keys"
    path.write_text(f"alice:{OLD}\n")
    keys = ApiKeys.from_file(path, check_every_s=0)
    assert keys.owner(f"Bearer {OLD}") == "alice"
    path.write_text(f"alice:{NEW}\n# bob left\n")  # rewritten in place: its mtime and size change
    with pytest.raises(Unauthenticated):
        keys.owner(f"Bearer {OLD}")
    assert keys.owner(f"Bearer {NEW}") == "alice"
    with caplog.at_level(logging.ERROR):
        replace(path, "carol:short\n")  # too short a key: the file does not parse
        assert keys.owner(f"Bearer {NEW}") == "alice"
    assert "keeping the" in caplog.text and str(path) in caplog.text
    path.unlink()  # gone: also an error, also the last good set
    assert keys.owner(f"Bearer {NEW}") == "alice"
    replace(path, f"dave:{NEWER}\n")
    assert keys.owner(f"Bearer {NEWER}") == "dave"

    # At most one look at the file a second (here an hour); SIGHUP's reload() looks at once.
    lazy = ApiKeys.from_file(path, check_every_s=3600)
    replace(path, f"erin:{OLD}\n")
    assert lazy.owner(f"Bearer {NEWER}") == "dave"
    lazy.reload()
    assert lazy.owner(f"Bearer {OLD}") == "erin"
    with pytest.raises(Unauthenticated):
        lazy.owner(f"Bearer {NEWER}")


def test_a_running_coordinator_takes_a_rotated_key_file_over_real_http(tmp_path, tiny_pair, redis_url):
    path = tmp_path / "api-keys"
    path.write_text(f"alice:{OLD}\n")
    coord = edge_coordinator(tiny_pair[1], redis_url, tmp_path, "--api-keys-file", str(path)).start()
    try:
        wait_rest(coord)
        assert (rest(coord, SESSION, OLD), rest(coord, SESSION, NEW)) == (404, 401)
        path.write_text(f"alice:{NEW}\n")  # rewritten in place
        until(lambda: rest(coord, SESSION, OLD) == 401)  # looked at once a second at most
        assert rest(coord, SESSION, NEW) == 404
        replace(path, "alice:short\n")  # broken: the last good keys stay
        time.sleep(1.5)
        assert (rest(coord, SESSION, NEW), rest(coord, SESSION, OLD)) == (404, 401)
        assert "keeping the" in coord.log_path.read_text()
        replace(path, f"alice:{NEWER}\n")
        coord.proc.send_signal(signal.SIGHUP)  # read again now; the coordinator keeps running
        until(lambda: rest(coord, SESSION, NEWER) == 404)
        assert rest(coord, SESSION, NEW) == 401 and coord.proc.poll() is None
    finally:
        coord.stop()


def target_as(address: str, credentials: grpc.ChannelCredentials) -> target_pb2_grpc.TargetServiceStub:
    """A channel of its own (no connection shared with an earlier one): each call here is a new handshake."""
    options = [*channel_options("target"), ("grpc.use_local_subchannel_pool", 1)]
    return target_pb2_grpc.TargetServiceStub(grpc.secure_channel(address, credentials, options=options))


def credentials(ca: Path, client: Path) -> grpc.ChannelCredentials:
    """Trusting `ca` only, presenting the coordinator's certificate from `client`."""
    return grpc.ssl_channel_credentials(ca.read_bytes(), (client / key_file(CALLER)).read_bytes(),
                                        (client / cert_file(CALLER)).read_bytes())


def answers(address: str, creds: grpc.ChannelCredentials) -> grpc.StatusCode:
    try:
        target_as(address, creds).GetSession(common_pb2.SessionRef(session_id="nobody"), timeout=10)
    except grpc.RpcError as error:
        return error.code()  # UNAVAILABLE: the handshake failed
    return grpc.StatusCode.OK


def test_a_model_service_serves_a_certificate_from_a_new_ca_without_restart(procs, tiny_pair, tmp_path):
    live, old = tmp_path / "tls", tmp_path / "old-tls"
    certs.make(live)
    shutil.copytree(live, old)
    (target,) = procs(tls_model_service("target", tiny_pair[1], tmp_path, live))
    assert answers(target.address, credentials(old / CA_FILE, old)) == grpc.StatusCode.OK

    assert specd(["certs", "--dir", str(live)]) == 0  # a new CA and a new set, over the served one
    # A client trusting only the new CA (with the new coordinator certificate) is served; one
    # trusting only the old CA no longer accepts the service's certificate: the handshake fails.
    assert answers(target.address, credentials(live / CA_FILE, live)) == grpc.StatusCode.OK
    assert answers(target.address, credentials(old / CA_FILE, live)) == grpc.StatusCode.UNAVAILABLE
    # and the old coordinator certificate is no longer the CA's
    assert answers(target.address, credentials(live / CA_FILE, old)) == grpc.StatusCode.UNAVAILABLE
    assert "reloaded" in target.log_path.read_text()

    # A set half written (a key that is not its certificate's) is refused with an error; the
    # service keeps serving the last good one.
    shutil.copy(old / key_file("target"), live / key_file("target"))
    assert answers(target.address, credentials(live / CA_FILE, live)) == grpc.StatusCode.OK
    assert "still serving the previous certificate" in target.log_path.read_text()


@pytest.mark.slow  # a restarted process
def test_the_coordinators_pool_reconnects_with_its_rotated_client_certificate(procs, tiny_pair, tmp_path):
    """A channel keeps the credentials it was made with: a replica that comes back with the
    rotated set (a restart, a rollout) is reached through a new channel the pool makes with the
    rotated files."""
    live = tmp_path / "tls"
    certs.make(live)
    (target,) = procs(tls_model_service("target", tiny_pair[1], tmp_path, live))

    async def scenario() -> None:
        pool = GrpcVerifier([target.address], tls=TlsFiles(live, CALLER))
        try:
            assert all(isinstance(e, EngineInfo) for e in await pool.engines())
            assert specd(["certs", "--dir", str(live)]) == 0
            await asyncio.to_thread(target.stop)
            await asyncio.to_thread(lambda: target.start().wait_ready())
            deadline = time.monotonic() + 15
            while True:
                replies = await pool.engines()
                if all(isinstance(e, EngineInfo) for e in replies):
                    break
                assert time.monotonic() < deadline, f"the pool still fails after the rotation: {replies}"
                await asyncio.sleep(0.2)
        finally:
            await pool.replicas.close()

    asyncio.run(scenario())

"""TLS, mutual TLS and the bearer token, on the real services with certificates made here by
openssl: the right client is served, every wrong one is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specinfer.generate import Request
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import System, launch
from specinfer_rpc.security import channel_credentials

from .conftest import MODELS
from .dns_server import DNSServer
from .services import reference_greedy

TOKEN = "s3cret-token"
SPECULATORS = "speculator.specinfer.test"  # a DNS name the service certificate carries


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "2", "-subj", f"/CN={name}", cwd=d)


def make_cert(d, name: str, ca: str) -> None:
    """A certificate for 127.0.0.1 / localhost signed by `ca`, usable by servers and clients."""
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:{SPECULATORS}\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    make_ca(d, "ca")
    make_ca(d, "rogue-ca")
    make_cert(d, "service", "ca")
    make_cert(d, "client", "ca")
    make_cert(d, "rogue", "rogue-ca")
    return d


def creds(pki, ca="ca", cert=None, token=""):
    return channel_credentials(str(pki / f"{ca}.pem"), str(pki / f"{cert}.pem") if cert else "",
                               str(pki / f"{cert}.key") if cert else "", token)


@pytest.fixture(scope="module")
def mtls_system(pki):
    """Every service serves mutual TLS and calls the others with its certificate; the public API
    also wants a bearer token."""
    tls = [f"--tls-cert={pki / 'service.pem'}", f"--tls-key={pki / 'service.key'}", f"--tls-ca={pki / 'ca.pem'}",
           "--tls-client-auth"]
    system = launch(MODELS / "llm", [MODELS / "ssm-0"], speculators=1, port=0, service_args=tls,
                    manager_args=["--auth-token", TOKEN], credentials=creds(pki, cert="service"))
    yield system
    system.stop()


def served(address, credentials, heldout_ids) -> list[int]:
    return generate_all(address, [Request(heldout_ids[0], 16)], timeout=60, credentials=credentials)[0].token_ids


def refused(address, credentials, heldout_ids) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        served(address, credentials, heldout_ids)
    return e.value.code()


def test_mutual_tls_serves_the_right_client_and_refuses_the_others(mtls_system, pki, heldout_ids):
    address = mtls_system.manager.address
    want = reference_greedy(heldout_ids[:1], 16)[0]
    # every hop (manager -> verifier, manager -> speculator) ran over mutual TLS to get here
    assert served(address, creds(pki, cert="client", token=TOKEN), heldout_ids) == want
    assert refused(address, creds(pki, cert=None, token=TOKEN), heldout_ids) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, creds(pki, cert="rogue", token=TOKEN), heldout_ids) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, creds(pki, ca="rogue-ca", cert="client", token=TOKEN),  # the server is not trusted
                   heldout_ids) == grpc.StatusCode.UNAVAILABLE
    assert refused(address, None, heldout_ids) == grpc.StatusCode.UNAVAILABLE  # plaintext
    for name in ("verifier", "speculator-0"):  # the internal services refuse a client without a certificate
        with grpc.secure_channel(mtls_system.by_name(name).address, creds(pki)) as channel:
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE, name


def test_speculators_found_by_dns_are_verified_against_the_dns_name(mtls_system, pki, heldout_ids):
    """The manager dials a discovered replica by address (127.0.0.1 here, a pod IP in a cluster)
    but checks its certificate against the target's DNS name: the mTLS stream works and trees
    are accepted."""
    dns = DNSServer()
    speculator = mtls_system.by_name("speculator-0")
    dns.set(SPECULATORS, "A", ["127.0.0.1"])
    system = System(credentials=creds(pki, cert="service"))
    try:
        manager = system.start("manager", "manager_svc", [
            "--port", "0", "--verifier", mtls_system.by_name("verifier").address, "--tokenizer", str(MODELS / "llm"),
            "--speculators", f"dns://{dns.address}/{SPECULATORS}:{speculator.address.rsplit(':', 1)[1]}",
            "--no-adaptive", f"--tls-cert={pki / 'service.pem'}", f"--tls-key={pki / 'service.key'}",
            f"--tls-ca={pki / 'ca.pem'}", "--tls-client-auth"], 120)
        stream = generate_all(manager.address, [Request(heldout_ids[0], 16)], "2,1,1", 60,
                              creds(pki, cert="client"))[0]
        assert stream.token_ids == reference_greedy(heldout_ids[:1], 16)[0]
        assert stream.usage.accepted_draft_tokens > 0
    finally:
        system.stop()
        dns.close()


def test_bearer_token_guards_the_public_api_but_not_health(mtls_system, pki, heldout_ids):
    address = mtls_system.manager.address
    for token in ("", "wrong"):
        assert refused(address, creds(pki, cert="client", token=token), heldout_ids) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.secure_channel(address, creds(pki, cert="client")) as channel:  # probes need no token
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_server_only_tls_serves_clients_that_trust_it(pki):
    system = System(credentials=creds(pki))
    try:
        spec = system.start("speculator", "speculator_svc",
                            ["--port", "0", "--threads", "1", "--ssm", str(MODELS / "ssm-0"), f"--tls-cert={pki / 'service.pem'}",
                             f"--tls-key={pki / 'service.key'}"], 120)
        with grpc.secure_channel(spec.address, creds(pki)) as channel:  # no client certificate needed
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        with grpc.secure_channel(spec.address, creds(pki, ca="rogue-ca")) as channel:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        system.stop()


def test_a_tls_flag_without_its_partner_is_refused_at_start_naming_it(pki):
    out = subprocess.run([sys.executable, "-m", "speculator_svc", "--port", "0", f"--tls-cert={pki / 'service.pem'}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error: tls_key: needed with tls_cert" in out.stderr


def test_container_healthcheck_takes_the_services_tls_settings_from_the_environment(mtls_system, pki):
    address = mtls_system.by_name("verifier").address
    env = {**os.environ, "SPECINFER_TLS_CA": str(pki / "ca.pem"), "SPECINFER_TLS_CERT": str(pki / "service.pem"),
           "SPECINFER_TLS_KEY": str(pki / "service.key")}
    check = [sys.executable, "-m", "specinfer_rpc.healthcheck", address]
    assert subprocess.run(check, env=env, capture_output=True, timeout=60).returncode == 0
    plain = {k: v for k, v in env.items() if not k.startswith("SPECINFER_TLS_")}
    assert subprocess.run(check, env=plain, capture_output=True, timeout=60).returncode == 1

"""Requests whose bytes do not parse, on every method of every service (health and reflection
included): INVALID_ARGUMENT naming the message, one log line each, and the system stays
exact afterwards."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from specinfer.generate import Request
from specinfer_rpc.client import generate_all
from specinfer_rpc.launch import launch
from specinfer_rpc.v1 import generation_pb2, speculator_pb2, verifier_pb2

from .conftest import MODELS
from .services import reference_greedy

CORRUPT = b"\xff\xff\xff"  # a truncated varint where a field's tag belongs

# what each process serves besides health and reflection
SERVICES = {"manager": generation_pb2.DESCRIPTOR.services_by_name["Generation"],
            "verifier": verifier_pb2.DESCRIPTOR.services_by_name["Verifier"],
            "speculator-0": speculator_pb2.DESCRIPTOR.services_by_name["Speculator"],
            "speculator-1": speculator_pb2.DESCRIPTOR.services_by_name["Speculator"]}
EVERY_PROCESS = [health_pb2.DESCRIPTOR.services_by_name["Health"],
                 reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]]
METHODS = [(name, method) for name, service in SERVICES.items()
           for s in [service, *EVERY_PROCESS] for method in s.methods]

# a request each request stream answers, sent before a corrupt one
ANSWERED = {"Speculate": speculator_pb2.SpeculateRequest(iteration=1),
            "VerifyStream": verifier_pb2.VerifyRequest(),  # an empty step
            "ServerReflectionInfo": reflection_pb2.ServerReflectionRequest(list_services="")}


@pytest.fixture(scope="module")
def logged_system(tmp_path_factory):
    """The whole system as separate processes, each writing its log to <log_dir>/<name>.log."""
    system = launch(MODELS / "llm", [MODELS / "ssm-0", MODELS / "ssm-1"], speculators=2, port=0,
                    log_dir=tmp_path_factory.mktemp("logs"))
    yield system
    system.stop()


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


def call_raw(address: str, method: MethodDescriptor, requests: list[bytes]) -> tuple[int, grpc.RpcError]:
    """Send `requests` (one unless the method takes a stream) as raw bytes; the responses that
    came before the call failed, and its error."""
    kind = ("stream_" if method.client_streaming else "unary_") + ("stream" if method.server_streaming else "unary")
    with grpc.insecure_channel(address) as channel:
        call = getattr(channel, kind)(path(method), request_serializer=None, response_deserializer=None)
        request = iter(requests) if method.client_streaming else requests[0]
        answered = 0
        with pytest.raises(grpc.RpcError) as err:
            if method.server_streaming:
                for _ in call(request, timeout=30):
                    answered += 1
            else:
                call(request, timeout=30)
    return answered, err.value


def corrupt_requests(method: MethodDescriptor) -> list[list[bytes]]:
    """A corrupt request, and for a request stream also a corrupt item after an answered one."""
    if method.name in ANSWERED:
        return [[CORRUPT], [ANSWERED[method.name].SerializeToString(), CORRUPT]]
    assert not method.client_streaming, f"{path(method)}: no answered request known for its stream"
    return [[CORRUPT]]


def log_lines(system, name: str) -> list[str]:
    return (system.log_dir / f"{name}.log").read_text().splitlines()


@pytest.mark.parametrize("name,method", METHODS, ids=[f"{n}{path(m)}" for n, m in METHODS])
def test_a_request_that_does_not_parse_is_invalid_argument_naming_the_message_in_one_log_line(
        logged_system, name, method):
    with pytest.raises(DecodeError):
        message_factory.GetMessageClass(method.input_type).FromString(CORRUPT)
    address = logged_system.by_name(name).address
    for requests in corrupt_requests(method):
        before = len(log_lines(logged_system, name))
        answered, err = call_raw(address, method, requests)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert err.details() == f"request is not a valid {method.input_type.name}"
        assert answered == (len(requests) - 1 if method.server_streaming else 0)
        # the service's stderr reaches the file through the launcher, after the client has its
        # answer: wait for the call's line, so that it is not counted as the next call's
        deadline = time.monotonic() + 10
        while True:
            written = log_lines(logged_system, name)[before:]
            mine = [line for line in written if f"{path(method)}:" in line]
            if mine or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert len(mine) == 1 and not any("Traceback" in line for line in written), written


def test_after_corrupt_requests_to_every_method_the_system_is_still_exact(logged_system, heldout_ids):
    for name, method in METHODS:
        for requests in corrupt_requests(method):
            _, err = call_raw(logged_system.by_name(name).address, method, requests)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    prompts = heldout_ids[:4]
    streams = generate_all(logged_system.manager.address, [Request(p, 24) for p in prompts], "2,2,1,1")
    assert [s.token_ids for s in streams] == reference_greedy(prompts, 24)
    assert sum(s.usage.verifier_steps for s in streams) < sum(len(s.token_ids) for s in streams)  # drafts accepted
    assert all(s.process.poll() is None for s in logged_system.services)
    for s in logged_system.services:
        assert not any("Traceback" in line for line in log_lines(logged_system, s.name)), s.name

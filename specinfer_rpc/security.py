"""Transport security for servers and clients: TLS and mutual TLS from PEM files, and an optional
bearer token on the public API. Plaintext stays the default (loopback, or a mesh that does TLS).

- A server with a certificate serves TLS; with `client_auth` it also requires a client
  certificate signed by its CA (mutual TLS).
- A client with a CA verifies the server with it, and presents its own certificate when it has
  one. The manager calls the verifier and the speculators this way with the flags it serves with.
- A bearer token rides as `authorization: Bearer <token>` metadata. gRPC sends call credentials
  only over secure channels, so without TLS the client uses local credentials (loopback or a Unix
  socket only), which carry the token in the clear on the local machine.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path!r}: {e.strerror}") from e


def server_credentials(cert: str, key: str, ca: str, client_auth: bool) -> grpc.ServerCredentials | None:
    """None: plaintext. ValueError names the flag that is missing or unreadable."""
    if not cert:
        if key or client_auth:
            raise ValueError("tls_cert: needed with tls_key and tls_client_auth")
        return None
    if not key:
        raise ValueError("tls_key: needed with tls_cert")
    if client_auth and not ca:
        raise ValueError("tls_ca: needed with tls_client_auth (the CA that signs client certificates)")
    pair = [(_read(key, "tls_key"), _read(cert, "tls_cert"))]
    roots = _read(ca, "tls_ca") if client_auth else None
    return grpc.ssl_server_credentials(pair, root_certificates=roots, require_client_auth=client_auth)


def channel_credentials(ca: str, cert: str = "", key: str = "", token: str = "") -> grpc.ChannelCredentials | None:
    """None: plaintext. With a CA or a certificate: TLS, verified by the CA (the system's roots
    without one), presenting the certificate if given; with a token: the token on every call."""
    if ca or cert:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(ca, "tls_ca") if ca else None,
                                             private_key=_read(key, "tls_key") if cert else None,
                                             certificate_chain=_read(cert, "tls_cert") if cert else None)
    elif token:
        creds = grpc.local_channel_credentials()
    else:
        return None
    if token:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return creds


def open_channel(address: str, credentials: grpc.ChannelCredentials | None, options) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class BearerToken(grpc.aio.ServerInterceptor):
    """Refuse calls to the services under `prefix` (e.g. "/specinfer.v1.Generation/") without the
    token, UNAUTHENTICATED; health and reflection stay open for probes and tools."""

    def __init__(self, token: str, prefix: str):
        self.expected = f"Bearer {token}".encode()
        self.prefix = prefix

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "authorization: missing or wrong bearer token (metadata 'authorization: Bearer <token>')")

        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        raise TypeError(f"{details.method}: only unary requests can be guarded by a token")

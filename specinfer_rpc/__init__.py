"""What the gRPC services share: the generated stubs (v1/), protobuf conversions of the core's
dataclasses, the server scaffold (health, reflection, graceful stop, error mapping), service
configuration from flags and environment variables, the client, and the launcher of the whole
system. The core library (`specinfer`) knows nothing of this package."""

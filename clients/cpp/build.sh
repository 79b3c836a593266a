#!/usr/bin/env bash
# Build the C++ client from protos/: protoc with gRPC's C++ plugin, then one g++ call.
# Needs Debian's libgrpc++-dev, protobuf-compiler-grpc and protobuf-compiler (apt-get install -y ...).
#   clients/cpp/build.sh [OUT_DIR]     (default clients/cpp/build; the binary is OUT_DIR/generate)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
protos="$here/../../protos"
out="${1:-$here/build}"
mkdir -p "$out"
protoc -I "$protos" --cpp_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
    specinfer/v1/common.proto specinfer/v1/generation.proto
g++ -std=c++17 -O1 -I "$out" "$here/generate.cc" "$out"/specinfer/v1/*.cc \
    $(pkg-config --cflags --libs grpc++ protobuf) -o "$out/generate"
echo "$out/generate"

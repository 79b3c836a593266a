// A C++ client of the public Generation API: streams Generate and prints one JSON line,
// {"token_ids": [...], "finish_reason": "FINISH_REASON_..."}, as a production backend would call it.
//
//   build/generate HOST:PORT 101,2,37 [MAX_NEW_TOKENS]
//
// Built from protos/ by build.sh with Debian's libgrpc++-dev and protobuf-compiler-grpc.
#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>

#include "specinfer/v1/generation.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: " << argv[0] << " HOST:PORT TOKEN_IDS(comma-separated) [MAX_NEW_TOKENS]\n";
    return 2;
  }
  specinfer::v1::GenerateRequest request;
  std::stringstream ids(argv[2]);
  for (std::string id; std::getline(ids, id, ',');) request.add_prompt_token_ids(std::stoi(id));
  request.mutable_stopping()->set_max_new_tokens(argc > 3 ? std::atoi(argv[3]) : 32);

  auto channel = grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials());
  auto stub = specinfer::v1::Generation::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  auto stream = stub->Generate(&context, request);

  std::string tokens, finish = "FINISH_REASON_UNSPECIFIED";
  specinfer::v1::GenerateResponse response;
  while (stream->Read(&response)) {  // one message per verifier step
    for (int t : response.token_ids()) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
    if (response.finish_reason() != specinfer::v1::FINISH_REASON_UNSPECIFIED)
      finish = specinfer::v1::FinishReason_Name(response.finish_reason());
  }
  grpc::Status status = stream->Finish();
  if (!status.ok()) {
    std::cerr << "Generate failed: " << status.error_code() << ": " << status.error_message() << "\n";
    return 1;
  }
  std::cout << "{\"token_ids\": [" << tokens << "], \"finish_reason\": \"" << finish << "\"}" << std::endl;
  return 0;
}

// node generate.js HOST:PORT '[prompt token ids]' MAX_NEW_TOKENS
// Streams one greedy Generate call through the manager, loading the API from protos/ at run time,
// and prints {"token_ids": [...], "finish_reason": "...", "chunks": n} as JSON.
const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const [address, promptJson, maxNewTokens] = process.argv.slice(2);
const protos = path.join(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync("specinfer/v1/generation.proto", {
  includeDirs: [protos], keepCase: true, enums: String, longs: Number, defaults: true,
});
const api = grpc.loadPackageDefinition(definition).specinfer.v1;
const client = new api.Generation(address, grpc.credentials.createInsecure());

const request = {
  prompt_token_ids: JSON.parse(promptJson),
  stopping: { max_new_tokens: Number(maxNewTokens) },
};
const tokens = [];
let finish = "";
let chunks = 0;
const call = client.Generate(request, { deadline: Date.now() + 60000 });
call.on("data", (chunk) => {
  chunks += 1;
  tokens.push(...chunk.token_ids);
  if (chunk.finish_reason !== "FINISH_REASON_UNSPECIFIED") finish = chunk.finish_reason;
});
call.on("error", (err) => {
  console.error(`Generate failed: ${err.code} ${err.details}`);
  process.exit(1);
});
call.on("end", () => {
  console.log(JSON.stringify({ token_ids: tokens, finish_reason: finish, chunks }));
  client.close();
});

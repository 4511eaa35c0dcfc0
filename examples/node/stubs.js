// The MemoryService client shared by the examples: stubs loaded at run time
// from protos/ by @grpc/proto-loader (no generation step), and calls that
// return promises.
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");

const definition = protoLoader.loadSync("memory/v1/memory.proto", {
  includeDirs: [PROTOS],
  keepCase: true, // field names as in the .proto: agent_id, system_block, ...
  longs: Number,
  enums: String, // TIER_MEMORY rather than 1
  defaults: true,
});
const { MemoryService } = grpc.loadPackageDefinition(definition).memory.v1;

// A client of the daemon at ADDRESS (host:port, or unix:PATH), without TLS.
function connect(address) {
  const target = address.startsWith("unix:") ? address : `dns:${address}`;
  return new MemoryService(target, grpc.credentials.createInsecure());
}

// One unary call with a 10 s deadline, as a promise.
function call(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + 10_000 }, (err, response) =>
      err ? reject(err) : resolve(response),
    );
  });
}

module.exports = { connect, call, grpc };

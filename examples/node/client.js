// A memory-sidecar client in Node.js: @grpc/grpc-js with stubs loaded at run
// time from protos/ by @grpc/proto-loader (no generation step; see stubs.js).
//
//   node client.js [ADDRESS]      (default 127.0.0.1:50051)
//
// It adds a memory to each tier, runs two turns of one session, reads the
// structured details of a budget error, and ends the session, printing one
// JSON line per step.
"use strict";

const protobuf = require("protobufjs");
const { connect, call, grpc } = require("./stubs");

// google.rpc.Status and google.rpc.ErrorInfo, declared here field by field
// (numbers from the google.rpc definitions) to decode the rich error details
// carried in the "grpc-status-details-bin" trailer.
const rpc = new protobuf.Root().define("google.rpc");
rpc.add(
  new protobuf.Type("Any")
    .add(new protobuf.Field("type_url", 1, "string"))
    .add(new protobuf.Field("value", 2, "bytes")),
);
rpc.add(
  new protobuf.Type("Status")
    .add(new protobuf.Field("code", 1, "int32"))
    .add(new protobuf.Field("message", 2, "string"))
    .add(new protobuf.Field("details", 3, "Any", "repeated")),
);
rpc.add(
  new protobuf.Type("ErrorInfo")
    .add(new protobuf.Field("reason", 1, "string"))
    .add(new protobuf.Field("domain", 2, "string"))
    .add(new protobuf.MapField("metadata", 3, "string", "string")),
);
const Status = rpc.lookupType("Status");
const ErrorInfo = rpc.lookupType("ErrorInfo");

function errorInfo(error) {
  const [raw] = error.metadata ? error.metadata.get("grpc-status-details-bin") : [];
  if (!raw) return null;
  const status = Status.decode(raw);
  for (const detail of status.details) {
    if (detail.type_url.endsWith("/google.rpc.ErrorInfo")) {
      return ErrorInfo.toObject(ErrorInfo.decode(detail.value));
    }
  }
  return null;
}

async function main() {
  const address = process.argv[2] || "127.0.0.1:50051";
  const client = connect(address);
  const scope = { agent_id: "node-agent", user_id: "node-user" };
  const say = (step, data) => console.log(JSON.stringify({ step, ...data }));

  const note = await call(client, "AddMemory", {
    scope, tier: "TIER_MEMORY", content: "The deploy script lives in ops/deploy.sh",
  });
  say("add", { tier: note.memory.tier, used: note.usage.used_chars, limit: note.usage.limit_chars });
  const fact = await call(client, "AddMemory", {
    scope, tier: "TIER_USER", content: "The user prefers answers in French", confidence: 0.9,
  });
  say("add", { tier: fact.memory.tier, used: fact.usage.used_chars, limit: fact.usage.limit_chars });

  for (let turn = 1; turn <= 2; turn += 1) {
    const injected = await call(client, "InjectForTurn", {
      scope, session_id: "node-session", user_message: "Where is the deploy script?",
    });
    say("turn", {
      turn,
      cache_hit: injected.cache_hit,
      sha256: injected.snapshot_sha256,
      has_notes: injected.system_block.includes("MEMORY (agent notes)"),
      has_profile: injected.system_block.includes("USER PROFILE (who the user is)"),
      token_counter: injected.token_counter,
    });
  }

  try {
    await call(client, "AddMemory", { scope, tier: "TIER_MEMORY", content: "x".repeat(2170) });
    say("budget", { refused: false });
  } catch (error) {
    say("budget", {
      refused: true,
      code: grpc.status[error.code],
      message: error.details,
      info: errorInfo(error),
    });
  }

  const ended = await call(client, "EndSession", { session_id: "node-session", scope });
  say("end", { dropped: ended.dropped });
  client.close();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

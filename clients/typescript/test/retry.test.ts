// The retry policy against a stand-in daemon (grpc-js's own server with the
// generated service definition) that refuses as the daemon does: which
// calls are sent again, how often, and with what.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import {
  Metadata,
  Server,
  ServerCredentials,
  status,
  type ServerUnaryCall,
  type sendUnaryData,
  type UntypedServiceImplementation,
} from "@grpc/grpc-js";
import { MemoryClient, MemoryError, memoryv1 } from "@memory-sidecar/client";
import { ErrorInfo } from "../src/gen/google/rpc/error_details.js";
import { Status } from "../src/gen/google/rpc/status.js";
import { timeoutMs } from "./env.js";

interface Refusal {
  code: status;
  reason: string;
}

// What the stand-in answers next, per method, and what it was sent.
const refusals = new Map<string, Refusal[]>();
const received: { method: string; request: unknown }[] = [];
let server: Server;
let port: number;

function refusal({ code, reason }: Refusal) {
  const info = ErrorInfo.fromPartial({ reason, domain: "memory.v1", metadata: { why: "test" } });
  const details = Status.fromPartial({
    code,
    message: `refused: ${reason || "no reason"}`,
    details: [
      {
        typeUrl: "type.googleapis.com/google.rpc.ErrorInfo",
        value: Buffer.from(ErrorInfo.encode(info).finish()),
      },
    ],
  });
  const metadata = new Metadata();
  if (reason) metadata.set("grpc-status-details-bin", Buffer.from(Status.encode(details).finish()));
  return { code, details: details.message, metadata };
}

function handler(method: string, answer: () => unknown) {
  return (call: ServerUnaryCall<unknown, unknown>, callback: sendUnaryData<unknown>) => {
    received.push({ method, request: call.request });
    const next = refusals.get(method)?.shift();
    if (next) callback(refusal(next));
    else callback(null, answer());
  };
}

before(async () => {
  server = new Server();
  const implementation: UntypedServiceImplementation = {
    getMemories: handler("getMemories", () => memoryv1.GetMemoriesResponse.fromPartial({})),
    updateMemory: handler("updateMemory", () =>
      memoryv1.UpdateMemoryResponse.fromPartial({ generation: 7 }),
    ),
    addMemory: handler("addMemory", () =>
      memoryv1.AddMemoryResponse.fromPartial({ generation: 5, created: true }),
    ),
    callTool: handler("callTool", () =>
      memoryv1.CallToolResponse.fromPartial({ text: "ok", structuredJson: "{}" }),
    ),
  };
  server.addService(memoryv1.MemoryServiceService, implementation);
  port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (error, bound) =>
      error ? reject(error) : resolve(bound),
    ),
  );
});

after(() => server.forceShutdown());

function client(): MemoryClient {
  return new MemoryClient({
    address: `127.0.0.1:${port}`,
    scope: { agentId: "a", userId: "u" },
    timeoutMs,
    // Back-offs of a millisecond: the policy is under test, not the pauses.
    retry: { initialBackoffMs: 1, maxBackoffMs: 1 },
  });
}

function reset(method: string, ...next: Refusal[]): void {
  refusals.set(method, next);
  received.length = 0;
}

const BUSY = { code: status.UNAVAILABLE, reason: "DATABASE_BUSY" };
const BEHIND = { code: status.UNAVAILABLE, reason: "REPLICA_BEHIND" };
const CUT = { code: status.UNAVAILABLE, reason: "" };

test("a read is retried on UNAVAILABLE, the same request each time", async () => {
  const memory = client();
  try {
    reset("getMemories", BEHIND, CUT, BUSY);
    await memory.getMemories({ category: "c" });
    assert.equal(received.length, 4);
    const first = JSON.stringify(received[0]!.request);
    assert.ok(received.every((r) => JSON.stringify(r.request) === first));
  } finally {
    memory.close();
  }
});

test("four attempts in all, then the last refusal as a MemoryError", async () => {
  const memory = client();
  try {
    reset("getMemories", BEHIND, BEHIND, BEHIND, BEHIND, BEHIND);
    await assert.rejects(memory.getMemories(), (error: unknown) => {
      assert.ok(error instanceof MemoryError);
      assert.deepEqual([error.code, error.reason, error.metadata["why"]], [
        status.UNAVAILABLE,
        "REPLICA_BEHIND",
        "test",
      ]);
      return true;
    });
    assert.equal(received.length, 4);
  } finally {
    memory.close();
  }
});

test("other codes are not retried", async () => {
  const memory = client();
  try {
    reset("getMemories", { code: status.INVALID_ARGUMENT, reason: "PAGE_TOKEN_INVALID" });
    await assert.rejects(memory.getMemories(), { reason: "PAGE_TOKEN_INVALID" });
    reset("getMemories", { code: status.RESOURCE_EXHAUSTED, reason: "EXPORTS_BUSY" });
    await assert.rejects(memory.getMemories(), { reason: "EXPORTS_BUSY" });
    assert.equal(received.length, 1);
  } finally {
    memory.close();
  }
});

test("an add is retried with the one key the client made", async () => {
  const memory = client();
  try {
    reset("addMemory", CUT, BUSY);
    await memory.addMemory("note");
    const keys = received.map((r) => (r.request as memoryv1.AddMemoryRequest).idempotencyKey);
    assert.equal(keys.length, 3);
    assert.equal(new Set(keys).size, 1);
    assert.notEqual(keys[0], "");
    assert.equal(memory.lastGeneration, 5);
  } finally {
    memory.close();
  }
});

test("a write without a key is retried only when the daemon says nothing was written", async () => {
  const memory = client();
  try {
    reset("updateMemory", BUSY);
    await memory.updateMemory({ id: "m1", content: "new" });
    assert.equal(received.length, 2);
    reset("updateMemory", CUT);
    await assert.rejects(memory.updateMemory({ id: "m1", content: "new" }), {
      code: status.UNAVAILABLE,
    });
    assert.equal(received.length, 1);
  } finally {
    memory.close();
  }
});

test("a reading tool call is retried; a writing one is not", async () => {
  const memory = client();
  try {
    reset("callTool", CUT);
    await memory.callTool("s", "memory_search", { query: "x" });
    assert.equal(received.length, 2);
    reset("callTool", CUT);
    const view = { command: "view", path: "/memories" };
    await memory.callTool("s", "memory", view, { format: "anthropic" });
    assert.equal(received.length, 2);
    assert.equal((received[0]!.request as memoryv1.CallToolRequest).name, "memory_20250818");
    reset("callTool", CUT);
    await assert.rejects(memory.callTool("s", "memory", { action: "add", content: "x" }), {
      code: status.UNAVAILABLE,
    });
    assert.equal(received.length, 1);
  } finally {
    memory.close();
  }
});

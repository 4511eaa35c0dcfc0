// Cut connections (tests/clients/cut_proxy.py between client and daemon): a
// retried write is stored once, and export and watch resume where they were.
// The tests of this file run one after another: the proxy cuts whichever
// connection sends the next frame of the armed kind.
import assert from "node:assert/strict";
import { test } from "node:test";
import { status, type Interceptor } from "@grpc/grpc-js";
import {
  MemoryClient,
  MemoryError,
  MemoryEvent_Kind,
  type MemoryEvent,
} from "@memory-sidecar/client";
import { agent, client, control, cutTarget, cuts, recorder, timeoutMs } from "./env.js";

// The wrapper gives this agent an unlimited budget (the export needs room).
const BULK_AGENT = "ts-bulk";
// The wrapper checks in the daemon that this agent holds the write once.
const RETRY_AGENT = "ts-retry";

function throughProxy(agentId: string, interceptor?: Interceptor): MemoryClient {
  return new MemoryClient({
    address: cutTarget(),
    scope: { agentId, userId: `${agentId}-user` },
    timeoutMs,
    grpcOptions: { interceptors: interceptor ? [interceptor] : [] },
  });
}

test("a write cut after the daemon stored it is retried with its key and stored once", async () => {
  const proxied = throughProxy(RETRY_AGENT);
  const direct = client(RETRY_AGENT);
  try {
    const before = await cuts();
    assert.equal(await control("arm headers 1"), "ok");
    const added = await proxied.addMemory("The build uses uv");
    assert.equal(await cuts(), before + 1);
    // The retry found the first attempt's entry by its key.
    assert.equal(added.created, false);
    const stored = await direct.getMemories();
    assert.deepEqual(
      stored.memories.map((m) => [m.id, m.content]),
      [[added.memory!.id, "The build uses uv"]],
    );
  } finally {
    proxied.close();
    direct.close();
  }
});

test("a write without a key is not retried once it may have been stored", async () => {
  const agentId = agent("keyless");
  const proxied = throughProxy(agentId);
  const direct = client(agentId);
  try {
    const added = await direct.addMemory("Deploys go to us-east-1");
    const before = await cuts();
    assert.equal(await control("arm headers 1"), "ok");
    await assert.rejects(
      proxied.updateMemory({ match: "us-east-1", content: "Deploys go to eu-west-1" }),
      (error: unknown) => error instanceof MemoryError && error.code === status.UNAVAILABLE,
    );
    assert.equal(await cuts(), before + 1);
    // It was stored by the one attempt made.
    const stored = await direct.getMemories();
    assert.deepEqual(
      stored.memories.map((m) => [m.id, m.content]),
      [[added.memory!.id, "Deploys go to eu-west-1"]],
    );
  } finally {
    proxied.close();
    direct.close();
  }
});

test("an export cut mid-stream resumes from its last cursor: every line once", async () => {
  const direct = client(BULK_AGENT);
  const { sent, interceptor } = recorder();
  const proxied = throughProxy(BULK_AGENT, interceptor);
  try {
    // 60 entries of 8000 characters in batches of one: about 480 kB, more
    // than twice what HTTP/2's flow-control windows (64 KiB) and the
    // client's read-ahead (16 messages) let the daemon send before the
    // client reads, so a cut armed after the first batch falls mid-stream.
    const entries = 60;
    for (let n = 0; n < entries; n++) {
      await direct.addMemory(`${String(n).padStart(3, "0")} ${"x".repeat(7996)}`);
    }
    const before = await cuts();
    const lines: string[] = [];
    const cursors: string[] = [];
    for await (const batch of proxied.exportMemories({ batchSize: 1 })) {
      if (cursors.length === 0) assert.equal(await control("arm data 1"), "ok");
      cursors.push(batch.cursor);
      lines.push(...batch.jsonl.split("\n").filter((line) => line !== ""));
    }
    assert.equal(await cuts(), before + 1);
    // Opened again once, from the cursor of a batch received before the cut.
    const requests = sent.map((s) => s.message["cursor"]);
    assert.equal(requests.length, 2);
    assert.equal(requests[0], "");
    assert.ok(cursors.slice(0, -1).includes(String(requests[1])), "resumed from no cursor of ours");
    const contents = lines.map((line) => (JSON.parse(line) as { content: string }).content);
    assert.deepEqual(
      contents.map((c) => c.slice(0, 3)),
      Array.from({ length: entries }, (_, n) => String(n).padStart(3, "0")),
    );
  } finally {
    direct.close();
    proxied.close();
  }
});

test("a watch cut mid-stream resumes after its last event: none missed or repeated", async () => {
  const agentId = agent("watch");
  const direct = client(agentId);
  const { sent, interceptor } = recorder();
  const proxied = throughProxy(agentId, interceptor);
  try {
    await direct.addMemory("Note A");
    const before = await cuts();
    const seen: [string, string][] = [];
    let noteB: MemoryEvent | undefined;
    for await (const event of proxied.watchMemories()) {
      seen.push([MemoryEvent_Kind[event.kind], event.memory?.content ?? ""]);
      if (event.kind === MemoryEvent_Kind.KIND_SYNC) {
        await direct.addMemory("Note B");
      } else if (event.memory?.content === "Note B") {
        // The next event's frame is cut: C comes again after the resume.
        noteB = event;
        assert.equal(await control("arm data 1"), "ok");
        await direct.addMemory("Note C");
        await direct.addMemory("Note D");
      } else if (event.memory?.content === "Note D") {
        break;
      }
    }
    assert.equal(await cuts(), before + 1);
    assert.deepEqual(seen, [
      ["KIND_SYNC", ""],
      ["KIND_ADD", "Note B"],
      ["KIND_ADD", "Note C"],
      ["KIND_ADD", "Note D"],
    ]);
    // Opened again after B: its generation, tier and id.
    const resumed = sent.map(({ message }) => [
      message["afterGeneration"],
      message["afterTier"],
      message["afterId"],
    ]);
    assert.deepEqual(resumed, [
      [0, 0, ""],
      [noteB?.generation, noteB?.tier, noteB?.id],
    ]);
  } finally {
    direct.close();
    proxied.close();
  }
});

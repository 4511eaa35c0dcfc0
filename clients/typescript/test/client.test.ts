// The client against a real daemon: writes, reads, read-your-writes, typed
// errors, paging and the turn loop.
import assert from "node:assert/strict";
import { test } from "node:test";
import { status } from "@grpc/grpc-js";
import { BudgetError, MemoryError, Tier } from "@memory-sidecar/client";
import { agent, client, recorder } from "./env.js";

test("a read after a write carries the write's generation and sees the write", async () => {
  const { sent, interceptor } = recorder();
  const memory = client(agent("ryw"), { grpcOptions: { interceptors: [interceptor] } });
  try {
    const added = await memory.addMemory("The deploy script lives in ops/deploy.sh");
    assert.ok(added.generation > 0);
    assert.equal(memory.lastGeneration, added.generation);
    const listed = await memory.getMemories();
    assert.deepEqual(
      listed.memories.map((m) => m.content),
      ["The deploy script lives in ops/deploy.sh"],
    );
    const found = await memory.searchMemories("deploy");
    assert.equal(found.hits[0]?.memory?.id, added.memory?.id);
    const turn = await memory.turn("s1", "where is the deploy script?");
    assert.match(turn.systemBlock, /ops\/deploy\.sh/);

    const reads = sent.filter((s) => !s.method.endsWith("/AddMemory"));
    assert.deepEqual(
      reads.map((s) => [s.method.split("/").pop(), s.message["minGeneration"]]),
      [
        ["GetMemories", added.generation],
        ["SearchMemories", added.generation],
        ["InjectForTurn", added.generation],
      ],
    );
    // A later write raises it; the next read carries the new one.
    const updated = await memory.updateMemory({
      id: added.memory!.id,
      content: "ops/deploy.sh deploys",
    });
    assert.ok(updated.generation > added.generation);
    await memory.getMemories();
    assert.equal(sent.at(-1)?.message["minGeneration"], updated.generation);
  } finally {
    memory.close();
  }
});

test("a tool call's writes count for read-your-writes", async () => {
  const { sent, interceptor } = recorder();
  const memory = client(agent("tool-ryw"), { grpcOptions: { interceptors: [interceptor] } });
  try {
    const added = await memory.addMemory("The repo uses uv");
    const saved = await memory.callTool("s1", "memory", {
      action: "add",
      content: "Deploys go through ArgoCD",
    });
    assert.equal(saved.isError, false, saved.text);
    assert.ok(saved.generation > added.generation);
    assert.equal(memory.lastGeneration, saved.generation);
    // A tool that reads writes nothing: 0, and the client keeps the highest.
    const listed = await memory.callTool("s1", "memory_list", {});
    assert.equal(listed.generation, 0);
    assert.equal(memory.lastGeneration, saved.generation);
    const read = await memory.getMemories();
    assert.equal(sent.at(-1)?.message["minGeneration"], saved.generation);
    assert.deepEqual(
      read.memories.map((m) => m.content),
      ["The repo uses uv", "Deploys go through ArgoCD"],
    );
  } finally {
    memory.close();
  }
});

test("read-your-writes turned off sends no min_generation", async () => {
  const { sent, interceptor } = recorder();
  const memory = client(agent("no-ryw"), {
    readYourWrites: false,
    grpcOptions: { interceptors: [interceptor] },
  });
  try {
    await memory.addMemory("A note");
    await memory.getMemories();
    assert.equal(sent.at(-1)?.message["minGeneration"], 0);
  } finally {
    memory.close();
  }
});

test("the token goes as a bearer token and the client makes an idempotency key", async () => {
  const { sent, interceptor } = recorder();
  const memory = client(agent("token"), {
    token: "s3cret",
    grpcOptions: { interceptors: [interceptor] },
  });
  try {
    await memory.addMemory("A note");
    await memory.addMemory("Another", { idempotencyKey: "mine" });
    assert.deepEqual(sent[0]?.authorization, ["Bearer s3cret"]);
    assert.match(String(sent[0]?.message["idempotencyKey"]), /^[0-9a-f-]{36}$/);
    assert.equal(sent[1]?.message["idempotencyKey"], "mine");
  } finally {
    memory.close();
  }
});

test("a budget refusal is a BudgetError with the usage as numbers", async () => {
  const memory = client(agent("budget"));
  try {
    await memory.addMemory("x".repeat(2000));
    const full = await memory.addMemory("y".repeat(300)).then(
      () => assert.fail("the write fitted"),
      (error: unknown) => error,
    );
    assert.ok(full instanceof BudgetError && full instanceof MemoryError);
    assert.equal(full.code, status.FAILED_PRECONDITION);
    assert.equal(full.codeName, "FAILED_PRECONDITION");
    assert.equal(full.reason, "TIER_BUDGET_EXCEEDED");
    assert.equal(full.domain, "memory.v1");
    assert.deepEqual(
      [full.tier, full.usedChars, full.limitChars, full.requestedChars, full.entryChars],
      ["memory", 2000, 2200, 303, undefined],
    );
    assert.equal(full.metadata["used_chars"], "2000");

    const large = await memory.addMemory("z".repeat(2300), { tier: Tier.TIER_MEMORY }).then(
      () => assert.fail("the write fitted"),
      (error: unknown) => error,
    );
    assert.ok(large instanceof BudgetError);
    assert.equal(large.reason, "ENTRY_TOO_LARGE");
    assert.deepEqual([large.tier, large.entryChars, large.limitChars], ["memory", 2300, 2200]);
  } finally {
    memory.close();
  }
});

test("other refusals are MemoryErrors with their reason and metadata", async () => {
  const memory = client(agent("errors"));
  try {
    await assert.rejects(memory.deleteMemory({ id: "no-such-id" }), (error: unknown) => {
      assert.ok(error instanceof MemoryError && !(error instanceof BudgetError));
      assert.equal(error.code, status.NOT_FOUND);
      assert.equal(error.reason, "MEMORY_NOT_FOUND");
      assert.equal(error.metadata["id"], "no-such-id");
      return true;
    });
  } finally {
    memory.close();
  }
});

test("memories() and searchHits() follow the pages to the end", async () => {
  const { sent, interceptor } = recorder();
  const memory = client(agent("pages"), { grpcOptions: { interceptors: [interceptor] } });
  try {
    const notes = ["one", "two", "three", "four", "five"].map((n) => `Note number ${n}`);
    for (const note of notes) await memory.addMemory(note);
    const listed: string[] = [];
    for await (const entry of memory.memories({ pageSize: 2 })) listed.push(entry.content);
    assert.deepEqual(listed, notes);
    assert.equal(sent.filter((s) => s.method.endsWith("/GetMemories")).length, 3);

    const hits: string[] = [];
    for await (const hit of memory.searchHits("note", { pageSize: 2 })) {
      hits.push(hit.memory!.content);
    }
    assert.deepEqual([...hits].sort(), [...notes].sort());
  } finally {
    memory.close();
  }
});

test("the turn loop: blocks, tools in both shapes, tool calls, compaction, end", async () => {
  const memory = client(agent("loop"));
  try {
    await memory.addMemory("CI runs on Debian");
    const first = await memory.turn("s1", "where does CI run?");
    const second = await memory.turn("s1", "and the deploy?");
    assert.match(first.systemBlock, /CI runs on Debian/);
    assert.equal(second.systemBlock, first.systemBlock);
    assert.equal(second.snapshotSha256, first.snapshotSha256);
    assert.deepEqual([first.cacheHit, second.cacheHit], [false, true]);

    const openai = await memory.tools("openai");
    assert.deepEqual(
      openai.map((t) => [t["type"], (t["function"] as { name: string }).name]),
      [
        ["function", "memory"],
        ["function", "memory_search"],
        ["function", "memory_list"],
      ],
    );
    const anthropic = await memory.tools("anthropic");
    assert.deepEqual(anthropic[0], { type: "memory_20250818", name: "memory" });
    assert.deepEqual(
      anthropic.slice(1).map((t) => [t["name"], typeof t["input_schema"]]),
      [
        ["memory_search", "object"],
        ["memory_list", "object"],
      ],
    );

    const saved = await memory.callTool("s1", "memory", {
      action: "add",
      content: "Deploy target is eu-west-1",
    });
    assert.equal(saved.isError, false);
    assert.match(saved.text, /^Saved to agent notes/);
    const viewed = await memory.callTool(
      "s1",
      "memory",
      { command: "view", path: "/memories/notes.md" },
      { format: "anthropic" },
    );
    assert.equal(viewed.isError, false);
    assert.match(viewed.text, /Deploy target is eu-west-1/);
    const remove = '{"action": "remove", "old_text": "Windows"}';
    const wrong = await memory.callTool("s1", "memory", remove);
    assert.equal(wrong.isError, true);

    const compacted = await memory.notifyCompaction("s1");
    assert.equal(compacted.invalidated, true);
    const rebuilt = await memory.turn("s1", "again");
    assert.match(rebuilt.systemBlock, /eu-west-1/);
    const ended = await memory.endSession("s1");
    assert.equal(ended.dropped, true);
    assert.equal((await memory.endSession("s1")).dropped, false);
  } finally {
    memory.close();
  }
});

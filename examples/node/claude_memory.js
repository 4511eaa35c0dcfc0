// Claude's own memory tool (memory_20250818) from Node.js, through the
// sidecar: the SDK's memory-tool helper (`betaMemoryTool`) parses each of
// Claude's tool_use inputs into a command and hands it to a handler; every
// handler here sends the command to CallTool as it is, and what comes back
// is the tool_result. Same stubs as client.js (stubs.js loads them).
//
//   node claude_memory.js [ADDRESS]      (default 127.0.0.1:50051)
//
// No model is called: the tool_use blocks are the ones Claude would write.
// It prints the declaration ListTools gives and the SDK's own, then one JSON
// line per tool_use with the tool_result it gets.
"use strict";

const { betaMemoryTool } = require("@anthropic-ai/sdk/helpers/beta/memory");
const { ToolError } = require("@anthropic-ai/sdk/lib/tools/ToolError");
const { connect, call } = require("./stubs");

async function main() {
  const address = process.argv[2] || "127.0.0.1:50051";
  const client = connect(address);
  // The runtime's scope: the model never names it.
  const scope = { agent_id: "node-agent", user_id: "node-user" };
  const say = (step, data) => console.log(JSON.stringify({ step, ...data }));

  // Every command goes to the sidecar as it is; a refusal is a ToolError,
  // which the SDK's tool runner turns into a tool_result with is_error.
  const forward = async (command) => {
    const result = await call(client, "CallTool", {
      scope,
      session_id: "node-session",
      name: "memory_20250818",
      arguments_json: JSON.stringify(command),
    });
    if (result.is_error) throw new ToolError(result.text);
    return result.text;
  };
  const memory = betaMemoryTool({
    view: forward,
    create: forward,
    str_replace: forward,
    insert: forward,
    delete: forward,
    rename: forward,
  });

  // How to declare it to Anthropic's API: what ListTools says, and what the
  // SDK's helper declares (pass `memory` in `tools` to client.beta.messages).
  const { claude_memory_tool: listed } = await call(client, "ListTools", { scope });
  say("declaration", {
    listed: JSON.parse(listed.anthropic_json),
    sdk: { type: memory.type, name: memory.name },
  });

  // Claude's tool_use blocks, as a response's content holds them.
  const toolUses = [
    { command: "view", path: "/memories" },
    { command: "create", path: "/memories/notes.md", file_text: "Deploy target is AWS us-east-1\nCI runs on Debian\n" },
    { command: "str_replace", path: "/memories/notes.md", old_str: "us-east-1", new_str: "eu-west-1" },
    { command: "insert", path: "/memories/user.md", insert_line: 0, insert_text: "The user prefers short answers" },
    { command: "view", path: "/memories/notes.md", view_range: [1, 1] },
    { command: "str_replace", path: "/memories/notes.md", old_str: "Windows", new_str: "Linux" },
    { command: "delete", path: "/memories/notes.md" },
    { command: "view", path: "/memories/../etc/passwd" },
  ].map((input, n) => ({ type: "tool_use", id: `toolu_${n}`, name: "memory", input }));

  for (const block of toolUses) {
    let content;
    let isError = false;
    try {
      content = await memory.run(memory.parse(block.input));
    } catch (error) {
      if (!(error instanceof ToolError)) throw error;
      content = error.content;
      isError = true;
    }
    // What goes back to Claude in the next user message.
    const toolResult = { type: "tool_result", tool_use_id: block.id, content, is_error: isError };
    say("tool_result", { command: block.input.command, tool_result: toolResult });
  }
  client.close();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

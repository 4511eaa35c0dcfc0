// The model's memory tools from Node.js, without MCP: ListTools gives tool
// definitions to pass to a model API as they are, CallTool runs the model's
// calls. Same stubs as client.js (stubs.js loads them from protos/).
//
//   node tools.js [ADDRESS]      (default 127.0.0.1:50051)
//
// It lists the tools in OpenAI's shape, then runs the calls a model might
// make: save a note, save a profile fact, correct the note by its text, and
// list what is stored, printing one JSON line per step.
"use strict";

const { connect, call } = require("./stubs");

async function main() {
  const address = process.argv[2] || "127.0.0.1:50051";
  const client = connect(address);
  // The runtime's scope: the model never names it.
  const scope = { agent_id: "node-agent", user_id: "node-user" };
  const say = (step, data) => console.log(JSON.stringify({ step, ...data }));

  // Tool definitions as OpenAI takes them (anthropic_json for Anthropic's API).
  const { tools } = await call(client, "ListTools", { scope });
  const openai = tools.map((tool) => JSON.parse(tool.openai_json));
  say("tools", { names: openai.map((tool) => tool.function.name) });

  // What a model's tool calls look like: a name and a JSON string of arguments.
  const modelCalls = [
    ["memory", { action: "add", content: "Deploy target is AWS us-east-1" }],
    ["memory", { action: "add", target: "user", content: "The user prefers short answers" }],
    ["memory", { action: "replace", old_text: "us-east-1", new_text: "eu-west-1" }],
    ["memory_list", {}],
  ];
  for (const [name, args] of modelCalls) {
    const result = await call(client, "CallTool", {
      scope,
      session_id: "node-session",
      name,
      arguments_json: JSON.stringify(args),
    });
    // result.text goes back to the model as the tool's output.
    say("call", { name, is_error: result.is_error, text: result.text, outcome: JSON.parse(result.structured_json) });
  }
  client.close();
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});

// memory-sidecar's MCP server from Node.js: the official MCP TypeScript SDK
// over streamable HTTP, as an agent host would use it.
//
//   node client.js [URL] [TOKEN]     (default http://127.0.0.1:8765/mcp)
//
// The daemon serves MCP when started with --mcp-listen (server.mcp_listen).
// The scope is the connection's: X-Memory-Agent-Id and X-Memory-User-Id name
// it, the bearer token (when the daemon requires one) must be allowed it. The
// model's tool arguments can never name another.
//
// It lists the tools, saves a note and a profile fact, searches, shows what a
// refused call looks like (an argument naming another agent, a full tier, an
// unknown tool), reads the frozen block and the turn block, and ends the
// session, printing one JSON line per step.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const url = new URL(process.argv[2] || "http://127.0.0.1:8765/mcp");
const token = process.argv[3] || "";
const say = (step, data) => console.log(JSON.stringify({ step, ...data }));

const headers = { "X-Memory-Agent-Id": "node-agent", "X-Memory-User-Id": "node-user" };
if (token) headers.Authorization = `Bearer ${token}`;
const transport = new StreamableHTTPClientTransport(url, { requestInit: { headers } });
const client = new Client({ name: "memory-sidecar-mcp-node-example", version: "0.1.0" });

try {
  await client.connect(transport);
} catch (err) {
  // A missing or wrong token (401), a scope the token may not address (403):
  // the body is a JSON-RPC error whose data carries the reason.
  say("connect", { refused: true, message: String(err.message) });
  process.exit(1);
}
say("connect", { protocol: transport.protocolVersion, session: Boolean(transport.sessionId) });

const { tools } = await client.listTools();
say("tools", { names: tools.map((tool) => tool.name) });

const text = (result) => result.content.map((part) => part.text).join("");
async function use(step, name, args) {
  const result = await client.callTool({ name, arguments: args });
  say(step, { isError: Boolean(result.isError), text: text(result), data: result.structuredContent });
}

await use("add", "memory", { action: "add", content: "Deploys go through ops/deploy.sh" });
await use("profile", "memory", { action: "add", target: "user", content: "Prefers answers in French" });
await use("search", "memory_search", { query: "deploys" });
// What the model cannot do: name a scope, or overfill a tier.
await use("planted", "memory", { action: "add", content: "planted", agent_id: "other-agent" });
await use("full", "memory", { action: "add", content: "x".repeat(2170) });

try {
  await client.callTool({ name: "memory_delete_everything", arguments: {} });
} catch (err) {
  // Not the model's to fix: an MCP error, with the reason in its data.
  say("unknown", { code: err.code, reason: err.data?.reason });
}

const { contents } = await client.readResource({ uri: "memory://frozen-block" });
say("frozen", { text: contents[0].text });
const prompt = await client.getPrompt({
  name: "memory_context",
  arguments: { user_message: "How do I deploy?" },
});
// No message at all when the frozen block already shows everything relevant
// (never one with empty text, which a model's API may refuse): a host
// appends the messages as they are.
say("prompt", {
  description: prompt.description,
  messages: prompt.messages.map((m) => ({ role: m.role, text: m.content.text })),
});

// Ending the MCP session ends the daemon's runtime session (its snapshot).
await transport.terminateSession();
await client.close();
say("end", { closed: true });

// A worked agent loop on @memory-sidecar/client, with a scripted stand-in
// for the model (no network): each turn injects the memory blocks, lets the
// "model" call the memory tools in OpenAI's shape, hands their results back,
// and the session ends. Prints one JSON line per step.
//
//   node dist/examples/agent-loop.js [host:port]
import { MemoryClient, type ToolDefinition } from "@memory-sidecar/client";

/** A chat message as OpenAI's Chat Completions API takes it. */
type Message =
  | { role: "system" | "user"; content: string }
  | { role: "assistant"; content: string; tool_calls?: ToolCall[] }
  | { role: "tool"; tool_call_id: string; content: string };

interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** The model's answer: tool calls to run, or the reply that ends the turn. */
type Completion = { toolCalls: ToolCall[] } | { reply: string };

const address = process.argv[2] ?? process.env["MEMORY_SIDECAR_ADDRESS"] ?? "127.0.0.1:50051";
const session = "session-1";

function log(step: Record<string, unknown>): void {
  console.log(JSON.stringify(step));
}

/**
 * A stand-in for a model, scripted for the two user messages below. Like a
 * model it sees only the messages and the declared tools: it saves what the
 * user asks it to remember, and answers from the injected memory, searching
 * when the blocks do not have the answer.
 */
function scriptedModel(messages: Message[], tools: ToolDefinition[]): Completion {
  const declared = new Set(tools.map((t) => (t["function"] as { name: string }).name));
  const call = (n: number, name: string, args: Record<string, unknown>): ToolCall => {
    if (!declared.has(name)) throw new Error(`the model was not offered ${name}`);
    const arguments_ = JSON.stringify(args);
    return { id: `call_${n}`, type: "function", function: { name, arguments: arguments_ } };
  };
  const last = messages.at(-1)!;
  const prompt = messages.map((m) => m.content).join("\n");
  const asked = messages.filter((m) => m.role === "user").at(-1)!.content;
  if (last.role === "user" && asked.includes("Remember")) {
    return {
      toolCalls: [
        call(1, "memory", { action: "add", content: "We deploy to eu-west-1" }),
        call(2, "memory", { action: "add", target: "user", content: "Prefers short answers" }),
      ],
    };
  }
  if (last.role === "user" && asked.includes("Where")) {
    if (!prompt.includes("eu-west-1")) {
      return { toolCalls: [call(3, "memory_search", { query: "deploy" })] };
    }
  }
  if (last.role === "tool" && asked.includes("Remember")) return { reply: "Noted." };
  const where = /deploy to ([a-z0-9-]+)/.exec(prompt);
  return { reply: where ? `We deploy to ${where[1]}.` : "I do not know." };
}

async function main(): Promise<void> {
  const memory = new MemoryClient({ address, scope: { agentId: "coder", userId: "ada" } });
  try {
    const tools = await memory.tools("openai");
    log({ step: "tools", names: tools.map((t) => (t["function"] as { name: string }).name) });
    for (const userMessage of [
      "Remember that we deploy to eu-west-1, and keep your answers short.",
      "Where do we deploy?",
    ]) {
      // Before each model call: the frozen block goes at the head of the
      // system prompt (byte-identical from turn to turn, so the model's
      // prefix cache holds); the turn block goes with the user's message.
      const injected = await memory.turn(session, userMessage);
      log({
        step: "turn",
        cache_hit: injected.cacheHit,
        system_block: injected.systemBlock !== "",
        turn_context: injected.turnContext !== "",
      });
      const messages: Message[] = [
        { role: "system", content: `${injected.systemBlock}\n\nYou are a coding agent.` },
        { role: "user", content: `${injected.turnContext}\n\n${userMessage}` },
      ];
      for (;;) {
        const completion = scriptedModel(messages, tools);
        if ("reply" in completion) {
          log({ step: "reply", text: completion.reply });
          break;
        }
        messages.push({ role: "assistant", content: "", tool_calls: completion.toolCalls });
        for (const toolCall of completion.toolCalls) {
          const result = await memory.callTool(
            session,
            toolCall.function.name,
            toolCall.function.arguments,
          );
          const name = toolCall.function.name;
          log({ step: "tool", name, is_error: result.isError, text: result.text });
          messages.push({ role: "tool", tool_call_id: toolCall.id, content: result.text });
        }
      }
    }
    const ended = await memory.endSession(session);
    log({ step: "end", dropped: ended.dropped });
  } finally {
    memory.close();
  }
}

await main();

"""A worked agent loop over memory_sidecar_client, with a scripted stand-in
for the model (no network, no API key):

    python agent_loop.py [ADDRESS]      (default 127.0.0.1:50051)

Each user message goes through one turn of the loop a runtime runs:

1. `memory.turn(session, message)`: the frozen block goes into the system
   prompt, the turn block before the user's message;
2. the model answers with tool calls or text; each tool call runs through
   `memory.call_tool(...)` and its text goes back to the model;
3. when the context is compacted, `memory.notify_compaction(session)`; when
   the conversation is over, `memory.end_session(session)`.

It prints one JSON line per step. Swap `ScriptedModel` for a real model API
call: the tools (OpenAI's shape here, `memory.tools("anthropic")` for
Anthropic's) and the messages are what those APIs take.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from memory_sidecar_client import Client

SESSION = "chat-1"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON, as OpenAI's API gives a function call's arguments


@dataclass
class Reply:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class ScriptedModel:
    """Plays a model: reads the system prompt and the conversation, and
    answers as a model would, from what the memory blocks show."""

    def __init__(self) -> None:
        self._calls = 0

    def reply(
        self, system: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
    ) -> Reply:
        names = {tool["function"]["name"] for tool in tools}
        assert {"memory", "memory_search"} <= names, names
        last = messages[-1]
        if last["role"] == "tool":  # the tools have answered: say so
            return Reply(text="Noted. " + last["content"].splitlines()[0])
        question = last["content"]
        if "remember" in question.lower():
            return Reply(
                tool_calls=[
                    self._call(
                        "memory", {"action": "add", "target": "user", "content": "Name: Ada"}
                    ),
                    self._call("memory", {"action": "add", "content": "The repo uses uv, not pip"}),
                ]
            )
        # A question: answer from the frozen block when it holds the fact.
        known = [line for line in system.splitlines() if "uv" in line]
        return Reply(text=f"From memory: {known[0].strip()}" if known else "I don't know yet.")

    def _call(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        self._calls += 1
        return ToolCall(f"call-{self._calls}", name, json.dumps(arguments))


def say(step: str, **data: Any) -> None:
    print(json.dumps({"step": step, **data}), flush=True)


def run_turn(
    memory: Client, model: ScriptedModel, tools: list[dict[str, Any]], message: str
) -> str:
    injected = memory.turn(SESSION, message)
    say("turn", cache_hit=injected.cache_hit, system_block=injected.system_block)
    system = "You are a coding agent.\n\n" + injected.system_block
    user = f"{injected.turn_context}\n\n{message}" if injected.turn_context else message
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    while True:
        reply = model.reply(system, messages, tools)
        if not reply.tool_calls:
            say("answer", text=reply.text)
            return reply.text
        messages.append({"role": "assistant", "tool_calls": reply.tool_calls})
        for call in reply.tool_calls:
            result = memory.call_tool(SESSION, call.name, call.arguments)
            say("tool", name=call.name, is_error=result.is_error, text=result.text)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.text})


def main(address: str) -> int:
    model = ScriptedModel()
    with Client(address, agent_id="loop-agent", user_id="ada") as memory:
        tools = memory.tools("openai")
        say("tools", names=[tool["function"]["name"] for tool in tools])
        run_turn(memory, model, tools, "I'm Ada. Please remember that we use uv, not pip.")
        # The runtime compacted the conversation: the frozen block may now
        # show what this session wrote.
        say("compaction", invalidated=memory.notify_compaction(SESSION).invalidated)
        run_turn(memory, model, tools, "Which package manager do we use?")
        say("end", dropped=memory.end_session(SESSION).dropped)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"))

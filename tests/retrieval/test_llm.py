"""The llm keyword strategy against a real local chat-completions server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    WAIT_SECONDS,
    MakeSidecar,
    Running,
    eventually,
)
from tests.endpoint import JsonEndpoint

SCOPE = pb.Scope(agent_id="companion", user_id="caroline")


@dataclass
class ChatServer(JsonEndpoint):
    """Speaks just enough of the OpenAI chat-completions protocol."""

    reply: str = "dogs, shelter"

    def answer(self, body: dict[str, Any]) -> bytes:
        return json.dumps(
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": self.reply},
                        "finish_reason": "stop",
                    }
                ],
            }
        ).encode()


@pytest.fixture
def chat() -> Iterator[ChatServer]:
    state = ChatServer()
    with state.serving():
        yield state


def llm_sidecar(make_sidecar: MakeSidecar, chat: ChatServer, *, timeout: float = 10.0) -> Running:
    """(A deadline no loaded machine misses, unless a test of it passes one.)"""
    yaml_text = f"""
defaults:
  inject_system_block: false
agents:
  companion:
    inject_memories_strategy: llm
    keyword_llm_base_url: http://127.0.0.1:{chat.port}/v1
    keyword_llm_model: keyword-model
    keyword_llm_api_key_env: KEYWORD_API_KEY
    keyword_llm_timeout_seconds: {timeout}
"""
    running = make_sidecar(yaml_text, environ={"KEYWORD_API_KEY": "sk-test-123"})
    running.add("Caroline adopted two dogs from the shelter", scope=SCOPE)
    running.add("Melanie paints landscapes on weekends", scope=SCOPE)
    return running


def fallbacks(running: Running, reason: str) -> float:
    return (
        running.sidecar.metrics.registry.get_sample_value(
            "memory_keyword_fallbacks_total", {"reason": reason}
        )
        or 0.0
    )


def test_the_model_is_asked_for_keywords(make_sidecar: MakeSidecar, chat: ChatServer) -> None:
    running = llm_sidecar(make_sidecar, chat)
    turn = running.turn("s", "Tell me something nice about my friend", scope=SCOPE)

    assert len(chat.requests) == 1
    request = chat.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["auth"] == "Bearer sk-test-123"
    assert request["body"]["model"] == "keyword-model"
    assert request["body"]["messages"][-1] == {
        "role": "user",
        "content": "Tell me something nice about my friend",
    }
    # The model's keywords (dogs, shelter) chose the memory; the message alone
    # shares no word with it.
    assert turn.turn_context.count("<memory ") == 1
    assert "adopted two dogs" in turn.turn_context


def test_keywords_from_the_runtime_skip_the_model(
    make_sidecar: MakeSidecar, chat: ChatServer
) -> None:
    running = llm_sidecar(make_sidecar, chat)
    turn = running.turn("s", "anything at all", scope=SCOPE, keywords=["landscapes"])
    assert chat.requests == []
    assert "Melanie paints" in turn.turn_context
    assert "dogs" not in turn.turn_context


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ({"status": 500}, "http_error"),
        ({"delay": 1.0}, "timeout"),
        ({"reply": "the and of"}, "empty"),
    ],
)
def test_failures_fall_back_to_local_keywords_and_are_counted(
    make_sidecar: MakeSidecar, chat: ChatServer, setup: dict[str, Any], reason: str
) -> None:
    for key, value in setup.items():
        setattr(chat, key, value)
    # The deadline is short only where it is what fails: elsewhere a loaded
    # machine could miss it and count a timeout instead.
    running = llm_sidecar(make_sidecar, chat, timeout=0.3 if reason == "timeout" else 10.0)
    turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert len(chat.requests) == 1
    assert fallbacks(running, reason) == 1
    # The local tokenizer found the memory from the message itself.
    assert "Melanie paints" in turn.turn_context
    assert "dogs" not in turn.turn_context


def test_after_a_failure_turns_skip_the_endpoint_until_a_pause_ends(
    make_sidecar: MakeSidecar, chat: ChatServer
) -> None:
    chat.status = 500
    running = llm_sidecar(make_sidecar, chat)
    running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert len(chat.requests) == 1
    # Within the pause (1 s): not asked, local keywords, counted.
    turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert len(chat.requests) == 1
    assert fallbacks(running, "paused") == 1
    assert "Melanie paints" in turn.turn_context
    # It answers again: the first turn after the pause asks it, and its
    # keywords are used; the next turn asks it too (the pause is over).
    chat.status = 200

    def asked_again() -> pb.InjectForTurnResponse | None:
        turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
        return turn if len(chat.requests) > 1 else None

    turn = eventually(asked_again, "the endpoint is asked again", pause=0.1)
    assert "Caroline adopted two dogs" in turn.turn_context
    running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert len(chat.requests) == 3
    assert fallbacks(running, "http_error") == 1


def test_an_unreachable_endpoint_falls_back(make_sidecar: MakeSidecar) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), ChatServer().handler()) as probe:
        port = probe.server_address[1]
    # Nothing listens on `port` any more.
    running = make_sidecar(f"""
defaults:
  inject_system_block: false
  inject_memories_strategy: llm
  keyword_llm_base_url: http://127.0.0.1:{port}/v1
  keyword_llm_model: m
""")
    running.add("Melanie paints landscapes on weekends", scope=SCOPE)
    turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert fallbacks(running, "unreachable") == 1
    assert "Melanie paints" in turn.turn_context


def test_llm_requested_without_an_endpoint_falls_back(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("defaults: {inject_system_block: false}")
    running.add("Melanie paints landscapes on weekends", scope=SCOPE)
    turn = running.turn("s", "Does Melanie paint?", scope=SCOPE, strategy=pb.KEYWORD_STRATEGY_LLM)
    assert fallbacks(running, "no_endpoint") == 1
    assert "Melanie paints" in turn.turn_context


def test_the_api_key_variable_must_be_set(make_sidecar: MakeSidecar) -> None:
    from sidecar.core.errors import ConfigError

    with pytest.raises(ConfigError, match="KEYWORD_API_KEY is not set"):
        make_sidecar(
            "defaults: {keyword_llm_base_url: 'http://x/v1', keyword_llm_model: m,"
            " keyword_llm_api_key_env: KEYWORD_API_KEY}"
        )


def test_the_timeout_bounds_the_whole_call_not_each_read(
    make_sidecar: MakeSidecar, chat: ChatServer
) -> None:
    # Every byte arrives well within the timeout, the whole reply (~200
    # bytes, 0.05 s apart) takes ten seconds: the call gives up at the
    # deadline, hangs up, and the turn falls back to local keywords.
    chat.trickle = 0.05
    running = llm_sidecar(make_sidecar, chat, timeout=0.5)
    turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert fallbacks(running, "timeout") == 1
    assert "Melanie paints" in turn.turn_context
    assert chat.cut_off.wait(WAIT_SECONDS)


@pytest.mark.parametrize(
    ("base_url", "api_key"),
    [
        ("http://127.0.0.1:99999/v1", "k"),  # no such port
        ("http://127.0.0.1:abc/v1", "k"),
        ("http://a..b/v1", "k"),  # a host name that cannot be encoded
        ("http://127.0.0.1:9/v1", "line\nbreak"),  # a key that is no header value
    ],
)
def test_a_misconfigured_endpoint_falls_back_instead_of_failing(
    make_sidecar: MakeSidecar, base_url: str, api_key: str
) -> None:
    running = make_sidecar(
        f"""
defaults:
  inject_system_block: false
  inject_memories_strategy: llm
  keyword_llm_base_url: "{base_url}"
  keyword_llm_model: m
  keyword_llm_api_key_env: KEYWORD_API_KEY
""",
        environ={"KEYWORD_API_KEY": api_key},
    )
    running.add("Melanie paints landscapes on weekends", scope=SCOPE)
    turn = running.turn("s", "Does Melanie still paint?", scope=SCOPE)
    assert fallbacks(running, "unreachable") == 1
    assert "Melanie paints" in turn.turn_context

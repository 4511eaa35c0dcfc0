"""Token counting: tiktoken's cl100k_base when it loads, len // 4 otherwise.

tiktoken fetches its encoding file from the network on first use, which
cannot happen here; the loader is injected to exercise both branches.
"""

from __future__ import annotations

from typing import Any

from sidecar.core.tokens import CHARS_DIV_4, TIKTOKEN, TokenCounter


class WordEncoding:
    """Stands in for a loaded tiktoken encoding: one token per word."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def encode(self, text: str, *, disallowed_special: Any = ...) -> list[int]:
        self.calls.append(disallowed_special)
        return list(range(len(text.split())))


def test_falls_back_to_chars_div_4_when_tiktoken_cannot_load() -> None:
    def unavailable() -> Any:
        raise ImportError("No module named 'tiktoken'")

    counter = TokenCounter(unavailable)
    assert counter.name == CHARS_DIV_4
    assert counter.count("x" * 41) == 10
    assert counter.count("") == 0


def test_a_failed_encoding_download_also_falls_back() -> None:
    def offline() -> Any:
        raise OSError("could not fetch cl100k_base.tiktoken")

    assert TokenCounter(offline).name == CHARS_DIV_4


def test_uses_the_encoding_when_it_loads() -> None:
    encoding = WordEncoding()
    counter = TokenCounter(lambda: encoding)
    assert counter.name == TIKTOKEN
    assert counter.count("four words right here <|endoftext|>") == 5
    # Memory text is data: special-token look-alikes are counted, not refused.
    assert encoding.calls == [()]


def test_the_default_loader_without_tiktoken_installed() -> None:
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        assert TokenCounter().name == CHARS_DIV_4
    else:  # pragma: no cover - only where the tokens extra is installed
        assert TokenCounter().name in (TIKTOKEN, CHARS_DIV_4)

"""Content scanning: memories are injected into system prompts, so writes are
screened for what could steer or exfiltrate through them (as Hermes' memory
tool does).

Two kinds of finding, each with a stable name reported in ErrorInfo:

- invisible or direction-changing Unicode (zero-width characters, bidi
  overrides and isolates, tag characters, BOM): text a person reviewing the
  store cannot see but a model reads;
- phrases that address the model instead of recording a fact: instruction
  overrides, role or system-prompt tampering, and exfiltration (sending data
  to a URL, fetching with credentials).

Patterns catch the common, literal forms. They are a tripwire, not a proof of
safety: paraphrases, other languages and encodings get through (see
docs/SECURITY.md).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

MODES = ("strict", "warn", "off")

PLACEHOLDER = "[memory withheld: it failed the content scan ({pattern})]"

_INVISIBLE = re.compile(
    "["
    "\u00ad"  # soft hyphen
    "\u180e"  # Mongolian vowel separator
    "\u200b-\u200f"  # zero-width space/joiners, LRM, RLM
    "\u202a-\u202e"  # bidi embeddings and overrides
    "\u2060-\u2064"  # word joiner, invisible operators
    "\u2066-\u2069"  # bidi isolates
    "\ufeff"  # BOM / zero-width no-break space
    "\U000e0000-\U000e007f"  # tag characters
    "]"
)

_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        (
            "ignore_instructions",
            r"\b(ignore|disregard|forget|override)\b.{0,40}\b(previous|prior|above|earlier|all|"
            r"any|your|system)\b.{0,20}\b(instructions?|prompts?|rules|guidelines|directions)\b",
        ),
        ("new_instructions", r"\b(new|updated|real|actual)\s+(system\s+)?instructions?\s*:"),
        (
            "role_override",
            r"\byou\s+are\s+now\b|\bfrom\s+now\s+on,?\s+you\b|\bact\s+as\s+(an?\s+)?(unrestricted|"
            r"jailbroken|dan)\b",
        ),
        (
            "system_prompt",
            r"<\s*/?\s*(system|assistant|instructions?)\s*>|\[/?INST\]|<\|im_(start|end)\|>|"
            r"^\s*#{1,6}\s*system\b|\b(reveal|print|show|repeat|leak)\b.{0,30}\bsystem\s+prompt\b",
        ),
        (
            "exfiltration",
            r"\b(send|post|upload|forward|exfiltrate|transmit|leak)\b.{0,60}\b(to|via)\b.{0,20}"
            r"(https?://|webhook|\S+@\S+\.\w+)|"
            r"\b(curl|wget)\b[^\n]{0,80}\s(-d|--data\S*|-F|--form|-T|--upload-file|--post-data|"
            r"--post-file)\s|"
            r"!\[[^\]]*\]\(\s*https?://[^)]*[?&][^)]*=|https?://\S*\?\S*=\{",
        ),
        (
            "credential_request",
            r"\b(api[\s_-]?keys?|passwords?|secrets?|tokens?|credentials?|ssh\s+keys?)\b.{0,40}"
            r"\b(send|post|include|append|paste|share|reveal)\b|"
            r"\b(send|post|include|append|paste|share|reveal)\b.{0,40}\b(api[\s_-]?keys?|passwords?|"
            r"secrets?|credentials?|ssh\s+keys?)\b",
        ),
    )
)


@dataclass(frozen=True, slots=True)
class Finding:
    pattern: str
    excerpt: str


def scan(text: str) -> Finding | None:
    """The first finding in a text, or None when it looks like plain data."""
    invisible = _INVISIBLE.search(text)
    if invisible:
        name = unicodedata.name(invisible.group(), f"U+{ord(invisible.group()):04X}")
        return Finding("invisible_unicode", name)
    folded = unicodedata.normalize("NFKC", text)
    for name, pattern in _PATTERNS:
        match = pattern.search(folded)
        if match:
            return Finding(name, match.group()[:80])
    return None

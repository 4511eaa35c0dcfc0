"""Domain types: tiers, scopes, memories, usage, and the rules on their fields.

Nothing here knows about gRPC or the database.

Owns: Tier, Scope (which owner holds each tier), Memory, Usage, SEPARATOR and the
rendered-size rule, and the checks on content and confidence. Must not touch:
configuration, the clock, or any I/O; of the package it imports only
sidecar.core.errors.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sidecar.core.errors import InvalidArgument, Reason

# Entries are rendered into the system prompt joined by this separator, and a
# tier's budget counts the rendered size (seed 003, Hermes' memory tool).
SEPARATOR = "\n§\n"
SEPARATOR_CHARS = len(SEPARATOR)


class Tier(enum.Enum):
    MEMORY = "memory"
    USER = "user"

    @property
    def label(self) -> str:
        """How a person (or a model) reads the tier's name in a message."""
        return "agent notes" if self is Tier.MEMORY else "user profile"


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose memories a request sees. Empty ids are the default scope."""

    agent_id: str = ""
    user_id: str = ""

    def owner(self, tier: Tier) -> str:
        """Agent notes belong to the agent; the user profile to the user."""
        return self.agent_id if tier is Tier.MEMORY else self.user_id


@dataclass(frozen=True, slots=True)
class Memory:
    id: str
    tier: Tier
    content: str
    category: str
    confidence: float
    created_at: datetime
    updated_at: datetime
    # Insertion order across the whole store: the tie-breaker everywhere.
    seq: int = 0
    # When it expires (never: None); an expired entry is never read back.
    expires_at: datetime | None = None
    # Set only on an agent note a for_user export reads as written for that
    # user (its writer; schema 10). Never shown to the model.
    written_for: str | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tier's entries occupy, as counted by the store."""

    used_chars: int = 0
    entry_count: int = 0

    @classmethod
    def of(cls, lengths: Iterable[int]) -> Usage:
        lengths = list(lengths)
        return cls(rendered_chars(sum(lengths), len(lengths)), len(lengths))


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: Tier
    used_chars: int
    limit_chars: int
    entry_count: int
    enabled: bool


def rendered_chars(content_chars: int, entry_count: int) -> int:
    """Size of `entry_count` entries joined by SEPARATOR, in code points."""
    if entry_count == 0:
        return 0
    return content_chars + SEPARATOR_CHARS * (entry_count - 1)


def clean_content(content: str) -> str:
    """The content as stored: stripped, and never empty."""
    stripped = content.strip()
    if not stripped:
        raise InvalidArgument(
            "content is empty; a memory needs some text", reason=Reason.CONTENT_EMPTY
        )
    return stripped


def check_confidence(confidence: float) -> float:
    if math.isnan(confidence) or not 0.0 <= confidence <= 1.0:
        raise InvalidArgument(
            f"confidence must be between 0 and 1, got {confidence!r}",
            reason=Reason.CONFIDENCE_OUT_OF_RANGE,
            metadata={"confidence": confidence},
        )
    return confidence

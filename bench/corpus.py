"""Synthetic but conversational memories and questions, reproducible by seed.

Words follow a Zipf-like distribution (a few very common, a long tail of
rare ones), with names, places and dates mixed in, so postings lists have
the skew real notes have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

NAMES = [
    "Caroline",
    "Melanie",
    "Ada",
    "Grace",
    "Linus",
    "Margaret",
    "Alan",
    "Barbara",
    "Dennis",
    "Frances",
    "Ken",
    "Radia",
    "Tim",
    "Hedy",
    "Edsger",
    "Katherine",
]
PLACES = [
    "Berlin",
    "Lisbon",
    "Osaka",
    "Nairobi",
    "Quito",
    "Oslo",
    "Austin",
    "Hanoi",
    "Porto",
    "Tbilisi",
    "Leeds",
    "Perth",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
COMMON = [
    "project",
    "user",
    "prefers",
    "team",
    "work",
    "likes",
    "meeting",
    "weekend",
    "family",
    "trip",
    "deploy",
    "service",
    "friend",
    "book",
    "music",
    "coffee",
    "morning",
    "evening",
    "school",
    "garden",
    "dinner",
    "travel",
    "code",
    "review",
]


def _vocabulary(rng: random.Random, size: int) -> list[str]:
    letters = "abcdefghijklmnoprstuvwy"
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(4, 9))))
    return sorted(words)


class Corpus:
    def __init__(self, seed: int = 7, vocabulary: int = 6000) -> None:
        self.rng = random.Random(seed)
        self.words = COMMON + _vocabulary(self.rng, vocabulary)
        # Zipf weights: the k-th word is drawn with weight 1/k.
        self.weights = [1 / (k + 1) for k in range(len(self.words))]

    def sentence(self) -> str:
        rng = self.rng
        parts = [rng.choice(NAMES)]
        parts += rng.choices(self.words, weights=self.weights, k=rng.randint(8, 16))
        if rng.random() < 0.5:
            parts += ["in", rng.choice(PLACES)]
        if rng.random() < 0.4:
            parts += [
                "on",
                str(rng.randint(1, 28)),
                rng.choice(MONTHS),
                str(rng.randint(2019, 2026)),
            ]
        return " ".join(parts) + "."

    def memories(self, count: int) -> Iterator[str]:
        seen: set[str] = set()
        while len(seen) < count:
            text = self.sentence()
            if text not in seen:
                seen.add(text)
                yield text

    def question(self, memory: str) -> str:
        """Five keywords of one memory, phrased as a question."""
        words = [w.strip(".") for w in memory.split() if len(w.strip(".")) > 3]
        picked = self.rng.sample(words, min(5, len(words)))
        return "What do you know about " + " ".join(picked) + "?"

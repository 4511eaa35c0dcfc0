"""Near-duplicates: how nearly a new entry repeats the entries of its tier.

Agents pile up restatements ("User prefers dark mode" beside "The user
likes dark mode"). An AddMemory scores its content against the entries of
the tier it writes to, and reports (or, by the agent's similar_writes,
refuses) those scoring at least the agent's similar_threshold:

    lexical = Dice over the stemmed keyword terms of the two texts
            = 2 * |shared terms| / (|terms of one| + |terms of the other|)
    score   = lexical                                      lexically
            = (1 - COSINE_WEIGHT) * lexical
              + COSINE_WEIGHT * max(cosine, 0)             with an embedding

The terms are sidecar.retrieval.keywords' (lowercased, stopwords dropped, stemmed),
so "prefers"/"preferred" and "migrations"/"migration" meet; the cosine is
of the two texts' embeddings (sidecar.retrieval.semantic), which catches a
restatement sharing few words ("User hates long meetings", "The user
strongly dislikes lengthy meetings": Dice 0.44, cosine 0.94).

Two texts that each name a number or an identifier the other does not
("svc-7 restarts nightly", "svc-8 restarts nightly"; PostgreSQL 15 and
16) are about two things, however alike their words and meaning: they
score 0. One that only adds an identifier to the other is scored as usual.

Only a few entries are scored: the best CANDIDATES by BM25 over the new
content's RAREST terms (sidecar.retrieval.ranking.rank) and, with cosines, the
CANDIDATES nearest in meaning. Dice, the blend weight and the default
threshold were chosen on the tuning half of bench/similarity/pairs.jsonl;
`make bench` section 18 reports the held-out half.

Owns: the similarity score and the choice of candidates. Must not touch:
the store, the partition cache, configuration, gRPC. Pure functions over a
partition (and, when given, the new content's cosines with its entries).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from sidecar.core.memory import Memory
from sidecar.retrieval.keywords import text_terms
from sidecar.retrieval.ranking import FloatArray, Listed, Ranked, Weights, rank

# Entries scored per write, by BM25 and (with cosines) by meaning.
CANDIDATES = 5
# Candidates by BM25 are found by the new content's rarest terms only: a
# restatement shares the rarer words of what it restates, and ranking by
# every term makes a note's common words cost a large tier dearly (+1.0
# against +0.5 ms an add at 19,000 entries; on the pairs, 2 terms found
# what all of them did).
RAREST = 4
# How much of the score is the cosine, with an embedding. On the tuning
# pairs 0.6 made fewer errors (1 of 100, at a threshold of 0.68) than 0.5
# (3, at 0.63-0.68), and a cosine alone 3 (at 0.78-0.81); but only at 0.5
# do the blend's best thresholds overlap the lexical ones (0.61-0.66, 9
# errors), so one similar_threshold serves an agent with or without an
# encoder.
COSINE_WEIGHT = 0.5
# BM25 alone orders the candidates: an entry's confidence says nothing of
# how nearly it repeats the new one.
_BY_TERMS = Weights(similarity=1.0, confidence=0.0)


class Similar(NamedTuple):
    """An existing entry the new content nearly repeats, and how nearly (0..1)."""

    memory: Memory
    score: float


class _Terms(NamedTuple):
    """A text's terms as scoring reads them, found once per text."""

    # Distinct, in first-seen order (the order _rarest breaks ties by).
    ordered: tuple[str, ...]
    distinct: frozenset[str]
    # Those naming one thing of their kind (see _named).
    named: frozenset[str]


# The same entries come back as candidates write after write, and a new
# entry's own terms are wanted twice (its rarest terms, then its Dice): a
# text's terms are kept rather than found again (bounded: contents come
# from clients).
@functools.lru_cache(maxsize=8192)
def _terms_of(text: str) -> _Terms:
    # keywords([text]): its distinct terms in first-seen order.
    ordered = tuple(dict.fromkeys(text_terms(text)))
    distinct = frozenset(ordered)
    return _Terms(ordered, distinct, _named(distinct))


def term_set(text: str) -> frozenset[str]:
    """The distinct stemmed keyword terms of a text."""
    return _terms_of(text).distinct


def lexical(a: frozenset[str], b: frozenset[str]) -> float:
    """Dice's coefficient of two term sets: 1 for the same terms, 0 for
    none shared (or a text without terms)."""
    if not a or not b:
        return 0.0
    return 2 * len(a & b) / (len(a) + len(b))


def _named(terms: frozenset[str]) -> frozenset[str]:
    """The terms that name one thing of its kind: numbers, versions and
    identifiers (a digit, or a dot, dash or underscore inside)."""
    # A letter is never a digit: a word all of letters (most terms) is
    # passed over without looking at each character.
    return frozenset(
        t
        for t in terms
        if "-" in t or "." in t or "_" in t or (not t.isalpha() and any(c.isdigit() for c in t))
    )


def distinct(a: frozenset[str], b: frozenset[str]) -> bool:
    """Whether two term sets each name a number or an identifier the other
    does not: two notes on two things, not one restated."""
    return _apart(_named(a), _named(b))


def _apart(named_a: frozenset[str], named_b: frozenset[str]) -> bool:
    """`distinct`, from the two texts' named terms."""
    return bool(named_a - named_b) and bool(named_b - named_a)


def score(lexical_score: float, cosine: float | None) -> float:
    """The similarity of two texts from their lexical score and, when both
    have an embedding, their cosine (a negative cosine counts as 0)."""
    if cosine is None or np.isnan(cosine):
        return lexical_score
    return (1 - COSINE_WEIGHT) * lexical_score + COSINE_WEIGHT * max(float(cosine), 0.0)


def pair(a: str, b: str, cosine: float | None = None) -> float:
    """The similarity of two texts (what `similar` scores a candidate with)."""
    return _scored(_terms_of(a), _terms_of(b), cosine)


def _scored(a: _Terms, b: _Terms, cosine: float | None) -> float:
    """The similarity of two texts by their terms: 0 for two that name
    distinct things."""
    if _apart(a.named, b.named):
        return 0.0
    return score(lexical(a.distinct, b.distinct), cosine)


def similar(
    partition: Ranked,
    content: str,
    threshold: float,
    *,
    cosines: FloatArray | None = None,
    limit: int = CANDIDATES,
) -> tuple[Similar, ...]:
    """The entries of the partition that the new content nearly repeats
    (score >= threshold), most similar first, ties in insertion order.

    `cosines`: the content's cosine with each entry, by position (as
    Semantic.similarities gives them; NaN for an entry without a vector),
    or None to score lexically. Nothing when a candidate holds this exact
    content: the store returns that entry instead of adding (`holds` looks
    through the entries that are not candidates). Meant for a partition
    held in full; a compact one's candidates would be read from the
    database.
    """
    if not partition.count:
        return ()
    found: dict[int, tuple[Memory, float | None]] = {}
    new = _terms_of(content)
    rarest = _rarest(partition, new.ordered)
    if rarest:
        for memory, _ in rank([partition], rarest, _BY_TERMS, limit=limit):
            found[memory.seq] = (memory, None)
    if cosines is not None and len(cosines) == partition.size:
        known = np.flatnonzero(~np.isnan(cosines))
        nearest = known[np.argsort(-cosines[known], kind="stable")[:limit]]
        positions = [int(p) for p in nearest]
        for position, near in zip(positions, partition.fetch(positions), strict=True):
            if near is not None:
                found[near.seq] = (near, float(cosines[position]))
        found = {
            seq: (memory, _cosine_of(partition, cosines, seq) if cosine is None else cosine)
            for seq, (memory, cosine) in found.items()
        }
    if any(memory.content == content for memory, _ in found.values()):
        return ()
    scored = [
        Similar(memory, _scored(new, _terms_of(memory.content), cosine))
        for memory, cosine in found.values()
    ]
    return tuple(
        sorted(
            (s for s in scored if s.score >= threshold),
            key=lambda s: (-s.score, s.memory.seq),
        )
    )


def _rarest(partition: Ranked, terms: Sequence[str]) -> list[str]:
    """The content's RAREST terms the partition holds, fewest entries first
    (ties in the content's order): all a restatement needs to be found by,
    and on a large tier far cheaper to rank by than every term."""
    held = []
    for at, term in enumerate(terms):
        postings = partition.term(term)
        if postings is not None and len(postings.positions):
            held.append((len(postings.positions), at, term))
    return [term for _, _, term in sorted(held)[:RAREST]]


def holds(partition: Ranked, content: str) -> bool:
    """Whether a partition held in full holds this exact content (a string
    comparison per entry: the candidates `similar` looked at may not
    include it). False for a compact partition, whose entries are read from
    the database only when returned."""
    return isinstance(partition, Listed) and any(m.content == content for m in partition.memories)


def _cosine_of(partition: Ranked, cosines: FloatArray, seq: int) -> float | None:
    """The cosine of the entry with this seq (None without a vector)."""
    at = np.flatnonzero(partition.seq == seq)
    if not len(at):
        return None
    value = float(cosines[int(at[0])])
    return None if np.isnan(value) else value

"""Ranked search: relevance on conversational memories, BM25, the confidence blend."""

from __future__ import annotations

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import MakeSidecar, Running

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="companion", user_id="caroline")

# What an agent noted over several sessions of a long conversation between
# two friends (written for these tests, in the style of public long-conversation
# benchmarks: names, dates, possessives, plurals).
CONVERSATION = [
    "Caroline attended an LGBTQ support group meeting on 7 May 2023.",
    "Melanie painted a sunrise over the lake in 2022.",
    "Caroline is researching adoption agencies because she wants to adopt children.",
    "Melanie ran a charity race for mental health on 20 May 2023.",
    "Caroline moved from Sweden four years ago.",
    "Melanie's kids love dinosaurs and nature.",
    "Caroline's grandmother gave her a necklace from Sweden.",
    "Melanie went camping with her family at the beach in June 2023.",
    "Caroline wants to pursue a career in counseling and mental health.",
    "Melanie signed up for a pottery class on 2 July 2023.",
    "Caroline gave a speech at a school about her transgender journey.",
    "Melanie plays the clarinet and started playing when she was young.",
]

QUESTIONS = [
    ("When did Caroline go to the LGBTQ support group?", 0),
    ("What did Melanie paint?", 1),
    ("What is Caroline researching?", 2),
    ("When did Melanie run the charity race?", 3),
    ("Where did Caroline move from?", 4),
    ("What do Melanie's kids like?", 5),
    ("What did Caroline's grandmother give her?", 6),
    ("Where did Melanie camp?", 7),
    ("What career path has Caroline decided to pursue?", 8),
    ("When did Melanie sign up for pottery classes?", 9),
    ("What did Caroline talk about in her school speeches?", 10),
    ("What instrument does Melanie play?", 11),
    ("Which of Caroline's things came from Sweden?", 6),
    ("What did Melanie do in July 2023?", 9),
    ("What happened in 2022?", 1),
]


@pytest.fixture
def conversation(sidecar: Running) -> list[pb.Memory]:
    return [sidecar.add(text, scope=SCOPE).memory for text in CONVERSATION]


def search(running: Running, query: str, **fields: object) -> list[pb.SearchHit]:
    request = pb.SearchMemoriesRequest(scope=SCOPE, query=query, **fields)  # type: ignore[arg-type]
    return list(running.stub.SearchMemories(request).hits)


@pytest.mark.parametrize(("question", "answer"), QUESTIONS, ids=[q for q, _ in QUESTIONS])
def test_natural_questions_find_their_memory_first(
    sidecar: Running, conversation: list[pb.Memory], question: str, answer: int
) -> None:
    hits = search(sidecar, question)
    assert hits, "ranked search must not come back empty for a natural question"
    # First, or tied for first: "Which of Caroline's things came from
    # Sweden?" matches two entries on the same two words, equally.
    best = [h.memory.id for h in hits if h.score == pytest.approx(hits[0].score)]
    assert conversation[answer].id in best, [h.memory.content for h in hits[:3]]


def test_the_seeds_and_match_misses_what_ranking_finds(
    sidecar: Running, conversation: list[pb.Memory]
) -> None:
    empty_and = [q for q, _ in QUESTIONS if not search(sidecar, q, match_all=True)]
    empty_ranked = [q for q, _ in QUESTIONS if not search(sidecar, q)]
    assert empty_ranked == []
    assert len(empty_and) >= len(QUESTIONS) // 3


def test_an_irregular_past_form_meets_its_base(sidecar: Running) -> None:
    bought = sidecar.add("Melanie bought a secondhand kiln", scope=SCOPE).memory
    sidecar.add("Melanie wants a bigger kiln", scope=SCOPE)
    hits = search(sidecar, "What did Melanie buy?")
    assert hits[0].memory.id == bought.id
    assert hits[0].score > hits[1].score  # not a tie on "Melanie"


def test_dates_written_other_ways_meet_a_month_and_year(sidecar: Running) -> None:
    iso = sidecar.add("Rotated the staging certificates on 2023-12-04", scope=SCOPE).memory
    us = sidecar.add("Melanie joined Weight Watchers on Dec 3, 2023", scope=SCOPE).memory
    sidecar.add("Rotated the production certificates in May", scope=SCOPE)
    hits = search(sidecar, "What happened on December 4, 2023?")
    assert {h.memory.id for h in hits} == {iso.id, us.id}


def test_an_acronym_is_a_keyword(sidecar: Running) -> None:
    er = sidecar.add("Sam ended up in the ER with a stomachache", scope=SCOPE).memory
    sidecar.add("Sam started a new diet", scope=SCOPE)
    hits = search(sidecar, "When was Sam in the ER?")
    assert hits[0].memory.id == er.id
    assert hits[0].score > hits[1].score


# An agent's notes on tools, services and versions, each with near-miss
# neighbours (the same words, another short name, number or identifier).
NOTES = [
    "The repo uses uv, not pip, to install packages",
    "Install packages with pip in the CI image",
    "Open pull requests with gh pr create",
    "Filter the JSON logs with jq before grepping",
    "Nightly backups go to S3 in the acme-backups bucket",
    "Staging runs Python 3.11; production is still on Python 3.10",
    "Python 3.12 breaks the build: stay on the current version",
    "svc-7 restarts nightly at 02:00 UTC",
    "svc-8 restarts nightly at 03:00 UTC",
    "pg-staging-2 listens on port 5433",
    "pg-staging-3 listens on port 5432",
    "OPS-1142 tracks the flaky login test",
    "OPS-1143 tracks the slow dashboard",
    "Project metadata lives in pyproject.toml",
    "Build the image with docker build --no-cache after a base bump",
    "The API moved to v2 in March",
    "Run the suite with 20 workers",
]
SHORT_QUERIES = [
    ("uv", 0),
    ("gh", 2),
    ("jq", 3),
    ("S3", 4),
    ("3.11", 5),
    ("python 3.12", 6),
    ("svc-7", 7),
    ("pg-staging-2", 9),
    ("5433", 9),
    ("OPS-1142", 11),
    ("pyproject.toml", 13),
    ("--no-cache", 14),
    ("v2", 15),
    ("20", 16),
    ("how do I install packages with uv?", 0),
]


@pytest.fixture
def notes(sidecar: Running) -> list[pb.Memory]:
    return [sidecar.add(text, scope=SCOPE).memory for text in NOTES]


@pytest.mark.parametrize(("query", "answer"), SHORT_QUERIES, ids=[q for q, _ in SHORT_QUERIES])
def test_a_short_word_number_or_identifier_finds_its_note_first(
    sidecar: Running, notes: list[pb.Memory], query: str, answer: int
) -> None:
    hits = search(sidecar, query)
    assert hits[0].memory.id == notes[answer].id, [h.memory.content for h in hits[:3]]
    # Not everything at one score: a neighbour matches less, or not at all.
    assert len(hits) == 1 or hits[0].score > hits[1].score


def test_a_query_sharing_no_term_finds_nothing(sidecar: Running, notes: list[pb.Memory]) -> None:
    for query in ("kubectl", "k9s", "db-9", "ENG-2000", "v7", "what is it?"):
        assert search(sidecar, query) == [], query


def test_match_all_requires_every_keyword(sidecar: Running, conversation: list[pb.Memory]) -> None:
    hits = search(sidecar, "Melanie 2023", match_all=True)
    assert {h.memory.id for h in hits} == {conversation[i].id for i in (3, 7, 9)}


def test_rarer_words_rank_higher(sidecar: Running) -> None:
    common = [
        sidecar.add(f"project note {n} about the build", scope=SCOPE).memory for n in range(5)
    ]
    rare = sidecar.add("project note about the kestrel cluster", scope=SCOPE).memory
    hits = search(sidecar, "build kestrel")
    assert hits[0].memory.id == rare.id
    assert {h.memory.id for h in hits[1:]} == {m.id for m in common}


def test_more_matching_keywords_rank_higher(sidecar: Running) -> None:
    one = sidecar.add("The garden has roses", scope=SCOPE).memory
    two = sidecar.add("The garden has roses and tulips", scope=SCOPE).memory
    hits = search(sidecar, "roses tulips")
    assert [h.memory.id for h in hits] == [two.id, one.id]


def test_confidence_is_blended_in(sidecar: Running) -> None:
    unsure = sidecar.add("Caroline likes jazz", scope=SCOPE, confidence=0.2).memory
    sure = sidecar.add("Caroline likes blues", scope=SCOPE, confidence=0.9).memory
    hits = search(sidecar, "caroline")
    assert [h.memory.id for h in hits] == [sure.id, unsure.id]
    # Equal similarity (1.0 after normalising): 0.6 * 1 + 0.4 * confidence.
    assert hits[0].score == pytest.approx(0.6 + 0.4 * 0.9)
    assert hits[1].score == pytest.approx(0.6 + 0.4 * 0.2)


def test_weights_are_configurable_per_agent(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("agents: {companion: {similarity_weight: 1.0, confidence_weight: 0.0}}")
    strong = running.add("Sweden Sweden Sweden trip", scope=SCOPE, confidence=0.1).memory
    weak = running.add(
        "A long note that mentions Sweden once among other words", scope=SCOPE, confidence=1.0
    ).memory
    hits = search(running, "sweden")
    assert [h.memory.id for h in hits] == [strong.id, weak.id]
    assert hits[0].score == pytest.approx(1.0)


def test_ties_break_by_insertion_order(sidecar: Running) -> None:
    ids = [
        sidecar.add(f"red {fruit}", scope=SCOPE).memory.id for fruit in ("apple", "pear", "plum")
    ]
    hits = search(sidecar, "red")
    assert [h.memory.id for h in hits] == ids
    assert len({h.score for h in hits}) == 1


def test_empty_query_ranks_by_confidence_then_recency(sidecar: Running) -> None:
    old = sidecar.add("old fact", scope=SCOPE, confidence=0.5).memory
    new = sidecar.add("new fact", scope=SCOPE, confidence=0.5).memory
    top = sidecar.add("certain fact", scope=SCOPE, confidence=1.0).memory
    low = sidecar.add("shaky fact", scope=SCOPE, confidence=0.1).memory
    assert [h.memory.id for h in search(sidecar, "")] == [top.id, new.id, old.id, low.id]
    # Touching the old fact makes it the more recent of the two.
    sidecar.stub.UpdateMemory(pb.UpdateMemoryRequest(scope=SCOPE, id=old.id, category="seen"))
    assert [h.memory.id for h in search(sidecar, "")] == [top.id, old.id, new.id, low.id]
    assert [h.memory.id for h in search(sidecar, "", limit=2)] == [top.id, old.id]
    # Words that are no terms are not an empty query: nothing shares them.
    assert search(sidecar, "the of and") == []
    assert search(sidecar, "what is it?") == []


def test_search_sees_a_write_as_soon_as_it_is_acknowledged(sidecar: Running) -> None:
    assert search(sidecar, "kestrel") == []
    added = sidecar.add("Staging cluster is kestrel", scope=SCOPE).memory
    assert [h.memory.id for h in search(sidecar, "kestrel")] == [added.id]
    sidecar.stub.DeleteMemory(pb.DeleteMemoryRequest(scope=SCOPE, id=added.id))
    assert search(sidecar, "kestrel") == []


def test_search_filters_by_tier_and_category(sidecar: Running) -> None:
    note = sidecar.add("Sweden office opens", scope=SCOPE, category="work").memory
    fact = sidecar.add(
        "Caroline is from Sweden", scope=SCOPE, tier=pb.TIER_USER, category="bio"
    ).memory
    assert [h.memory.id for h in search(sidecar, "sweden", tier=pb.TIER_USER)] == [fact.id]
    assert [h.memory.id for h in search(sidecar, "sweden", category="work")] == [note.id]
    assert len(search(sidecar, "sweden")) == 2

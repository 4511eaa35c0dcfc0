"""Near-duplicates on AddMemory (sidecar.retrieval.similarity): reported, refused or
allowed by the agent's similar_writes, through a real daemon on both
backends; the scoring itself on a few pairs; the config keys; and, with the
bundled encoder, a restatement that shares few words.

Scores quoted below are sidecar.retrieval.similarity's: Dice over stemmed terms, and
with semantic retrieval half that, half the cosine of all-MiniLM-L6-v2.
"""

from __future__ import annotations

import math

import grpc
import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.config import settings
from sidecar.config.settings import AgentSettings
from sidecar.core.errors import ConfigError
from sidecar.core.memory import Tier
from sidecar.retrieval.compact import CompactPartition
from sidecar.retrieval.embedding import LocalEncoder
from sidecar.retrieval.similarity import COSINE_WEIGHT, lexical, pair, score, term_set
from tests.conftest import (
    CALL_SECONDS,
    MakeSidecar,
    Running,
    contents,
    error_info,
    refused,
)

pytestmark = pytest.mark.contract

SCOPE = pb.Scope(agent_id="coder", user_id="ada")
USER = pb.TIER_USER
FIRST = "User prefers dark mode"
# {user, like, dark, mode} against {user, prefer, dark, mode}: Dice 0.75.
RESTATED = "The user likes dark mode"
# {user, prefer, light, keyboard, backlight}: shares user and prefer, Dice 0.44.
RELATED = "User prefers light keyboard backlight"

REFUSE = "agents: {coder: {similar_writes: refuse}}"
ALLOW = "agents: {coder: {similar_writes: allow}}"


def budget_rejections(running: Running) -> float:
    registry = running.sidecar.metrics.registry
    return sum(
        registry.get_sample_value("memory_budget_rejections_total", {"tier": tier}) or 0.0
        for tier in ("memory", "user")
    )


# --- through the daemon ---------------------------------------------------------------


def test_report_is_the_default_and_still_writes(sidecar: Running) -> None:
    first = sidecar.add(FIRST, scope=SCOPE, tier=USER).memory
    second = sidecar.add(RESTATED, scope=SCOPE, tier=USER)
    assert second.created
    assert [(s.memory.id, s.memory.content) for s in second.similar] == [(first.id, FIRST)]
    (similar,) = second.similar
    assert similar.memory.tier == USER
    assert similar.score == pytest.approx(pair(FIRST, RESTATED))
    assert similar.score >= AgentSettings().similar_threshold
    listed = sidecar.list(scope=SCOPE).memories
    assert [(m.id, m.content) for m in listed] == [(first.id, FIRST), (second.memory.id, RESTATED)]


def test_refuse_names_the_entry_and_changes_nothing(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(REFUSE)
    first = running.add(FIRST, scope=SCOPE, tier=USER).memory
    before = running.list(scope=SCOPE)
    error = refused(running.add, RESTATED, scope=SCOPE, tier=USER)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    info = error_info(error)
    assert info.reason == "SIMILAR_MEMORY"
    assert info.metadata["memory_id"] == first.id
    assert info.metadata["tier"] == "user"
    assert float(info.metadata["score"]) == pytest.approx(pair(FIRST, RESTATED), abs=1e-3)
    assert first.id in (error.details() or "")
    assert running.list(scope=SCOPE) == before
    # Not a budget rejection.
    assert budget_rejections(running) == 0
    # What the model does next: replace the entry instead.
    running.stub.UpdateMemory(
        pb.UpdateMemoryRequest(scope=SCOPE, id=first.id, content=RESTATED), timeout=CALL_SECONDS
    )
    listed = running.list(scope=SCOPE).memories
    assert [(m.id, m.content) for m in listed] == [(first.id, RESTATED)]


def test_refuse_lets_related_entries_and_other_tiers_through(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(REFUSE)
    running.add(FIRST, scope=SCOPE, tier=USER)
    related = running.add(RELATED, scope=SCOPE, tier=USER)
    assert related.created
    assert not related.similar
    note = running.add("Run tests with pytest -q from the repo root", scope=SCOPE).memory
    restated = "From the repo root, the tests run with pytest -q"
    # The user profile is another tier: nothing in it to repeat.
    assert running.add(restated, scope=SCOPE, tier=USER).created
    info = error_info(refused(running.add, restated, scope=SCOPE))
    assert (info.metadata["tier"], info.metadata["memory_id"]) == ("memory", note.id)


def test_refuse_lets_a_note_on_another_number_or_identifier_through(
    make_sidecar: MakeSidecar,
) -> None:
    running = make_sidecar(REFUSE)
    eight = running.add("svc-8 restarts nightly at 02:00 UTC", scope=SCOPE).memory
    seven = running.add("svc-7 restarts nightly at 02:00 UTC", scope=SCOPE)
    assert seven.created
    assert not seven.similar
    assert running.add("Python 3.11 is pinned in pyproject.toml", scope=SCOPE).created
    assert running.add("Python 3.12 is pinned in pyproject.toml", scope=SCOPE).created
    # A restatement naming the same service is still one.
    info = error_info(refused(running.add, "svc-8 is restarted nightly at 02:00 UTC", scope=SCOPE))
    assert info.metadata["memory_id"] == eight.id


def test_allow_computes_nothing(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(ALLOW)
    running.add(FIRST, scope=SCOPE, tier=USER)
    second = running.add(RESTATED, scope=SCOPE, tier=USER)
    assert second.created
    assert list(second.similar) == []
    assert len(contents(running, SCOPE)) == 2
    # Not even the tier is loaded for it.
    assert running.sidecar.engine.inside().partitions.cached((Tier.USER, "ada")) is None


def test_a_merely_related_entry_is_not_reported(sidecar: Running) -> None:
    sidecar.add(FIRST, scope=SCOPE, tier=USER)
    assert list(sidecar.add(RELATED, scope=SCOPE, tier=USER).similar) == []
    sidecar.add("Deploy target is AWS us-east-1", scope=SCOPE)
    assert list(sidecar.add("Staging runs in AWS eu-west-1", scope=SCOPE).similar) == []


@pytest.mark.parametrize("policy", ["report", "refuse", "allow"])
def test_identical_content_returns_the_existing_entry(
    make_sidecar: MakeSidecar, policy: str
) -> None:
    running = make_sidecar(f"agents: {{coder: {{similar_writes: {policy}}}}}")
    first = running.add(FIRST, scope=SCOPE, tier=USER).memory
    running.add(RELATED, scope=SCOPE, tier=USER)
    again = running.add(FIRST, scope=SCOPE, tier=USER)
    assert not again.created
    assert again.memory.id == first.id
    assert list(again.similar) == []
    assert len(contents(running, SCOPE)) == 2


def test_the_threshold_is_the_agents(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(
        "agents: {strict: {similar_threshold: 0.9}, loose: {similar_threshold: 0.2}}"
    )
    for agent in ("strict", "loose"):
        scope = pb.Scope(agent_id=agent, user_id=agent)
        running.add(FIRST, scope=scope, tier=USER)
        restated = running.add(RESTATED, scope=scope, tier=USER)
        related = running.add(RELATED, scope=scope, tier=USER)
        if agent == "strict":
            # 0.75 < 0.9: not reported.
            assert list(restated.similar) == []
            assert list(related.similar) == []
        else:
            # 0.44 and 0.22 >= 0.2; most similar first.
            assert [s.memory.content for s in restated.similar] == [FIRST]
            assert [s.memory.content for s in related.similar] == [FIRST, RESTATED]
            scores = [s.score for s in related.similar]
            assert scores == sorted(scores, reverse=True)


def test_a_disabled_tier_still_answers_tier_disabled(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar("agents: {coder: {similar_writes: refuse, user_profile_enabled: false}}")
    error = refused(running.add, FIRST, scope=SCOPE, tier=USER)
    assert error_info(error).reason == "TIER_DISABLED"


COMPACT = (
    "defaults: {memory_char_limit: 0, similar_writes: refuse}\nserver: {compact_tier_entries: 5}"
)
NOTES = [
    "Deploy target is AWS us-east-1",
    "The repo uses uv, not pip",
    "CI runs on GitHub Actions",
    "Migrations live in db/migrations",
    "The API server listens on port 8080",
    "Logs are shipped to Loki",
]


def test_a_compact_tier_is_not_checked(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(COMPACT)
    key = (Tier.MEMORY, "coder")
    ids = [running.add(note, scope=SCOPE).memory.id for note in NOTES[:4]]
    # Held in full below 5 entries: checked.
    info = error_info(refused(running.add, "We deploy to AWS in us-east-1", scope=SCOPE))
    assert (info.reason, info.metadata["memory_id"]) == ("SIMILAR_MEMORY", ids[0])
    ids += [running.add(note, scope=SCOPE).memory.id for note in NOTES[4:]]
    # 5 entries and up: held compactly, not checked, and not loaded for a write.
    assert running.sidecar.engine.inside().partitions.cached(key) is None
    added = running.add("We deploy to AWS in us-east-1", scope=SCOPE)
    assert added.created
    assert list(added.similar) == []
    assert running.sidecar.engine.inside().partitions.cached(key) is None
    again = running.add(NOTES[3], scope=SCOPE)
    assert (again.created, again.memory.id) == (False, ids[3])
    # Once loaded (by a search), compactly: still not checked.
    running.stub.SearchMemories(pb.SearchMemoriesRequest(scope=SCOPE, query="deploy"))
    assert isinstance(running.sidecar.engine.inside().partitions.cached(key), CompactPartition)
    assert running.add("The repo uses uv and not pip", scope=SCOPE).created


# --- with the bundled encoder ------------------------------------------------------------

# {user, hate, long, meet} against {user, strong, dislik, lengthi, meet}:
# Dice 0.44, not reported lexically; cosine 0.94, so 0.69 with it.
HATES = "User hates long meetings"
DISLIKES = "The user strongly dislikes lengthy meetings"


def test_a_paraphrase_sharing_few_words_is_caught_with_semantic_retrieval(
    make_sidecar: MakeSidecar, loaded_model: LocalEncoder
) -> None:
    lexical_only = make_sidecar(REFUSE, name="lexical.db")
    lexical_only.add(HATES, scope=SCOPE, tier=USER)
    assert lexical_only.add(DISLIKES, scope=SCOPE, tier=USER).created

    running = make_sidecar(REFUSE + "\nserver: {semantic_encoder: local}")
    first = running.add(HATES, scope=SCOPE, tier=USER).memory
    error = refused(running.add, DISLIKES, scope=SCOPE, tier=USER)
    info = error_info(error)
    assert info.reason == "SIMILAR_MEMORY"
    assert info.metadata["memory_id"] == first.id
    assert float(info.metadata["score"]) > pair(HATES, DISLIKES) + 0.1


# --- the scoring ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (FIRST, RESTATED, 3 / 4),
        (FIRST, RELATED, 4 / 9),
        (FIRST, FIRST, 1.0),
        # Stemmed and lowercased: the same terms.
        ("Migrations live in db/migrations", "migration lives in db/migration", 1.0),
        # Each names a region the other does not: two things (Dice alone 0.25).
        ("Deploy target is AWS us-east-1", "Staging runs in AWS eu-west-1", 0.0),
        ("svc-8 restarts nightly at 02:00 UTC", "svc-7 restarts nightly at 02:00 UTC", 0.0),
        ("Staging runs PostgreSQL 16", "Staging runs PostgreSQL 15", 0.0),
        # One adds an identifier to the other: scored as usual, {svc-7, svc, 7,
        # restart, night} against that and {svc-8, 8}: Dice 10/12.
        ("svc-7 restarts nightly", "svc-7 and svc-8 restart nightly", 10 / 12),
        # Stopwords only: no terms, nothing to compare.
        ("It is what it is", "It is what it is", 0.0),
    ],
)
def test_lexical_scores(a: str, b: str, expected: float) -> None:
    assert pair(a, b) == pytest.approx(expected)
    assert pair(b, a) == pytest.approx(expected)


def test_term_sets_are_stemmed_keywords() -> None:
    assert term_set("The user prefers dark mode") == {"user", "prefer", "dark", "mode"}
    assert lexical(frozenset(), frozenset({"a"})) == 0.0


def test_a_cosine_does_not_join_notes_on_two_things() -> None:
    # all-MiniLM-L6-v2 puts these two at about 0.98.
    assert pair("svc-7 restarts nightly", "svc-8 restarts nightly", cosine=0.98) == 0.0


def test_the_cosine_is_blended_in_when_known() -> None:
    assert score(0.4, None) == 0.4
    assert score(0.4, math.nan) == 0.4
    assert score(0.4, 0.9) == pytest.approx((1 - COSINE_WEIGHT) * 0.4 + COSINE_WEIGHT * 0.9)
    # A negative cosine counts as none.
    assert score(0.4, -0.3) == pytest.approx((1 - COSINE_WEIGHT) * 0.4)
    assert pair(HATES, DISLIKES, 0.94) > AgentSettings().similar_threshold > pair(HATES, DISLIKES)


# --- the configuration ----------------------------------------------------------------


def test_defaults() -> None:
    settings = AgentSettings()
    assert settings.similar_writes == "report"
    assert 0 < settings.similar_threshold < 1


def test_the_environment_sets_the_defaults() -> None:
    # Invalid values in the file: tests/config/test_settings.py.
    loaded = settings.load(
        None,
        environ={
            "MEMORY_SIDECAR_SIMILAR_WRITES": "refuse",
            "MEMORY_SIDECAR_SIMILAR_THRESHOLD": "0.8",
        },
    )
    assert loaded.defaults.similar_writes == "refuse"
    assert loaded.defaults.similar_threshold == 0.8
    with pytest.raises(ConfigError) as raised:
        settings.load(None, environ={"MEMORY_SIDECAR_SIMILAR_WRITES": "maybe"})
    assert raised.value.key == "MEMORY_SIDECAR_SIMILAR_WRITES"


def test_a_digit_that_is_not_ascii_still_names_a_thing() -> None:
    # Terms all of letters are passed over quickly; one with any digit is not.
    assert pair("node\u00b2 restarts nightly", "node\u00b3 restarts nightly") == 0.0
    assert pair("dark mode preferred", "prefers dark mode") == 1.0

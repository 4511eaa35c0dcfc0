"""bench.agent_notes: its data is consistent, its "before" is the tokenizer
as it was, and its scores say what they measure."""

from __future__ import annotations

from bench import agent_notes
from sidecar.retrieval.keywords import terms


def test_the_notes_and_queries_are_consistent() -> None:
    notes = agent_notes.load()
    ids = {m.id: agent for agent, memories in notes.notes.items() for m in memories}
    assert len(ids) == sum(len(m) for m in notes.notes.values()) >= 300
    assert len(notes.notes) >= 5
    for query in notes.queries:
        assert query.kind in agent_notes.CLASSES
        assert all(ids[answer] == query.agent for answer in query.answers)
        assert bool(query.answers) == (query.kind != "none"), query
        if query.kind == "none":
            # Shares no term with any of its agent's entries.
            held = {t for m in notes.notes[query.agent] for t in terms(m.content)}
            assert not held & set(terms(query.text)), query.text


def test_previous_terms_are_the_tokenizer_before_short_terms() -> None:
    assert agent_notes.previous_terms("uv, gh and S3 in the ER: svc-7 deploys on 3.11") == [
        "er", "svc", "deploy",
    ]  # fmt: skip
    assert agent_notes.previous_terms("July 4, 2023 and 2023-07-04") == [
        "juli", "july2023", "2023", "2023", "july2023",
    ]  # fmt: skip


def test_after_finds_short_words_first_and_before_did_not() -> None:
    notes = agent_notes.load()
    old = agent_notes.scores(notes, agent_notes.before)
    new = agent_notes.scores(notes, agent_notes.after)
    assert new.r1["short"] > old.r1["short"]
    assert new.r1["none"] == 1.0  # found nothing, every time
    assert new.r1["words"] >= old.r1["words"]
    pairs, alarms_before, alarms_after = agent_notes.false_alarms(notes, 0.64)
    assert pairs > 10_000
    assert alarms_after < alarms_before

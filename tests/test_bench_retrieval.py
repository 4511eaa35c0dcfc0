"""bench.retrieval reads LoCoMo's own file format (its data is not shipped:
a sample in its shape is made here) and scores as it says."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from bench import retrieval

SAMPLE = {
    "sample_id": "conv-x",
    "qa": [
        {"question": "What did Bob buy?", "evidence": ["D1:2"], "category": 4},
        {"question": "What happened?", "evidence": ["D1:1; D2:1"], "category": 1},
        {"question": "What did Ann buy?", "evidence": ["D1:2"], "category": 5},
        {"question": "Where?", "evidence": ["D9:9", "D"], "category": 2},
    ],
    "conversation": {
        "speaker_a": "Ann",
        "speaker_b": "Bob",
        "session_1_date_time": "1:56 pm on 8 May, 2023",
        "session_1": [
            {"speaker": "Ann", "dia_id": "D1:1", "text": "Hi Bob"},
            {
                "speaker": "Bob",
                "dia_id": "D1:2",
                "text": "I bought a bike",
                "blip_caption": "a photo of a red bike",
            },
        ],
        "session_2_date_time": "10:37 am on 27 June, 2023",
        "session_2": [{"speaker": "Ann", "dia_id": "D2:1", "text": "hello"}],
    },
}


def test_locomo_samples_load_as_relevance_sets(tmp_path: Path) -> None:
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([SAMPLE]))
    (loaded,), unknown = retrieval.load_locomo(path)
    assert [(m.id, m.content, m.created_at) for m in loaded.memories] == [
        ("conv-x-D1:1", "Ann: Hi Bob", datetime(2023, 5, 8, 13, 56, tzinfo=UTC)),
        (
            "conv-x-D1:2",
            "Bob: I bought a bike [image: a photo of a red bike]",
            datetime(2023, 5, 8, 13, 56, tzinfo=UTC),
        ),
        ("conv-x-D2:1", "Ann: hello", datetime(2023, 6, 27, 10, 37, tzinfo=UTC)),
    ]
    # Adversarial questions (5) are left out, and so is one whose evidence
    # names no turn; "D1:1; D2:1" is two ids.
    assert [(q.text, sorted(q.evidence), q.kind) for q in loaded.questions] == [
        ("What did Bob buy?", ["conv-x-D1:2"], "single-hop"),
        ("What happened?", ["conv-x-D1:1", "conv-x-D2:1"], "multi-hop"),
    ]
    assert unknown == 2


def test_found_needs_every_evidence_turn_recall_counts_each(tmp_path: Path) -> None:
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([SAMPLE]))
    sets, _ = retrieval.load_locomo(path)
    # A search that returns both turns of session 1: the first question is
    # found, the second has one of its two turns.
    top = ["conv-x-D1:2", "conv-x-D1:1"]
    result = retrieval.scores(sets, lambda memories: lambda question: top)
    assert result.found == {"single-hop": 1.0, "multi-hop": 0.0, "all": 0.5}
    assert result.recall == {"single-hop": 1.0, "multi-hop": 0.5, "all": 0.75}

"""Vectors as stored (sidecar.storage.vectors): kept per encoder."""

from __future__ import annotations

import pytest

from sidecar.core.memory import Tier
from sidecar.retrieval.embedding import LocalEncoder
from tests.conftest import MakeSidecar
from tests.retrieval.test_semantic import LOCAL, NOTES, add_notes

pytestmark = pytest.mark.contract


def test_vectors_are_stored_per_model(
    make_sidecar: MakeSidecar, loaded_model: LocalEncoder
) -> None:
    running = make_sidecar(LOCAL)
    add_notes(running)
    # Another encoder's name: none of these vectors are its.
    assert len(running.store.vectors.unembedded("endpoint:other", 0, 100)) == len(NOTES)
    seqs, data = running.store.vectors.of(Tier.MEMORY, "companion", "endpoint:other")
    assert (seqs, data) == ([], [])

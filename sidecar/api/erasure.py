"""ForgetUser and DeleteScope over gRPC: who may erase, the request's
fields, the answer. MemoryService's methods delegate here.

Only a grant with `erase` may call either (sidecar.api.access: a tokens-file
entry with `erase: true`, or no auth configured at all; never the single
`auth_token_file` token), and a grant limited to some agents or users may
only erase what it lists. The erase grant is checked first: a token that
may not erase learns nothing about scopes. ForgetUser reports the agent
notes written for the user and erases them only when the request asks
(and the grant may address every agent holding one).

Owns: the erasure RPCs' checks and rendering. Must not touch: the store,
partitions or sessions (only MemoryEngine's erasures), statuses, grpc.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api import access
from sidecar.core.errors import InvalidArgument, Reason
from sidecar.core.limits import Limits, checked
from sidecar.core.memory import Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.erasure import Forgotten

# Ids of the agent notes written for the user a ForgetUser answer lists
# (an id is at most 36 characters: 1000 fit in any response limit).
MAX_NOTE_IDS = 1000


def forget_user(
    engine: MemoryEngine, limits: Limits, request: pb.ForgetUserRequest
) -> pb.ForgetUserResponse:
    actor = access.authorize_erasure("ForgetUser")
    user_id = checked("user_id", request.user_id, limits.id_chars)
    if not user_id:
        raise InvalidArgument(
            "user_id is empty; name the user to forget. The profile shared by callers "
            "without a user_id is erased with DeleteScope (scope.user_id empty, tier TIER_USER)",
            reason=Reason.USER_ID_EMPTY,
            metadata={"field": "user_id"},
        )
    access.authorize_user(user_id)
    # Agent notes belong to their agents: erasing them needs a grant that
    # may address each agent holding one, checked by the store under its
    # locks, before anything is erased.
    forgotten = engine.forget_user(
        user_id,
        actor=actor,
        erase_notes=request.erase_agent_notes_written_for_user,
        authorize=lambda agent_id: access.authorize(Scope(agent_id, user_id)),
    )
    notes = forgotten.erased.notes
    return pb.ForgetUserResponse(
        erasure=erasure_pb(forgotten),
        agent_notes_written_for_user=len(notes),
        agent_note_ids_written_for_user=notes[:MAX_NOTE_IDS],
        agent_notes_erased=forgotten.erased.notes_erased,
    )


def delete_scope(
    engine: MemoryEngine, actor: str, scope: Scope, tiers: Sequence[Tier]
) -> pb.DeleteScopeResponse:
    """`actor` from access.authorize_erasure, `scope` checked and authorized
    by the service (MemoryService._scope), `tiers` the request's."""
    forgotten = engine.delete_scope(scope, tiers, actor=actor)
    return pb.DeleteScopeResponse(erasure=erasure_pb(forgotten))


def erasure_pb(forgotten: Forgotten) -> pb.Erasure:
    erased = forgotten.erased
    return pb.Erasure(
        memories=erased.memories,
        vectors=erased.vectors,
        idempotency_keys=erased.idempotency_keys,
        change_rows=erased.change_rows,
        sessions=forgotten.sessions,
        generation=erased.generation,
        audit_id=erased.audit_id,
    )

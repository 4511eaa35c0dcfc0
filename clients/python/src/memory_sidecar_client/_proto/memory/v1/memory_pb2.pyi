import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_MEMORY: _ClassVar[Tier]
    TIER_USER: _ClassVar[Tier]

class KeywordStrategy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KEYWORD_STRATEGY_UNSPECIFIED: _ClassVar[KeywordStrategy]
    KEYWORD_STRATEGY_LOCAL: _ClassVar[KeywordStrategy]
    KEYWORD_STRATEGY_LLM: _ClassVar[KeywordStrategy]

class TokenCounter(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_COUNTER_UNSPECIFIED: _ClassVar[TokenCounter]
    TOKEN_COUNTER_TIKTOKEN_CL100K_BASE: _ClassVar[TokenCounter]
    TOKEN_COUNTER_CHARS_DIV_4: _ClassVar[TokenCounter]
TIER_UNSPECIFIED: Tier
TIER_MEMORY: Tier
TIER_USER: Tier
KEYWORD_STRATEGY_UNSPECIFIED: KeywordStrategy
KEYWORD_STRATEGY_LOCAL: KeywordStrategy
KEYWORD_STRATEGY_LLM: KeywordStrategy
TOKEN_COUNTER_UNSPECIFIED: TokenCounter
TOKEN_COUNTER_TIKTOKEN_CL100K_BASE: TokenCounter
TOKEN_COUNTER_CHARS_DIV_4: TokenCounter

class Scope(_message.Message):
    __slots__ = ("agent_id", "user_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    user_id: str
    def __init__(self, agent_id: _Optional[str] = ..., user_id: _Optional[str] = ...) -> None: ...

class Memory(_message.Message):
    __slots__ = ("id", "tier", "content", "category", "confidence", "created_at", "updated_at", "expires_at")
    ID_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    tier: Tier
    content: str
    category: str
    confidence: float
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, id: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., content: _Optional[str] = ..., category: _Optional[str] = ..., confidence: _Optional[float] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TierUsage(_message.Message):
    __slots__ = ("tier", "used_chars", "limit_chars", "entry_count", "enabled")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_CHARS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_CHARS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_chars: int
    limit_chars: int
    entry_count: int
    enabled: bool
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_chars: _Optional[int] = ..., limit_chars: _Optional[int] = ..., entry_count: _Optional[int] = ..., enabled: _Optional[bool] = ...) -> None: ...

class AddMemoryRequest(_message.Message):
    __slots__ = ("scope", "tier", "content", "category", "confidence", "idempotency_key", "expires_at", "ttl_seconds")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    tier: Tier
    content: str
    category: str
    confidence: float
    idempotency_key: str
    expires_at: _timestamp_pb2.Timestamp
    ttl_seconds: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., content: _Optional[str] = ..., category: _Optional[str] = ..., confidence: _Optional[float] = ..., idempotency_key: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class AddMemoryResponse(_message.Message):
    __slots__ = ("memory", "usage", "created", "similar", "generation")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    SIMILAR_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    usage: TierUsage
    created: bool
    similar: _containers.RepeatedCompositeFieldContainer[SimilarMemory]
    generation: int
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., usage: _Optional[_Union[TierUsage, _Mapping]] = ..., created: _Optional[bool] = ..., similar: _Optional[_Iterable[_Union[SimilarMemory, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class SimilarMemory(_message.Message):
    __slots__ = ("memory", "score")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    score: float
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class UpdateMemoryRequest(_message.Message):
    __slots__ = ("scope", "id", "content", "category", "confidence", "match", "tier", "expires_at", "ttl_seconds", "clear_expiry")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLEAR_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    id: str
    content: str
    category: str
    confidence: float
    match: str
    tier: Tier
    expires_at: _timestamp_pb2.Timestamp
    ttl_seconds: int
    clear_expiry: bool
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., id: _Optional[str] = ..., content: _Optional[str] = ..., category: _Optional[str] = ..., confidence: _Optional[float] = ..., match: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., ttl_seconds: _Optional[int] = ..., clear_expiry: _Optional[bool] = ...) -> None: ...

class UpdateMemoryResponse(_message.Message):
    __slots__ = ("memory", "usage", "generation")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    usage: TierUsage
    generation: int
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., usage: _Optional[_Union[TierUsage, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class DeleteMemoryRequest(_message.Message):
    __slots__ = ("scope", "id", "match", "tier")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    id: str
    match: str
    tier: Tier
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., id: _Optional[str] = ..., match: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class DeleteMemoryResponse(_message.Message):
    __slots__ = ("memory", "usage", "generation")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    usage: TierUsage
    generation: int
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., usage: _Optional[_Union[TierUsage, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class GetMemoriesRequest(_message.Message):
    __slots__ = ("scope", "tier", "category", "page_size", "page_token", "include_expired", "min_generation")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    tier: Tier
    category: str
    page_size: int
    page_token: str
    include_expired: bool
    min_generation: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., category: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., include_expired: _Optional[bool] = ..., min_generation: _Optional[int] = ...) -> None: ...

class GetMemoriesResponse(_message.Message):
    __slots__ = ("memories", "usage", "next_page_token")
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    memories: _containers.RepeatedCompositeFieldContainer[Memory]
    usage: _containers.RepeatedCompositeFieldContainer[TierUsage]
    next_page_token: str
    def __init__(self, memories: _Optional[_Iterable[_Union[Memory, _Mapping]]] = ..., usage: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SearchMemoriesRequest(_message.Message):
    __slots__ = ("scope", "query", "tier", "category", "limit", "match_all", "page_size", "page_token", "min_generation")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    MATCH_ALL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    query: str
    tier: Tier
    category: str
    limit: int
    match_all: bool
    page_size: int
    page_token: str
    min_generation: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., query: _Optional[str] = ..., tier: _Optional[_Union[Tier, str]] = ..., category: _Optional[str] = ..., limit: _Optional[int] = ..., match_all: _Optional[bool] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., min_generation: _Optional[int] = ...) -> None: ...

class SearchHit(_message.Message):
    __slots__ = ("memory", "score")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    score: float
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class SearchMemoriesResponse(_message.Message):
    __slots__ = ("hits", "next_page_token")
    HITS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[SearchHit]
    next_page_token: str
    def __init__(self, hits: _Optional[_Iterable[_Union[SearchHit, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class InjectForTurnRequest(_message.Message):
    __slots__ = ("scope", "session_id", "user_message", "recent_messages", "keywords", "strategy", "max_memories", "max_tokens", "min_generation")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    USER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RECENT_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    KEYWORDS_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORIES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_GENERATION_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    session_id: str
    user_message: str
    recent_messages: _containers.RepeatedScalarFieldContainer[str]
    keywords: _containers.RepeatedScalarFieldContainer[str]
    strategy: KeywordStrategy
    max_memories: int
    max_tokens: int
    min_generation: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., session_id: _Optional[str] = ..., user_message: _Optional[str] = ..., recent_messages: _Optional[_Iterable[str]] = ..., keywords: _Optional[_Iterable[str]] = ..., strategy: _Optional[_Union[KeywordStrategy, str]] = ..., max_memories: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_generation: _Optional[int] = ...) -> None: ...

class InjectForTurnResponse(_message.Message):
    __slots__ = ("system_block", "turn_context", "snapshot_generation", "snapshot_sha256", "cache_hit", "injected_memory_ids", "system_block_tokens", "turn_context_tokens", "token_counter", "usage", "system_block_memory_ids")
    SYSTEM_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TURN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SHA256_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    INJECTED_MEMORY_IDS_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTER_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_BLOCK_MEMORY_IDS_FIELD_NUMBER: _ClassVar[int]
    system_block: str
    turn_context: str
    snapshot_generation: int
    snapshot_sha256: str
    cache_hit: bool
    injected_memory_ids: _containers.RepeatedScalarFieldContainer[str]
    system_block_tokens: int
    turn_context_tokens: int
    token_counter: TokenCounter
    usage: _containers.RepeatedCompositeFieldContainer[TierUsage]
    system_block_memory_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, system_block: _Optional[str] = ..., turn_context: _Optional[str] = ..., snapshot_generation: _Optional[int] = ..., snapshot_sha256: _Optional[str] = ..., cache_hit: _Optional[bool] = ..., injected_memory_ids: _Optional[_Iterable[str]] = ..., system_block_tokens: _Optional[int] = ..., turn_context_tokens: _Optional[int] = ..., token_counter: _Optional[_Union[TokenCounter, str]] = ..., usage: _Optional[_Iterable[_Union[TierUsage, _Mapping]]] = ..., system_block_memory_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NotifyCompactionRequest(_message.Message):
    __slots__ = ("session_id", "scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    scope: Scope
    def __init__(self, session_id: _Optional[str] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ...) -> None: ...

class NotifyCompactionResponse(_message.Message):
    __slots__ = ("invalidated", "broadcast")
    INVALIDATED_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    invalidated: bool
    broadcast: bool
    def __init__(self, invalidated: _Optional[bool] = ..., broadcast: _Optional[bool] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id", "scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    scope: Scope
    def __init__(self, session_id: _Optional[str] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("dropped", "broadcast")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    broadcast: bool
    def __init__(self, dropped: _Optional[bool] = ..., broadcast: _Optional[bool] = ...) -> None: ...

class ListToolsRequest(_message.Message):
    __slots__ = ("scope",)
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "input_schema_json", "openai_json", "anthropic_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    INPUT_SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    OPENAI_JSON_FIELD_NUMBER: _ClassVar[int]
    ANTHROPIC_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    input_schema_json: str
    openai_json: str
    anthropic_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., input_schema_json: _Optional[str] = ..., openai_json: _Optional[str] = ..., anthropic_json: _Optional[str] = ...) -> None: ...

class ListToolsResponse(_message.Message):
    __slots__ = ("tools", "claude_memory_tool")
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    CLAUDE_MEMORY_TOOL_FIELD_NUMBER: _ClassVar[int]
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    claude_memory_tool: Tool
    def __init__(self, tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., claude_memory_tool: _Optional[_Union[Tool, _Mapping]] = ...) -> None: ...

class CallToolRequest(_message.Message):
    __slots__ = ("scope", "session_id", "name", "arguments_json")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    session_id: str
    name: str
    arguments_json: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., session_id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class CallToolResponse(_message.Message):
    __slots__ = ("text", "is_error", "structured_json", "generation")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_JSON_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    text: str
    is_error: bool
    structured_json: str
    generation: int
    def __init__(self, text: _Optional[str] = ..., is_error: _Optional[bool] = ..., structured_json: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ForgetUserRequest(_message.Message):
    __slots__ = ("user_id", "erase_agent_notes_written_for_user")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    ERASE_AGENT_NOTES_WRITTEN_FOR_USER_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    erase_agent_notes_written_for_user: bool
    def __init__(self, user_id: _Optional[str] = ..., erase_agent_notes_written_for_user: _Optional[bool] = ...) -> None: ...

class DeleteScopeRequest(_message.Message):
    __slots__ = ("scope", "tier")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    tier: Tier
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class ForgetUserResponse(_message.Message):
    __slots__ = ("erasure", "agent_notes_written_for_user", "agent_note_ids_written_for_user", "agent_notes_erased")
    ERASURE_FIELD_NUMBER: _ClassVar[int]
    AGENT_NOTES_WRITTEN_FOR_USER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NOTE_IDS_WRITTEN_FOR_USER_FIELD_NUMBER: _ClassVar[int]
    AGENT_NOTES_ERASED_FIELD_NUMBER: _ClassVar[int]
    erasure: Erasure
    agent_notes_written_for_user: int
    agent_note_ids_written_for_user: _containers.RepeatedScalarFieldContainer[str]
    agent_notes_erased: bool
    def __init__(self, erasure: _Optional[_Union[Erasure, _Mapping]] = ..., agent_notes_written_for_user: _Optional[int] = ..., agent_note_ids_written_for_user: _Optional[_Iterable[str]] = ..., agent_notes_erased: _Optional[bool] = ...) -> None: ...

class DeleteScopeResponse(_message.Message):
    __slots__ = ("erasure",)
    ERASURE_FIELD_NUMBER: _ClassVar[int]
    erasure: Erasure
    def __init__(self, erasure: _Optional[_Union[Erasure, _Mapping]] = ...) -> None: ...

class Erasure(_message.Message):
    __slots__ = ("memories", "vectors", "idempotency_keys", "change_rows", "sessions", "generation", "audit_id")
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHANGE_ROWS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    AUDIT_ID_FIELD_NUMBER: _ClassVar[int]
    memories: int
    vectors: int
    idempotency_keys: int
    change_rows: int
    sessions: int
    generation: int
    audit_id: int
    def __init__(self, memories: _Optional[int] = ..., vectors: _Optional[int] = ..., idempotency_keys: _Optional[int] = ..., change_rows: _Optional[int] = ..., sessions: _Optional[int] = ..., generation: _Optional[int] = ..., audit_id: _Optional[int] = ...) -> None: ...

class ExportMemoriesRequest(_message.Message):
    __slots__ = ("scope", "tier", "for_user", "cursor", "batch_size")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FOR_USER_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    tier: Tier
    for_user: bool
    cursor: str
    batch_size: int
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., for_user: _Optional[bool] = ..., cursor: _Optional[str] = ..., batch_size: _Optional[int] = ...) -> None: ...

class ExportMemoriesResponse(_message.Message):
    __slots__ = ("jsonl", "count", "cursor", "done")
    JSONL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    jsonl: str
    count: int
    cursor: str
    done: bool
    def __init__(self, jsonl: _Optional[str] = ..., count: _Optional[int] = ..., cursor: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class WatchMemoriesRequest(_message.Message):
    __slots__ = ("scope", "tier", "after_generation", "after_tier", "after_id")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    AFTER_GENERATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_TIER_FIELD_NUMBER: _ClassVar[int]
    AFTER_ID_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    tier: Tier
    after_generation: int
    after_tier: Tier
    after_id: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., after_generation: _Optional[int] = ..., after_tier: _Optional[_Union[Tier, str]] = ..., after_id: _Optional[str] = ...) -> None: ...

class WatchMemoriesResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: MemoryEvent
    def __init__(self, event: _Optional[_Union[MemoryEvent, _Mapping]] = ...) -> None: ...

class MemoryEvent(_message.Message):
    __slots__ = ("kind", "generation", "tier", "id", "memory")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[MemoryEvent.Kind]
        KIND_SYNC: _ClassVar[MemoryEvent.Kind]
        KIND_ADD: _ClassVar[MemoryEvent.Kind]
        KIND_UPDATE: _ClassVar[MemoryEvent.Kind]
        KIND_DELETE: _ClassVar[MemoryEvent.Kind]
        KIND_EXPIRE: _ClassVar[MemoryEvent.Kind]
        KIND_ERASE: _ClassVar[MemoryEvent.Kind]
    KIND_UNSPECIFIED: MemoryEvent.Kind
    KIND_SYNC: MemoryEvent.Kind
    KIND_ADD: MemoryEvent.Kind
    KIND_UPDATE: MemoryEvent.Kind
    KIND_DELETE: MemoryEvent.Kind
    KIND_EXPIRE: MemoryEvent.Kind
    KIND_ERASE: MemoryEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    kind: MemoryEvent.Kind
    generation: int
    tier: Tier
    id: str
    memory: Memory
    def __init__(self, kind: _Optional[_Union[MemoryEvent.Kind, str]] = ..., generation: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., id: _Optional[str] = ..., memory: _Optional[_Union[Memory, _Mapping]] = ...) -> None: ...

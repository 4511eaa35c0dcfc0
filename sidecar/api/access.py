"""Who may address which scopes: per-token grants and the check on a scope.

`server.auth_tokens_file` lists bearer tokens, each limited to some
agent_ids and user_ids:

    tokens:
      - token_file: /secrets/agent-a/token     # a mounted Secret; relative
        agents: [agent-a]                       # paths start at this file
        users: ["*"]                            # any user
      - sha256: 4c5d...e1                       # the token's digest: this
        agents: [agent-b]                       # file then holds no secret
        users: [ada, ""]                        # "" is the default scope

AuthInterceptor finds the caller's Grant by its token and runs the call
under it (`granted`); MemoryService checks every request's Scope against it
(`authorize`) where it resolves the scope, before anything is read or
written. Without a grant in force (no auth configured) every scope is
allowed, as before per-agent tokens existed.

No grpc here: the interceptor carries the grant across, the service reads it.

Owns: Grant, the call's grant (a context variable), authorize, bearer_token
(the token of an authorization header, for gRPC and MCP alike) and the tokens
file (a sidecar.api.reloading.Reloading, bounded in size and nesting); it keeps only
token digests. Must not touch: grpc (the interceptor sets the grant, the service
checks it), the engine, the store, os.environ; it reads only the tokens file and
the token files it names.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from sidecar.api.reloading import Reloading, Unreadable, read_regular
from sidecar.core.errors import ConfigError, PermissionDenied, Reason
from sidecar.core.memory import Scope

log = logging.getLogger("sidecar.access")

ANY_ID = "*"
_ENTRY_KEYS = ("name", "token_file", "sha256", "agents", "users", "erase")
# Bounds on what is read and parsed: a tokens file of thousands of entries
# is a few hundred KiB; a token is a line. A valid file nests 4 deep (the
# document, tokens, an entry, its ids): YAML's composer recurses once per
# level, so anything deeper is refused from the parser's flat events first.
TOKENS_FILE_BYTES = 1024 * 1024
TOKEN_FILE_BYTES = 64 * 1024
MAX_DEPTH = 6


@dataclass(frozen=True, slots=True)
class Grant:
    """The agent_ids and user_ids a token may address (None means any),
    whether it may erase (ForgetUser, DeleteScope), and the token's name as
    the audit log records it."""

    agents: frozenset[str] | None = None
    users: frozenset[str] | None = None
    erase: bool = False
    # Not part of what a grant allows: two entries may allow the same.
    name: str = field(default="", compare=False)

    @property
    def unrestricted(self) -> bool:
        return self.agents is None and self.users is None

    def refusal(self, scope: Scope) -> PermissionDenied | None:
        """Why this grant may not address `scope`, or None when it may."""
        for name, value, allowed in (
            ("agent_id", scope.agent_id, self.agents),
            ("user_id", scope.user_id, self.users),
        ):
            if allowed is not None and value not in allowed:
                return PermissionDenied(
                    f"this token may not address {name} {value!r}; "
                    "use a token whose grant lists it",
                    metadata={
                        "field": f"scope.{name}",
                        "agent_id": scope.agent_id,
                        "user_id": scope.user_id,
                    },
                )
        return None


# No auth configured: every scope, and erasure too (a sidecar without tokens
# trusts whatever can reach its socket).
ANY = Grant(erase=True, name="unauthenticated")
# The single token of `server.auth_token_file`: every scope, no erasure
# (only a tokens-file entry with `erase: true` may erase).
SINGLE = Grant(name="auth_token_file")

# The grant of the call this thread is serving. The default lets everything
# through: without auth there is nothing to enforce.
_current: contextvars.ContextVar[Grant] = contextvars.ContextVar("grant", default=ANY)


@contextlib.contextmanager
def granted(grant: Grant) -> Iterator[None]:
    """Run the block under `grant` (the caller's), restoring the old one after."""
    token = _current.set(grant)
    try:
        yield
    finally:
        _current.reset(token)


def bearer_token(authorization: bytes) -> bytes:
    """The token of an `authorization: Bearer <token>` value; b"" for none."""
    scheme, _, credential = authorization.partition(b" ")
    return credential.strip() if scheme.lower() == b"bearer" else b""


def authorize(scope: Scope) -> None:
    """Raise PermissionDenied unless the call's grant may address `scope`."""
    grant = _current.get()
    if grant.unrestricted:
        return
    refusal = grant.refusal(scope)
    if refusal is not None:
        raise refusal


def authorize_user(user_id: str) -> None:
    """Raise PermissionDenied unless the call's grant may address `user_id`,
    whatever the agent: for a call about one user's profile as a whole
    (ExportMemories' for_user). Every grant lists at least one agent, so a
    token that may address the user reads that profile through any of its
    agents already: only the users it lists matter."""
    refusal = Grant(users=_current.get().users).refusal(Scope(user_id=user_id))
    if refusal is not None:
        raise refusal


def authorize_erasure(what: str) -> str:
    """The name of the call's token, for the audit log; PermissionDenied
    (ERASE_NOT_GRANTED) unless its grant says `erase: true`."""
    grant = _current.get()
    if not grant.erase:
        raise PermissionDenied(
            f"{what} erases data: only a token whose entry in the tokens file says "
            "`erase: true` may call it",
            reason=Reason.ERASE_NOT_GRANTED,
            metadata={"token": grant.name},
        )
    return grant.name


# --- the tokens file ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry as the tokens file states it (token files not yet read)."""

    where: str
    token_file: Path | None
    sha256: bytes
    grant: Grant


def _ids(where: str, value: Any) -> frozenset[str] | None:
    if value is None:
        raise ConfigError(
            where, f'required: a list of ids this token may address, or ["{ANY_ID}"] for any'
        )
    if not isinstance(value, list) or not value:
        raise ConfigError(where, f"must be a non-empty list of ids, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            raise ConfigError(where, f"ids are strings (quote them), got {item!r}")
    if ANY_ID in value:
        if len(value) > 1:
            raise ConfigError(where, f'"{ANY_ID}" (any id) stands alone, got {value!r}')
        return None
    return frozenset(value)


def _entry(where: str, raw: Any, directory: Path) -> Entry:
    if not isinstance(raw, Mapping):
        raise ConfigError(where, f"must be a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in _ENTRY_KEYS:
            raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(_ENTRY_KEYS)})")
    if ("token_file" in raw) == ("sha256" in raw):
        raise ConfigError(where, "give the token as exactly one of token_file or sha256")
    erase = raw.get("erase", False)
    if not isinstance(erase, bool):
        raise ConfigError(f"{where}.erase", f"must be true or false, got {erase!r}")
    name = raw.get("name", raw.get("token_file") or where)
    if not isinstance(name, str) or not name or len(name) > 200:
        raise ConfigError(f"{where}.name", f"must be a short non-empty string, got {name!r}")
    grant = Grant(
        _ids(f"{where}.agents", raw.get("agents")),
        _ids(f"{where}.users", raw.get("users")),
        erase=erase,
        name=name,
    )
    if "sha256" in raw:
        text = raw["sha256"]
        try:
            digest = bytes.fromhex(text) if isinstance(text, str) else b""
        except ValueError:
            digest = b""
        if len(digest) != hashlib.sha256().digest_size:
            raise ConfigError(
                f"{where}.sha256", "must be 64 hex digits (`printf %s TOKEN | sha256sum`)"
            )
        return Entry(where, None, digest, grant)
    name = raw["token_file"]
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.token_file", f"must be a file name, got {name!r}")
    return Entry(where, directory / name, b"", grant)


def _nesting(text: str) -> None:
    """ConfigError if `text` nests collections deeper than MAX_DEPTH.

    Read from the parser's events, which come from a loop, not recursion:
    `tokens: [[[...]]]` thousands deep is refused in a few milliseconds,
    before the composer would hit Python's recursion limit.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(
                    "tokens",
                    f"nested deeper than {MAX_DEPTH} levels "
                    "(tokens is a list of mappings whose agents and users are lists of ids)",
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


def parse_tokens(text: str, directory: Path) -> list[Entry]:
    """The entries of a tokens file; ConfigError naming the field if invalid."""
    try:
        _nesting(text)
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("tokens", f"not valid YAML or JSON: {exc}") from None
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        # What a scalar's constructor (a bad !!timestamp) or anything the
        # nesting bound missed may raise: still one line, never a traceback.
        raise ConfigError(
            "tokens", f"not valid YAML or JSON: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(document, Mapping) or set(document) != {"tokens"}:
        raise ConfigError("tokens", "the file holds one key, tokens: a list of entries")
    entries = document["tokens"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("tokens", "must be a non-empty list of entries")
    return [_entry(f"tokens[{i}]", raw, directory) for i, raw in enumerate(entries)]


def _digests(
    entries: Sequence[Entry], skipped: Callable[[str], None] | None = None
) -> tuple[tuple[bytes, Grant], ...]:
    """Each entry's token digest (reading token files) and grant.

    A token file that cannot be read or is empty, or two entries with the
    same token, are a ConfigError; given `skipped` (once serving), those
    entries are left out and reported there. So revocation stays exact
    whatever else is wrong: removing a token's file revokes it, a rewritten
    one no longer accepts the old token, and the other entries still follow
    their files. A token in two entries is refused in both (which grant it
    should carry is a guess, and a wrong guess widens a grant), while the
    rest of the set is used, unlike a tokens file refused whole, whose last
    good set would keep revoked tokens alive.
    """
    found: list[tuple[bytes, Entry]] = []
    for entry in entries:
        digest = entry.sha256
        if entry.token_file is not None:
            try:
                token = read_regular(entry.token_file, TOKEN_FILE_BYTES).strip()
                problem = "" if token else f"{entry.token_file} is empty"
            except Unreadable as exc:
                problem = str(exc)
            if problem:
                where = f"{entry.where}.token_file"
                if skipped is None:
                    raise ConfigError(where, problem)
                skipped(f"{where}: {problem}; its token is refused")
                continue
            digest = hashlib.sha256(token).digest()
        found.append((digest, entry))
    first: dict[bytes, str] = {}
    shared: dict[bytes, list[str]] = {}
    for digest, entry in found:
        if digest not in first:
            first[digest] = entry.where
        elif skipped is None:
            raise ConfigError(entry.where, f"the same token as {first[digest]}")
        else:
            shared.setdefault(digest, [first[digest]]).append(entry.where)
    report = skipped or (lambda problem: None)  # without it, shared is empty
    for names in shared.values():
        listed = ", ".join(names[:-1]) + " and " + names[-1]
        every = "both" if len(names) == 2 else "all"
        report(f"{listed}: the same token; {every} refused until one is changed")
    return tuple((digest, entry.grant) for digest, entry in found if digest not in shared)


Digests = tuple[tuple[bytes, Grant], ...]


class TokensFile(Reloading[Digests]):
    """`server.auth_tokens_file`: bearer tokens, each with its Grant.

    Holds only SHA-256 digests of the tokens. Re-read (with the token files
    it names) by `reload`, which a Watcher calls every
    `server.auth_reload_seconds`: a changed file or a rotated token takes
    effect then. A tokens file that cannot be read or parsed keeps the last
    good entries, whose token files are still followed (revocation works
    meanwhile); an entry whose token file is gone, empty or shared with
    another entry is refused alone.

    >>> tokens = TokensFile("tokens.yaml")
    >>> tokens.grant(b"token-of-agent-a")
    Grant(agents=frozenset({'agent-a'}), users=None, erase=False, name='agent-a.token')
    >>> tokens.grant(b"no one's token") is None
    True
    """

    what = "auth tokens file"
    kept = "tokens"

    def __init__(self, path: str) -> None:
        self._path = Path(path)
        # The bytes last parsed well and their entries, swapped as one.
        self._parsed: tuple[bytes, list[Entry]] | None = None
        # The bytes last refused and why.
        self._refused: tuple[bytes, str] | None = None
        self._serving = False
        # The entries refused at the last reload, each logged when it first appears.
        self._skips: frozenset[str] = frozenset()
        super().__init__("server.auth_tokens_file")
        self._serving = True

    @property
    def problems(self) -> int:
        return super().problems + len(self._skips)

    def _entries(self) -> tuple[list[Entry] | None, str]:
        """The file's entries (parsed again only when its bytes changed), or
        None and what is wrong."""
        try:
            data = read_regular(self._path, TOKENS_FILE_BYTES)
        except Unreadable as exc:
            return None, str(exc)
        parsed, refused = self._parsed, self._refused
        if parsed is not None and parsed[0] == data:
            return parsed[1], ""
        if refused is not None and refused[0] == data:
            return None, refused[1]  # not parsed again every reload
        try:
            entries = parse_tokens(data.decode("utf-8"), self._path.parent)
        except UnicodeDecodeError:
            problem = f"{self._path} is not UTF-8 text"
        except ConfigError as exc:
            problem = f"{self._path}: {exc.key}: {exc.problem}"
        else:
            self._parsed, self._refused = (data, entries), None
            return entries, ""
        self._refused = (data, problem)
        return None, problem

    def _read(self) -> tuple[Digests | None, str]:
        entries, problem = self._entries()
        if entries is None:
            if self._parsed is None:
                return None, problem  # at start: nothing good to keep
            entries = self._parsed[1]
        if not self._serving:
            try:
                return _digests(entries), problem
            except ConfigError as exc:
                return None, f"{self._path}: {exc.key}: {exc.problem}"
        skips: list[str] = []
        digests = _digests(entries, skips.append)
        for skip in skips:
            if skip not in self._skips:  # once per change, not every reload
                log.warning("auth tokens file: %s", skip)
        self._skips = frozenset(skips)
        return digests, problem

    def _news(self, old: Digests, new: Digests) -> str:
        count = len(new)
        return f"{self.what} changed; using its {count} token{'' if count == 1 else 's'}"

    def grant(self, presented: bytes) -> Grant | None:
        """The grant of a presented token, or None when no entry has it.

        Every entry is compared, in constant time, whatever matches: how
        long the answer takes says nothing about which tokens exist.
        """
        digest = hashlib.sha256(presented).digest()
        found: Grant | None = None
        for expected, grant in self.current():
            if hmac.compare_digest(digest, expected):
                found = grant
        return found

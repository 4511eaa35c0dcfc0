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
(the token of an authorization header, for gRPC and MCP alike), the tokens file
and Reloading (also the base of interceptors.TokenFile); it keeps only token
digests. Must not touch: grpc (the interceptor sets the grant, the service
checks it), the engine, the store, os.environ; it reads only the tokens file and
the token files it names.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import yaml

from sidecar.errors import ConfigError, PermissionDenied
from sidecar.memory import Scope

log = logging.getLogger(__name__)

ANY_ID = "*"
_ENTRY_KEYS = ("name", "token_file", "sha256", "agents", "users", "erase")


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
    whatever the agent: ForgetUser erases the user's profile, which every
    agent shares."""
    grant = _current.get()
    if grant.users is not None and user_id not in grant.users:
        raise PermissionDenied(
            f"this token may not address user_id {user_id!r}; use a token whose grant lists it",
            metadata={"field": "user_id", "user_id": user_id},
        )


def authorize_erasure(what: str) -> str:
    """The name of the call's token, for the audit log; PermissionDenied
    (ERASE_NOT_GRANTED) unless its grant says `erase: true`."""
    grant = _current.get()
    if not grant.erase:
        raise PermissionDenied(
            f"{what} erases data: only a token whose entry in the tokens file says "
            "`erase: true` may call it",
            reason="ERASE_NOT_GRANTED",
            metadata={"token": grant.name},
        )
    return grant.name


# --- files re-read while serving ---------------------------------------------

T = TypeVar("T")


class Reloading(Generic[T]):
    """A value read from files, re-read at most once a second.

    So a rotated Kubernetes Secret takes effect without a restart. The
    content is compared, not timestamps: a rewrite in place within the
    filesystem's timestamp granularity changes neither inode nor mtime.
    Once serving, a read that fails (a file missing, unreadable, empty or
    invalid, caught mid-rewrite) keeps the last good value and says so in
    the log once; only at start-up is it an error, a ConfigError on `key`.
    """

    # How the log names the file and what is kept when a read fails.
    what: ClassVar[str] = "file"
    kept: ClassVar[str] = "value"

    def __init__(self, key: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._complaint = ""
        value, problem = self._read()
        if value is None:
            raise ConfigError(key, problem)
        self._value: T = value
        self._checked = clock()

    def _read(self) -> tuple[T | None, str]:
        """The value, or None and what is wrong."""
        raise NotImplementedError

    def _news(self, old: T, new: T) -> str:
        """The log line for a changed value."""
        return f"{self.what} changed"

    def current(self) -> T:
        now = self._clock()
        with self._lock:
            due = now - self._checked >= 1.0
            if due:
                self._checked = now  # one caller reads; the rest go on
        if not due:
            return self._value
        # Read outside the lock: a slow filesystem must not stall every call.
        value, problem = self._read()
        with self._lock:
            if value is None:
                if problem != self._complaint:
                    log.warning("%s: %s; keeping the last good %s", self.what, problem, self.kept)
                self._complaint = problem
            else:
                if value != self._value:
                    log.info("%s", self._news(self._value, value))
                self._value, self._complaint = value, ""
            return self._value


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


def parse_tokens(text: str, directory: Path) -> list[Entry]:
    """The entries of a tokens file; ConfigError naming the field if invalid."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("tokens", f"not valid YAML or JSON: {exc}") from None
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

    A token file that cannot be read or is empty is a ConfigError, or, given
    `skipped` (once serving), leaves its entry out and is reported there:
    removing a token's file revokes it, and the other entries still follow
    their files (a rotation is not held up by another entry's problem).
    """
    out: list[tuple[bytes, Grant]] = []
    seen: dict[bytes, str] = {}
    for entry in entries:
        digest = entry.sha256
        if entry.token_file is not None:
            where = f"{entry.where}.token_file"
            try:
                token = entry.token_file.read_bytes().strip()
                problem = "" if token else f"{entry.token_file} is empty"
            except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
                problem = f"cannot read {entry.token_file}: {getattr(exc, 'strerror', 0) or exc}"
            if problem:
                if skipped is None:
                    raise ConfigError(where, problem)
                skipped(f"{where}: {problem}; its token is refused")
                continue
            digest = hashlib.sha256(token).digest()
        if digest in seen:
            # Two grants for one token: refuse rather than guess which applies.
            raise ConfigError(entry.where, f"the same token as {seen[digest]}")
        seen[digest] = entry.where
        out.append((digest, entry.grant))
    return tuple(out)


Digests = tuple[tuple[bytes, Grant], ...]


class TokensFile(Reloading[Digests]):
    """`server.auth_tokens_file`: bearer tokens, each with its Grant.

    Holds only SHA-256 digests of the tokens. Re-read (with the token files
    it names) at most once a second, like TokenFile: a changed file or a
    rotated token takes effect within a second, a broken one keeps the
    last good set.

    >>> tokens = TokensFile("/etc/memory-sidecar/tokens.yaml")
    >>> tokens.grant(b"token-of-agent-a")   # Grant(agents={'agent-a'}, ...) or None
    """

    what = "auth tokens file"
    kept = "tokens"

    def __init__(self, path: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._path = Path(path)
        # The text last parsed and its entries, swapped as one: two reads
        # may overlap when one takes longer than a second.
        self._parsed: tuple[str, list[Entry]] | None = None
        self._serving = False
        self._skips: set[str] = set()
        super().__init__("server.auth_tokens_file", clock)
        self._serving = True

    def _skipped(self, problem: str) -> None:
        if problem not in self._skips:  # said once, not every second
            self._skips.add(problem)
            log.warning("auth tokens file: %s", problem)

    def _read(self) -> tuple[Digests | None, str]:
        try:
            text = self._path.read_text(encoding="utf-8")
        except OSError as exc:
            return None, f"cannot read {self._path}: {exc.strerror or exc}"
        except UnicodeDecodeError:
            return None, f"{self._path} is not UTF-8 text"
        try:
            # Parsed again only when the text changed; the token files it
            # names are read every time, as a rotated Secret changes only them.
            parsed = self._parsed
            if parsed is None or parsed[0] != text:
                parsed = (text, parse_tokens(text, self._path.parent))
                self._parsed = parsed
            return _digests(parsed[1], self._skipped if self._serving else None), ""
        except ConfigError as exc:
            return None, f"{self._path}: {exc.key}: {exc.problem}"

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

"""The `memory-sidecar` command: parse, load config, set up logging, run.

One argparse parser for every subcommand: serve (sidecar.ops.daemon), the online
and offline operator commands (sidecar.ops.admin), import-cagent (sidecar.ops.cagent),
health, mcp (sidecar.ops.mcp_stdio, imported only for it: the mcp extra),
mcp-config (sidecar.ops.host_config). Server
flags become configuration keys through sidecar.config.settings.load.

Owns: subcommands, flags, exit codes and how a failure is reported.
Must not touch: validating values (sidecar.config.settings), RPCs or output
formats (sidecar.ops.admin). It is the one module that reads os.environ,
handed whole to sidecar.config.settings, but it reads MEMORY_SIDECAR_CONFIG
itself, and import-cagent's store steps are written here rather than in
sidecar.ops.admin.

A command imports only what it runs (inside the functions below): `--help`
loads no other sidecar module, an operator command neither the gRPC server
nor numpy. Tests and scripts start this process many times over.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sidecar import __version__
from sidecar.core.errors import ConfigError, SidecarError

if TYPE_CHECKING:
    from sidecar.config.settings import Config

EXIT_ERROR = 1
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memory-sidecar",
        description="A gRPC daemon that owns an AI agent's long-term memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _common_options()
    # The order subcommands are added in is the order --help lists them.
    _add_serve(commands, common)
    _add_import_cagent(commands, common)
    _add_health(commands)
    _add_online(commands)
    _add_mcp_config(commands)
    _add_offline(commands, common)
    return parser


def _common_options() -> argparse.ArgumentParser:
    """The options of every command that opens the database (a parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="FILE",
        help="YAML configuration file (or $MEMORY_SIDECAR_CONFIG)",
    )
    common.add_argument(
        "--db",
        metavar="PATH|DSN",
        help="SQLite database file, or a postgresql:// DSN (no password in it)",
    )
    common.add_argument(
        "--db-password-file",
        metavar="FILE",
        help="file holding the PostgreSQL password (or set $MEMORY_SIDECAR_DB_PASSWORD)",
    )
    return common


def _add_serve(commands: Any, common: argparse.ArgumentParser) -> None:
    serve = commands.add_parser("serve", parents=[common], help="run the daemon")
    _add_listeners(serve)
    serve.add_argument(
        "--grace-seconds",
        metavar="S",
        help="how long in-flight calls may take to finish on SIGTERM",
    )
    serve.add_argument(
        "--durability",
        choices=("normal", "full"),
        help="SQLite synchronous setting: normal survives a process crash, "
        "full also survives power loss",
    )
    serve.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="log verbosity"
    )
    _add_access(serve)


def _add_listeners(serve: argparse.ArgumentParser) -> None:
    """serve's addresses: the API's, and the optional health, metrics and MCP ones."""
    serve.add_argument(
        "--listen",
        metavar="ADDR",
        help="API address, HOST:PORT or unix:/path (default 127.0.0.1:50051)",
    )
    serve.add_argument(
        "--health-listen",
        metavar="ADDR",
        help="extra listener serving only grpc.health.v1, for probes",
    )
    serve.add_argument(
        "--metrics-listen", metavar="ADDR", help="HOST:PORT serving Prometheus metrics at /metrics"
    )
    serve.add_argument(
        "--mcp-listen",
        metavar="ADDR",
        help="HOST:PORT serving MCP (streamable HTTP) at /mcp; needs the mcp extra",
    )


def _add_access(serve: argparse.ArgumentParser) -> None:
    """serve's tokens and TLS: who may call the API."""
    serve.add_argument(
        "--auth-token-file", metavar="FILE", help="require this bearer token on every API call"
    )
    serve.add_argument(
        "--auth-tokens-file",
        metavar="FILE",
        help="also accept these bearer tokens, each limited to the agents and users it lists",
    )
    serve.add_argument(
        "--insecure",
        action="store_const",
        const="true",
        help="allow a non-loopback API address without a token",
    )
    serve.add_argument("--tls-cert-file", metavar="FILE", help="serve the API over TLS")
    serve.add_argument("--tls-key-file", metavar="FILE", help="the TLS certificate's key")
    serve.add_argument(
        "--tls-client-ca-file",
        metavar="FILE",
        help="require client certificates signed by this CA (mutual TLS)",
    )


def _add_import_cagent(commands: Any, common: argparse.ArgumentParser) -> None:
    imp = commands.add_parser(
        "import-cagent",
        parents=[common],
        help="adopt a cagent memory.db into an agent's notes tier",
    )
    imp.add_argument("path", metavar="PATH", help="the cagent memory.db")
    imp.add_argument("--agent-id", required=True, help="the agent whose notes receive them")


def _add_health(commands: Any) -> None:
    health = commands.add_parser(
        "health", help="check a daemon's grpc.health.v1 status (exit 0 when SERVING)"
    )
    health.add_argument("--config", metavar="FILE", help="YAML configuration (for the address)")
    health.add_argument(
        "--address", metavar="ADDR", help="default: the configured health listener, else the API"
    )
    health.add_argument("--service", default="", help="service name (default: the server)")
    health.add_argument(
        "--timeout", type=float, default=3.0, metavar="S", help="seconds to wait (default 3)"
    )


def _confidence(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


_TIERS = ("memory", "user", "both")


def _add_online(commands: Any) -> None:
    online = argparse.ArgumentParser(add_help=False)
    group = online.add_argument_group("daemon")
    _add_daemon_options(group)
    _add_mcp(commands, online)
    # Added after `mcp` took its copy of the options: it prints no tables.
    group.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_add(commands, online)
    _add_list(commands, online)
    _add_search(commands, online)
    _add_update(commands, online)
    rm = commands.add_parser("rm", parents=[online], help="delete a memory")
    rm.add_argument("id", help="the memory's id (from list or search)")
    commands.add_parser("usage", parents=[online], help="each tier's budget use")
    _add_inject(commands, online)


def _add_daemon_options(group: Any) -> None:
    """How an online command reaches the daemon, and in which scope."""
    group.add_argument("--config", metavar="FILE", help="YAML configuration (for the address)")
    group.add_argument(
        "--address",
        metavar="ADDR",
        help="the daemon's API (default: the configured listen address)",
    )
    group.add_argument("--agent-id", default="", help="scope: the agent (default scope: empty)")
    group.add_argument("--user-id", default="", help="scope: the user (default scope: empty)")
    group.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the daemon (default 10)",
    )
    group.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token to send (default: the configured auth_token_file)",
    )
    group.add_argument(
        "--tls-ca-file",
        metavar="FILE",
        help="connect over TLS trusting this CA (default: the configured tls_cert_file)",
    )


def _add_mcp(commands: Any, online: argparse.ArgumentParser) -> None:
    bridge = commands.add_parser(
        "mcp",
        parents=[online],
        help="serve MCP over stdio, for clients that spawn a process: a bridge to a "
        "running daemon's API, in the scope --agent-id and --user-id name",
    )
    bridge.add_argument(
        "--session-id",
        metavar="ID",
        help="the runtime session (default: one of its own, ended on exit)",
    )


def _add_mcp_config(commands: Any) -> None:
    config = commands.add_parser(
        "mcp-config",
        help="print an agent host's entry for this sidecar, with absolute paths",
    )
    config.add_argument(
        "--host",
        required=True,
        choices=("claude-code", "claude-desktop", "cursor"),
        help="the agent host the entry is for",
    )
    config.add_argument(
        "--transport",
        choices=("stdio", "http"),
        default="stdio",
        help="stdio: the bridge `memory-sidecar mcp` (default; Claude Desktop takes only "
        "this); http: the daemon's MCP listener",
    )
    config.add_argument("--name", default="memory", help="the server's name (default memory)")
    config.add_argument("--config", metavar="FILE", help="YAML configuration (for the address)")
    config.add_argument("--address", metavar="ADDR", help="the daemon's API, for stdio")
    config.add_argument(
        "--url",
        help="the daemon's MCP URL, for http (default: the configured mcp_listen's, "
        "else http://127.0.0.1:8765/mcp, where `make run` serves it)",
    )
    config.add_argument("--agent-id", default="", help="scope: the agent")
    config.add_argument("--user-id", default="", help="scope: the user")
    config.add_argument("--token-file", metavar="FILE", help="bearer token the bridge sends")
    config.add_argument("--tls-ca-file", metavar="FILE", help="the bridge trusts this CA")
    config.add_argument(
        "--json", action="store_true", help="claude-code: the .mcp.json entry, not the command"
    )


def _add_add(commands: Any, online: argparse.ArgumentParser) -> None:
    add = commands.add_parser("add", parents=[online], help="add a memory")
    add.add_argument("content", help="what to remember")
    add.add_argument(
        "--tier",
        choices=_TIERS[:2],
        default="memory",
        help="memory: agent notes (the agent's); user: user profile (the user's)",
    )
    add.add_argument("--category", default="", help="a label to filter by")
    add.add_argument("--confidence", type=_confidence, help="0 to 1 (default 1)")


def _add_list(commands: Any, online: argparse.ArgumentParser) -> None:
    lst = commands.add_parser("list", parents=[online], help="list memories and usage")
    lst.add_argument("--tier", choices=_TIERS, default="both", help="which tier (default both)")
    lst.add_argument("--category", default="", help="only entries with this category")


def _add_search(commands: Any, online: argparse.ArgumentParser) -> None:
    search = commands.add_parser("search", parents=[online], help="ranked search")
    search.add_argument("query", help="free text")
    search.add_argument("--tier", choices=_TIERS, default="both", help="which tier (default both)")
    search.add_argument("--category", default="", help="only entries with this category")
    search.add_argument("--limit", type=int, default=20, help="most hits (default 20)")
    search.add_argument("--all", action="store_true", help="every keyword must match")


def _add_update(commands: Any, online: argparse.ArgumentParser) -> None:
    update = commands.add_parser("update", parents=[online], help="change a memory")
    update.add_argument("id", help="the memory's id (from list or search)")
    update.add_argument("--content", help="new content")
    update.add_argument("--category", help="new category")
    update.add_argument("--confidence", type=_confidence, help="new confidence, 0 to 1")


def _add_inject(commands: Any, online: argparse.ArgumentParser) -> None:
    inject = commands.add_parser(
        "inject", parents=[online], help="show exactly what a turn would inject"
    )
    inject.add_argument("message", nargs="?", default="", help="the user message")
    inject.add_argument(
        "--recent", action="append", metavar="TEXT", help="a recent message (repeatable)"
    )
    inject.add_argument("--session", help="use this session (default: a throwaway one)")


def _add_offline(commands: Any, common: argparse.ArgumentParser) -> None:
    backup = commands.add_parser(
        "backup", parents=[common], help="copy the database (consistent while the daemon runs)"
    )
    backup.add_argument("destination", metavar="FILE", help="where to write the copy")
    export = commands.add_parser(
        "export",
        parents=[common],
        help="write every memory as JSON Lines (--db), or a scope's through a running daemon "
        "(--address)",
    )
    export.add_argument(
        "destination",
        metavar="FILE",
        nargs="?",
        default="-",
        help="output file (default: standard output)",
    )
    _add_export_online(export.add_argument_group("through a running daemon (ExportMemories)"))
    imp = commands.add_parser("import", parents=[common], help="restore memories from JSON Lines")
    imp.add_argument("source", metavar="FILE", help="an export file, or - for standard input")
    check = commands.add_parser(
        "check", parents=[common], help="integrity check and schema version"
    )
    check.add_argument("--json", action="store_true", help="print JSON instead of text")
    audit = commands.add_parser(
        "audit", parents=[common], help="print the erasure audit log as JSON Lines"
    )
    audit.add_argument("--since", default="", metavar="TIME", help="rows at or after (RFC 3339)")
    audit.add_argument("--limit", type=int, metavar="N", help="only the newest N rows")


def _add_export_online(group: Any) -> None:
    group.add_argument("--address", metavar="ADDR", help="the daemon's API; exports online")
    group.add_argument("--agent-id", default="", help="scope: the agent")
    group.add_argument("--user-id", default="", help="scope: the user")
    group.add_argument(
        "--for-user",
        metavar="USER_ID",
        help="every entry of this user's profile, whatever the agent (no --agent-id)",
    )
    group.add_argument(
        "--tier", choices=("memory", "user", "both"), default="both", help="default both"
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds to wait for the daemon, at the start and after a cut (default 10)",
    )
    group.add_argument(
        "--retries",
        type=int,
        default=5,
        metavar="N",
        help="resume this many times after a cut connection (default 5)",
    )
    group.add_argument("--token-file", metavar="FILE", help="bearer token to send")
    group.add_argument("--tls-ca-file", metavar="FILE", help="connect over TLS trusting this CA")


_SERVER_FLAGS = (
    "db",
    "db_password_file",
    "listen",
    "health_listen",
    "metrics_listen",
    "mcp_listen",
    "grace_seconds",
    "durability",
    "log_level",
    "auth_token_file",
    "auth_tokens_file",
    "insecure",
    "tls_cert_file",
    "tls_key_file",
    "tls_client_ca_file",
)


def _load(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    from sidecar.config.settings import load

    path = args.config or environ.get("MEMORY_SIDECAR_CONFIG")
    flags = {key: getattr(args, key, None) for key in _SERVER_FLAGS}
    return load(path, environ=environ, flags=flags)


def _import_cagent(args: argparse.Namespace, cfg: Config) -> int:
    from sidecar.core.memory import Scope, Tier
    from sidecar.ops import admin, cagent, daemon
    from sidecar.storage import archive

    entries, warnings = cagent.read_entries(args.path)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    settings = cfg.for_agent(args.agent_id)
    store = daemon.open_store(cfg)
    try:
        store.open()
        scope = Scope(agent_id=args.agent_id)
        policy = settings.policy(Tier.MEMORY)
        report = archive.import_entries(store, scope, Tier.MEMORY, entries, policy)
        usage = store.usage(scope, [Tier.MEMORY])[Tier.MEMORY]
        limit = settings.memory_char_limit
        budget = f"/{limit:,} chars" if limit else " chars, unlimited"
        print(
            f"imported {len(report.imported)} of {len(entries)} entries into the agent notes of "
            f"{args.agent_id!r} ({usage.used_chars:,}{budget})"
        )
        if report.skipped:
            print(f"not imported ({len(report.skipped)}):")
            for entry, why in report.skipped:
                preview = entry.content if len(entry.content) <= 60 else entry.content[:57] + "..."
                print(f"  {entry.id}: {why}: {preview!r}")
        if report.imported:
            tiers = [(Tier.MEMORY, scope.owner(Tier.MEMORY))]
            admin.index_large_tiers(store, tiers, cfg.server.compact_tier_entries, sys.stdout)
    finally:
        store.close()
    return 0


_OFFLINE = ("backup", "export", "import", "check", "audit")


def _offline(args: argparse.Namespace, cfg: Config) -> int:
    from sidecar.ops import admin, daemon
    from sidecar.storage.store import is_dsn

    path = cfg.server.db
    if args.command != "import" and not is_dsn(path) and not os.path.isfile(path):
        print(f"memory-sidecar: no database at {path}", file=sys.stderr)
        return EXIT_ERROR
    store = daemon.open_store(cfg)
    try:
        if args.command == "backup":
            return admin.backup(store, args.destination, sys.stdout)
        if args.command == "check":
            return admin.check(store, sys.stdout, args.json)
        store.open()  # export, import and audit need the current schema
        if args.command == "audit":
            return admin.audit(store, args.since, args.limit, sys.stdout)
        if args.command == "export":
            return admin.export(store, args.destination, sys.stdout)
        compact_from = cfg.server.compact_tier_entries
        return admin.import_file(store, args.source, sys.stdout, compact_from=compact_from)
    finally:
        store.close()


def _mcp(args: argparse.Namespace, cfg: Config) -> int:
    try:
        from sidecar.ops import mcp_stdio
    except ImportError as exc:
        from sidecar.config.extras import mcp_extra_hint

        print(f"memory-sidecar: the mcp command needs {mcp_extra_hint()} ({exc})", file=sys.stderr)
        return EXIT_ERROR
    return mcp_stdio.run(args, cfg)


def _mcp_config(args: argparse.Namespace, cfg: Config) -> int:
    from sidecar.ops import host_config

    server = cfg.server
    scheme = "https" if server.tls_cert_file else "http"
    listen = host_config.reachable_address(server.mcp_listen)
    url = args.url or (f"{scheme}://{listen}/mcp" if server.mcp_listen else "")
    entry = host_config.Entry(
        host=args.host,
        transport=args.transport,
        name=args.name,
        agent_id=args.agent_id,
        user_id=args.user_id,
        address=args.address or server.listen,
        url=url or host_config.DEFAULT_URL,
        token_file=args.token_file or server.auth_token_file,
        tls_ca_file=args.tls_ca_file or "",
        config=args.config or "",
        as_json=args.json,
    )
    print(host_config.render(entry))
    if entry.token_file:
        from sidecar.ops.channel import read_token

        try:
            read_token(entry.token_file)
        except SidecarError as exc:  # the entry stands; the bridge will say so too
            print(f"memory-sidecar: warning: {exc.reason}: {exc.message}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env: Mapping[str, Any] = os.environ if environ is None else environ
    try:
        cfg = _load(args, env)
    except ConfigError as exc:
        print(f"memory-sidecar: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    from sidecar.ops import daemon

    daemon.setup_logging(cfg.server.log_level)
    try:
        if args.command == "serve":
            return daemon.serve(cfg)
        if args.command == "import-cagent":
            return _import_cagent(args, cfg)
        if args.command in _OFFLINE and not (args.command == "export" and args.address):
            return _offline(args, cfg)
        if args.command == "mcp":
            return _mcp(args, cfg)
        if args.command == "mcp-config":
            return _mcp_config(args, cfg)
        from sidecar.ops import admin

        if args.command == "health":
            return admin.health(args, cfg, sys.stdout)
        return admin.Online(args, cfg, sys.stdout).run()
    except SidecarError as exc:
        # One line, with the stable reason an operator (or a log alert) can
        # match on: DATABASE_UNAVAILABLE, DATABASE_CORRUPT, BIND_FAILED, ...
        print(f"memory-sidecar: {exc.reason}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR

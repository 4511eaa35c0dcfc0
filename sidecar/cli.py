"""The `memory-sidecar` command: parse, load config, set up logging, run."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from sidecar import __version__, cagent, config, daemon
from sidecar.errors import ConfigError, SidecarError
from sidecar.memory import Scope, Tier

EXIT_ERROR = 1
EXIT_USAGE = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memory-sidecar",
        description="A gRPC daemon that owns an AI agent's long-term memory.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--config",
        metavar="FILE",
        help="YAML configuration file (or $MEMORY_SIDECAR_CONFIG)",
    )
    common.add_argument("--db", metavar="PATH", help="SQLite database file")

    serve = commands.add_parser("serve", parents=[common], help="run the daemon")
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
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"))

    imp = commands.add_parser(
        "import-cagent",
        parents=[common],
        help="adopt a cagent memory.db into an agent's notes tier",
    )
    imp.add_argument("path", metavar="PATH", help="the cagent memory.db")
    imp.add_argument("--agent-id", required=True, help="the agent whose notes receive them")
    return parser


_SERVER_FLAGS = (
    "db",
    "listen",
    "health_listen",
    "metrics_listen",
    "grace_seconds",
    "durability",
    "log_level",
)


def _load(args: argparse.Namespace, environ: Mapping[str, str]) -> config.Config:
    path = args.config or environ.get("MEMORY_SIDECAR_CONFIG")
    flags = {key: getattr(args, key, None) for key in _SERVER_FLAGS}
    return config.load(path, environ=environ, flags=flags)


def _import_cagent(args: argparse.Namespace, cfg: config.Config) -> int:
    entries, warnings = cagent.read_entries(args.path)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    settings = cfg.for_agent(args.agent_id)
    store = daemon.open_store(cfg)
    try:
        store.open()
        scope = Scope(agent_id=args.agent_id)
        report = store.import_entries(scope, Tier.MEMORY, entries, settings.policy(Tier.MEMORY))
        usage = store.usage(scope, [Tier.MEMORY])[Tier.MEMORY]
    finally:
        store.close()
    limit = settings.memory_char_limit
    print(
        f"imported {len(report.imported)} of {len(entries)} entries into the agent notes of "
        f"{args.agent_id!r} ({usage.used_chars:,}/{limit:,} chars)"
        if limit
        else f"imported {len(report.imported)} of {len(entries)} entries into the agent notes of "
        f"{args.agent_id!r} ({usage.used_chars:,} chars, unlimited)"
    )
    if report.skipped:
        print(f"not imported ({len(report.skipped)}):")
        for entry, why in report.skipped:
            preview = entry.content if len(entry.content) <= 60 else entry.content[:57] + "..."
            print(f"  {entry.id}: {why}: {preview!r}")
    return 0


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = _parser().parse_args(argv)
    env: Mapping[str, Any] = os.environ if environ is None else environ
    try:
        cfg = _load(args, env)
    except ConfigError as exc:
        print(f"memory-sidecar: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    daemon.setup_logging(cfg.server.log_level)
    try:
        if args.command == "serve":
            return daemon.serve(cfg)
        return _import_cagent(args, cfg)
    except SidecarError as exc:
        print(f"memory-sidecar: {exc.message}", file=sys.stderr)
        return EXIT_ERROR

"""``python -m django_mongolock.testing serve``: a single-node replica set for development,
in the foreground until Ctrl+C or SIGTERM. Needs no pytest.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from django_mongolock.testing.nodes import ReplicaSetError, tail
from django_mongolock.testing.replica_set import MongoReplicaSet

__all__ = ["main"]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _serve(port: int, dbpath: str | None, replset: str) -> int:
    replica_set = MongoReplicaSet(
        1, name=replset, ports=[port], dbpaths=[dbpath] if dbpath else None
    )
    # Explicit handlers: a shell starts background jobs with SIGINT ignored.
    previous_int = signal.signal(signal.SIGINT, _interrupt)
    previous_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        replica_set.start()
        node = replica_set.nodes[0]
        assert node.process is not None
        print(f"MONGOLOCK_URL={replica_set.url}", flush=True)
        print(
            f"mongod {node.address} (pid {node.process.pid}) serves {node.dbpath}, "
            f"log {node.log_path}; Ctrl+C stops it",
            file=sys.stderr,
            flush=True,
        )
        code = node.process.wait()
        print(f"mongod exited with code {code}\n{tail(node.log_path)}", file=sys.stderr)
        return 0 if code == 0 else 1
    except KeyboardInterrupt:
        return 0
    except ReplicaSetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        # A second Ctrl+C must not cut the clean shutdown short; stop() is bounded.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            replica_set.stop()
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous_term)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m django_mongolock.testing serve``: a single-node replica set until Ctrl+C."""
    parser = argparse.ArgumentParser(
        prog="python -m django_mongolock.testing",
        description="Run a local MongoDB replica set for django-mongolock.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    serve = commands.add_parser(
        "serve",
        help="run a single-node replica set in the foreground",
        description="Run a single-node replica set in the foreground; print its URL as "
        "MONGOLOCK_URL=...; stop cleanly on SIGINT or SIGTERM.",
    )
    serve.add_argument("--port", type=int, default=27017, help="port on 127.0.0.1 (27017)")
    serve.add_argument(
        "--dbpath", help="data directory to keep and re-use (default: a temporary one)"
    )
    serve.add_argument("--replset", default="rs0", help="replica set name (rs0)")
    args = parser.parse_args(argv)
    return _serve(args.port, args.dbpath, args.replset)

"""``trident sandbox run|serve``: run one command in a sandbox, or serve sandboxes over HTTP.

``register(subparsers)`` adds the ``sandbox`` command to trident's argparse tree; each leaf sets
``func=handler(args) -> int``. ``python -m trident.cli.sandbox`` runs the same commands alone.

``sandbox run`` prints exactly one JSON object (status, exit_code, stdout, stderr, duration_s,
truncated) and exits 0 unless the sandbox itself failed (status ``error``: exit 1).
"""

from __future__ import annotations

import argparse
import json
import sys


def _run(args: argparse.Namespace) -> int:
    from trident.sandbox.bwrap import BwrapSandbox

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(
            "trident sandbox run: no command given (use: sandbox run [options] -- CMD ...)",
            file=sys.stderr,
        )
        return 2
    stdin = b""
    if args.stdin == "-":
        stdin = sys.stdin.buffer.read()
    elif args.stdin is not None:
        with open(args.stdin, "rb") as f:
            stdin = f.read()
    sandbox = BwrapSandbox()
    try:
        result = sandbox.run(cmd, stdin=stdin, timeout_s=args.timeout, memory_mb=args.memory)
    finally:
        sandbox.close()
    print(json.dumps(result.to_dict()))
    return 1 if result.status == "error" else 0


def _serve(args: argparse.Namespace) -> int:
    from trident.sandbox.service import serve

    serve(
        args.host,
        args.port,
        max_concurrency=args.max_concurrency,
        warm_sessions=args.warm_sessions,
        max_sessions=args.max_sessions,
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sandbox run`` and ``sandbox serve`` to trident's command tree."""
    sandbox = subparsers.add_parser("sandbox", help="run untrusted code in a bubblewrap sandbox")
    commands = sandbox.add_subparsers(dest="sandbox_command", metavar="{run,serve}", required=True)

    run = commands.add_parser(
        "run", help="run one command in a fresh sandbox, print one JSON result"
    )
    run.add_argument("--timeout", type=float, default=10.0, help="wall-clock limit in seconds")
    run.add_argument("--memory", type=int, default=1024, help="address-space limit in MiB")
    run.add_argument("--stdin", default=None, help="file to feed as stdin ('-' = this stdin)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=_run)

    serve = commands.add_parser("serve", help="serve run/session over HTTP")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.add_argument("--max-concurrency", type=int, default=None, help="default: CPU count")
    serve.add_argument("--warm-sessions", type=int, default=2, help="session sandboxes kept ready")
    serve.add_argument("--max-sessions", type=int, default=64)
    serve.set_defaults(func=_serve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trident")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())

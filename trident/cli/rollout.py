"""``trident rollout serve|join|leave``: a vLLM server that runs attach to, and servers joining
and leaving a running job (``trident.rollout.membership``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from trident.cli.args import job_parser, resolve
from trident.config import ConfigError, load_config


def cmd_rollout_serve(args: argparse.Namespace) -> int:
    """One vLLM server with trident's weight transfer, until Ctrl-C or SIGTERM; runs attach to
    it with ``rollout.server_urls``, or it joins the running job ``--join RUN_DIR`` (and leaves
    it on SIGTERM once its requests in flight are done: ``trident.rollout.membership``)."""
    run_dir = Path(args.join) if args.join else None
    if run_dir is not None:  # the run's own settings: model, dtype, LoRA, weight transfer
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--join {run_dir}: not a run directory (no config.yaml)")
        cfg = load_config([run_dir / "config.yaml"], args.overrides)
    else:
        cfg = resolve(args)
        if cfg is None:
            return 0
    from trident.rollout import membership
    from trident.rollout.fleet import server_options
    from trident.rollout.vllm_server import VLLMServer
    from trident.weights.backend import SERVER_BACKENDS, served_model, weight_backend

    backend = weight_backend(cfg.sync, lora=cfg.model.lora)
    logs = Path(run_dir or cfg.derived.run_dir) / "logs"
    log = logs / (f"vllm_server_joined_{os.getpid()}.log" if run_dir else "vllm_server.log")
    server = VLLMServer(
        cfg.model.path, log, port=0 if run_dir else cfg.rollout.base_port, host=args.host,
        **server_options(cfg, SERVER_BACKENDS[backend], served_model(backend)),
    )  # fmt: skip
    print(f"starting a rollout server for {cfg.model.path} (log: {log})", file=sys.stderr)
    url = server.start(cfg.rollout.startup_timeout_s)
    try:
        if run_dir is None:
            print(f"serving at {url}: attach with 'rollout.server_urls=[{url}]'", flush=True)
        else:
            joined = membership.join(run_dir, url, cfg.rollout.startup_timeout_s)
            print(f"serving at {url}: {joined}", flush=True)
        assert server.proc is not None  # started
        try:
            code = server.proc.wait()  # Ctrl-C / SIGTERM raise out of the wait
        except KeyboardInterrupt:
            if run_dir is not None:  # leave: the run stops sending and lets its requests finish
                print(f"leaving {run_dir}", file=sys.stderr, flush=True)
                membership.wait_answer(membership.ask(run_dir, "leave", url), ANSWER_TIMEOUT_S)
                print(f"left {run_dir}", file=sys.stderr, flush=True)
            raise
        print(f"the rollout server exited with code {code} (log: {log})", file=sys.stderr)
        return 2
    finally:
        server.stop()


# How long join and leave wait for the run's answer: a join is one weight push, and a leaver's
# requests in flight finish within rollout requests' own bounds.
ANSWER_TIMEOUT_S = 600


def cmd_rollout_join(args: argparse.Namespace) -> int:
    """Ask the running job in ``args.run_dir`` to bring the server at ``args.url`` (a
    ``trident rollout serve``) to its weights and route to it."""
    from trident.rollout import membership

    print(membership.join(args.run_dir, args.url, ANSWER_TIMEOUT_S), flush=True)
    return 0


def cmd_rollout_leave(args: argparse.Namespace) -> int:
    """Ask the running job in ``args.run_dir`` to stop routing to ``args.url`` and wait until
    its requests in flight are done; the server can then be stopped."""
    from trident.rollout import membership

    request = membership.ask(args.run_dir, "leave", args.url)
    _, answer = membership.wait_answer(request, ANSWER_TIMEOUT_S)
    print(f"{args.url} left {args.run_dir} after {answer['seconds']:.1f} s", flush=True)
    return 0


def register(sub) -> None:
    """``trident rollout serve|join|leave``."""
    rollout = sub.add_parser(
        "rollout", help="rollout servers", description="Rollout servers runs can attach to."
    )
    rollout_sub = rollout.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    p = job_parser(
        rollout_sub,
        "serve",
        "start one vLLM server that runs attach to (rollout.server_urls)",
        "Start a vLLM server for model.path with trident's weight transfer (the options of the "
        "servers trident train starts: rollout.*, sync.backend) on rollout.base_port, and keep it "
        "up until Ctrl-C or SIGTERM. A run with rollout.server_urls=[URL] syncs and verifies it "
        "like its own and leaves it running.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--join",
        metavar="RUN_DIR",
        help="join the job running in RUN_DIR (its model and settings; the overrides apply on top): "
        "the run brings this server to its weights, verified, then routes to it; SIGTERM leaves "
        "the job once the server's requests in flight are done, then stops the server",
    )
    p.set_defaults(func=cmd_rollout_serve)
    p = rollout_sub.add_parser(
        "join",
        help="add a running server to a running job",
        description="Ask the job running in RUN_DIR to bring the server at URL (a `trident "
        "rollout serve` of the job's model) to the job's weights, verified, and route to it.",
    )
    p.add_argument("url", help="the server's url")
    p.add_argument("run_dir", help="the job's run directory")
    p.set_defaults(func=cmd_rollout_join)
    p = rollout_sub.add_parser(
        "leave",
        help="take a server out of a running job",
        description="Ask the job running in RUN_DIR to send URL nothing new and wait until its "
        "requests in flight are done (any server of the job: started, attached or joined). "
        "The server itself is left running.",
    )
    p.add_argument("url", help="the server's url")
    p.add_argument("run_dir", help="the job's run directory")
    p.set_defaults(func=cmd_rollout_leave)

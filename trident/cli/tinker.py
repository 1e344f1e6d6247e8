"""``trident tinker serve``: the Tinker API training service (``trident.tinker.serve``)."""

from __future__ import annotations

import argparse

from trident.cli.args import job_parser, resolve


def cmd_tinker_serve(args: argparse.Namespace) -> int:
    """The Tinker API training service until Ctrl-C or SIGTERM."""
    cfg = resolve(args, needs_model=False)  # the served checkpoint is tinker.models'
    if cfg is None:
        return 0
    from trident.tinker.serve import serve

    serve(cfg)
    return 0


def register(sub) -> None:
    """``trident tinker serve``."""
    tinker = sub.add_parser(
        "tinker", help="the Tinker API training service", description="The Tinker API service."
    )
    tinker_sub = tinker.add_subparsers(dest="tinker_command", required=True, metavar="ACTION")
    p = job_parser(
        tinker_sub,
        "serve",
        "serve the Tinker API (forward_backward, optim_step, sample, ...) on tinker.port",
        "Start the trainer, the vLLM servers (or attach to rollout.server_urls) and the Tinker "
        "API on tinker.host:tinker.port, serving the checkpoint tinker.models names; a restart "
        "on the same tinker.state_dir resumes exactly.",
    )
    p.set_defaults(func=cmd_tinker_serve)

"""``trident env``: list the registered environments, write an environment's data.

``trident env data NAME OUT.jsonl`` writes rows that serve both stages: the prompt fields the
environment reads (for RL) and a ``messages`` demonstration (for ``trident sft
data.train_path=OUT.jsonl data.task=``).
"""

from __future__ import annotations

import argparse


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from trident.envs import REGISTRY

    table = Table("name", "entry point", "data", "description")
    for spec in sorted(REGISTRY.values(), key=lambda s: s.name):
        entry = spec.entry_point if isinstance(spec.entry_point, str) else repr(spec.entry_point)
        table.add_row(spec.name, entry, "yes" if spec.data else "-", spec.description)
    Console().print(table)
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    import json

    from trident.data.loaders import write_jsonl
    from trident.envs import env_rows

    options, tools = {}, not args.no_tools
    if args.config:  # the recipe's env.data_kwargs and env.show_tools
        from trident.config import load_config

        env = load_config([args.config]).env
        options, tools = dict(env.data_kwargs), tools and env.show_tools
    options |= json.loads(args.options) if args.options else {}
    rows = env_rows(args.name, args.n, args.split, args.seed, tools, **options)
    path = write_jsonl(rows, args.out)
    print(f"wrote {args.n} {args.split} rows of {args.name} to {path}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    env = subparsers.add_parser(
        "env", help="environments for agentic RL", description="Environments for agentic RL."
    )
    sub = env.add_subparsers(dest="env_command", required=True, metavar="ACTION")
    p = sub.add_parser("list", help="list registered environments")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser(
        "data",
        help="write an environment's rows (prompts + SFT demonstrations) as JSONL",
        description="Write rows with the prompt fields an environment reads and a `messages` "
        "demonstration usable by `trident sft`.",
    )
    p.add_argument("name", help="environment name (see `trident env list`)")
    p.add_argument("out", help="output JSONL path")
    p.add_argument("--n", type=int, default=2000, help="number of rows")
    p.add_argument("--split", choices=["train", "test"], default="train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--options",
        default="",
        metavar="JSON",
        help="options of the data generator (the config's env.data_kwargs), e.g. '{\"parallel_fraction\": 1.0}'",
    )
    p.add_argument(
        "-c",
        "--config",
        default="",
        metavar="FILE",
        help="a recipe whose env.data_kwargs (under --options) and env.show_tools to use",
    )
    p.add_argument(
        "--no-tools",
        action="store_true",
        help="leave the tool schemas out of the rows (for a model trained with env.show_tools=false)",
    )
    p.set_defaults(func=cmd_data)

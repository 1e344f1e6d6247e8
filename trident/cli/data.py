"""``trident data``: the tasks ``data.task`` accepts, and a look at their rows.

``trident data list`` prints the built-in tasks and every reasoning-gym dataset
(``reasoning_gym:NAME``); ``trident data show TASK`` prints a few train rows of one, as JSON, so
the prompt and the answer format can be read before training on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json


def task_names() -> list[str]:
    """Every name ``data.task`` accepts: the built-in tasks, then ``reasoning_gym:NAME`` for each
    reasoning-gym dataset (when reasoning-gym is installed)."""
    from trident.data.tasks import GYM_PREFIX, TASKS

    names = sorted(TASKS)
    with contextlib.suppress(ImportError):  # reasoning-gym is an extra (``trident[gym]``)
        from trident.data.gym import dataset_names

        names += [GYM_PREFIX + n for n in dataset_names()]
    return names


def cmd_list(args: argparse.Namespace) -> int:
    from trident.data.tasks import GYM_PREFIX

    for name in task_names():
        source = "reasoning-gym" if name.startswith(GYM_PREFIX) else "built-in"
        print(f"{name}\t{source}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from trident.config.schema import DataConfig
    from trident.data.loaders import load_split

    options = json.loads(args.options) if args.options else {}
    cfg = DataConfig(task=args.task, task_kwargs=options, num_train=args.n)
    for row in load_split(cfg, "train", args.seed):
        print(json.dumps(row, default=str))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser(
        "data", help="tasks and datasets for data.task", description="Tasks for data.task."
    )
    sub = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = sub.add_parser("list", help="list the names data.task accepts")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("show", help="print a few train rows of a task as JSON lines")
    p.add_argument("task", help="a name from `trident data list`")
    p.add_argument("--n", type=int, default=3, help="number of rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--options",
        default="",
        metavar="JSON",
        help='the task\'s config (data.task_kwargs), e.g. \'{"min_terms": 2, "max_terms": 3}\'',
    )
    p.set_defaults(func=cmd_show)

"""What every ``trident`` job command shares: its arguments (``--config FILE``, dotted
overrides, ``--dry-run``) and how they become the run's config (``resolve``: loaded, printed,
saved to the run directory)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from trident.config import TridentConfig, dump_config, load_config, save_config

EPILOG = (
    "Overrides are dotted KEY=VALUE pairs, e.g. `model.path=ckpt rollout.n=8`; see docs/config.md."
)


def job_parser(sub, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
    """A job command: ``overrides``, ``--config`` and ``--dry-run``."""
    p = sub.add_parser(name, help=help_text, description=description, epilog=EPILOG)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    p.add_argument(
        "-c",
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="YAML config file (repeatable)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and exit without starting anything",
    )
    return p


def resolve(
    args: argparse.Namespace,
    needs_model: bool = True,
    prepare: Callable[[TridentConfig], object] | None = None,
) -> TridentConfig | None:
    """Load the config, print it (all of it on --dry-run, else what differs from the defaults) and
    save it to the run directory, after ``prepare`` (``trident train``'s refusal, start over or
    resume of a directory that holds a run: before the config overwrites the one there); None
    after a dry run."""
    import yaml
    from rich.console import Console
    from rich.syntax import Syntax

    cfg = load_config(args.config, args.overrides)
    console = Console(stderr=True)
    if args.dry_run:
        console.print(
            Syntax(dump_config(cfg), "yaml", theme="ansi_dark", background_color="default")
        )
        return None
    if needs_model:
        from trident.models.load import check_model_path

        check_model_path(cfg.model.path)
    if prepare is not None:
        prepare(cfg)
    path = save_config(cfg, cfg.derived.run_dir)
    changed = diff(cfg.model_dump(mode="json"), TridentConfig().model_dump(mode="json"))
    console.print(f"[bold]config[/] (non-default values; resolved config: {path})")
    console.print(
        Syntax(
            yaml.safe_dump(changed, sort_keys=False).rstrip(),
            "yaml",
            theme="ansi_dark",
            background_color="default",
        )
    )
    return cfg


def diff(values: dict, defaults: dict) -> dict:
    """The entries of ``values`` that differ from ``defaults`` (nested)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            sub = diff(value, defaults[key])
            if sub:
                out[key] = sub
        elif value != defaults.get(key):
            out[key] = value
    return out

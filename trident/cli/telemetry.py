"""``trident report RUN_DIR`` (the run as an HTML page of plots) and ``trident inspect RUN_DIR``
(one sample's story, a step's samples, the worst samples by reward or mismatch)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    from trident.telemetry.report import write_report

    report = write_report(args.run_dir, args.out)
    print(f"report: {report.html} ({len(report.images)} plots)")
    for name, note in report.skipped.items():
        print(f"  skipped {name}: {note}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from trident.telemetry.lineage import read_samples, story
    from trident.telemetry.metrics import read_metrics

    run_dir = Path(args.run_dir)
    if not (run_dir / "samples").is_dir():
        raise FileNotFoundError(
            f"{run_dir / 'samples'}: no sample lineage in this run (telemetry.samples=none?)"
        )
    rows = read_samples(run_dir, args.step)
    metrics = (
        {m["step"]: m for m in read_metrics(run_dir)}
        if (run_dir / "metrics.jsonl").is_file()
        else {}
    )
    if args.sample:
        found = [r for r in rows if r["sample_id"] == args.sample]
        if not found:
            raise FileNotFoundError(f"no sample {args.sample!r} in {run_dir / 'samples'}")
        print("\n\n".join(story(r, metrics.get(r["step"])) for r in found))
        return 0
    if args.worst:
        if args.by == "reward":
            rows = sorted((r for r in rows if r["reward"] is not None), key=lambda r: r["reward"])
        else:
            rows = sorted(
                (r for r in rows if r["mismatch"] is not None), key=lambda r: -r["mismatch"]
            )
        rows = rows[: args.worst]
        title = f"{len(rows)} worst samples by {args.by}"
    else:
        if args.step is None:
            print("error: give --sample ID, --step N or --worst K", file=sys.stderr)
            return 2
        title = f"step {args.step}: {len(rows)} samples"
        if args.step in metrics:
            title += " · " + _figures(metrics[args.step])
    _table(rows, title)
    return 0


def _figures(m: dict) -> str:
    from trident.telemetry.lineage import STEP_FIGURES

    return ", ".join(f"{k} {m[k]:.4g}" for k in STEP_FIGURES if isinstance(m.get(k), int | float))


def _table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        "step", "sample", "reward", "trained", "advantage", "|Δlogp|", "response", title=title
    )
    for r in rows:
        table.add_row(
            str(r["step"]),
            r["sample_id"],
            "-" if r["reward"] is None else f"{r['reward']:.3g}",
            f"→ v{r['version']}" if r["trained"] else f"no: {r['reason']}",
            "-" if r["advantage"] is None else f"{r['advantage']:+.3g}",
            "-" if r["mismatch"] is None else f"{r['mismatch']:.2g}",
            r["response"][:60].replace("\n", " "),
        )
    Console(width=160).print(table)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="an HTML page of plots of a run directory",
        description="Draw a run's metrics, evals, timeline and sync costs into RUN_DIR/report/ "
        "(index.html with the images embedded, and one PNG per plot). Works on a run that is "
        "still going or crashed; plots without data are skipped with a note.",
    )
    p.add_argument("run_dir", help="a run directory (runs/<name>)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    p.set_defaults(func=cmd_report)

    p = subparsers.add_parser(
        "inspect",
        help="a sample's story, from prompt to the weights it changed",
        description="Read RUN_DIR/samples/*.parquet (telemetry.samples) and print one sample's "
        "lineage (--sample), a step's samples (--step) or the worst samples (--worst).",
    )
    p.add_argument("run_dir", help="a run directory (runs/<name>)")
    p.add_argument("--sample", metavar="ID", help="a sample id: print its whole story")
    p.add_argument("--step", type=int, metavar="N", help="only step N's samples")
    p.add_argument("--worst", type=int, metavar="K", help="the K worst samples")
    p.add_argument(
        "--by",
        choices=["reward", "mismatch"],
        default="reward",
        help="--worst by lowest reward or highest engine-vs-trainer |Δlogp|",
    )
    p.set_defaults(func=cmd_inspect)

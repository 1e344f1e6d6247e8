"""``trident report RUN_DIR``: a run directory as one self-contained HTML page of plots.

The report reads what a run writes — ``metrics.jsonl``, ``eval_before.json`` /
``eval_after.json``, ``trace.json``, ``pipeline.json``, ``config.yaml`` — and draws one figure per
entry of ``PLOTS``, each answering one question about the run (its caption). Figures are saved as
``RUN_DIR/report/<name>.png`` and embedded as base64 PNG in ``RUN_DIR/report/index.html``, so
the page is one file to attach to an issue or open from a cluster's shared disk.

Runs differ in what they have: keys differ by mode (staleness and idle fractions exist only in
the async modes), a run that is still going has a partial last line in ``metrics.jsonl`` (left
out) and no ``eval_after.json``, a crashed one may have no trace. A plot whose data is absent is
skipped with a note saying what was missing; the report itself fails only without
``metrics.jsonl``. Where a key has a renamed twin (``generated/reward_mean`` beside
``reward_mean``) both are drawn.

Simplifications: static images from matplotlib's Agg backend (for zooming into the timeline,
open ``trace.json`` in ui.perfetto.dev); the timeline draws the latest ``MAX_SPANS`` spans.
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trident.telemetry.metrics import read_metrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_SPANS = 20_000


@dataclass
class RunData:
    """Everything a run directory holds that the report reads; absent files are None."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    partial_last_line: bool = False
    eval_before: dict | None = None
    eval_after: dict | None = None
    trace_events: list[dict] | None = None
    pipeline: dict | None = None
    config: dict | None = None

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """Steps and finite numeric values of ``key``, over the steps that have it."""
        steps, values = [], []
        for m in self.metrics:
            v = m.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                steps.append(m["step"])
                values.append(float(v))
        return steps, values

    def keys(self, match: Callable[[str], bool]) -> list[str]:
        """Keys with a numeric value at some step that satisfy ``match``, sorted."""
        return sorted(
            {
                k
                for m in self.metrics
                for k, v in m.items()
                if isinstance(v, int | float) and match(k)
            }
        )

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run_dir} a run directory?)")
    text = path.read_text()
    run = RunData(run_dir, read_metrics(run_dir))
    run.partial_last_line = bool(text) and not text.endswith("\n")
    run.eval_before = _json(run_dir / "eval_before.json")
    run.eval_after = _json(run_dir / "eval_after.json")
    trace = _json(run_dir / "trace.json")
    run.trace_events = trace.get("traceEvents") if isinstance(trace, dict) else None
    run.pipeline = _json(run_dir / "pipeline.json")
    if (run_dir / "config.yaml").is_file():
        import yaml

        run.config = yaml.safe_load((run_dir / "config.yaml").read_text())
    return run


def _json(path: Path) -> Any:
    """The JSON in ``path``; None if it is missing or unreadable (a file cut short by a crash)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# -- plots -------------------------------------------------------------------------------------
# Each draws on an empty Figure and returns None, or returns the note saying why it cannot.


def plot_reward(run: RunData, fig: Figure) -> str | None:
    keys = [
        k
        for k in ("reward_mean", "generated/reward_mean", "accuracy", "generated/accuracy")
        if run.has(k)
    ]
    if not keys:
        return "no reward_mean or accuracy in metrics.jsonl"
    ax = fig.subplots()
    for key in keys:
        steps, values = run.series(key)
        (line,) = ax.plot(steps, values, marker=".", label=key)
        std_key = key.replace("reward_mean", "reward_std")
        if std_key != key and run.has(std_key):
            std = dict(zip(*run.series(std_key), strict=True))
            lo = [v - std.get(s, 0.0) for s, v in zip(steps, values, strict=True)]
            hi = [v + std.get(s, 0.0) for s, v in zip(steps, values, strict=True)]
            ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15, label=f"± {std_key}")
    _finish(ax, "step", "per training step")
    return None


def plot_eval(run: RunData, fig: Figure) -> str | None:
    evals = {"before": run.eval_before, "after": run.eval_after}
    if not any(evals.values()):
        return "no eval_before.json or eval_after.json (eval.before_after=false?)"
    keys = [
        k
        for k in sorted({k for e in evals.values() if e for k in e})
        if (k == "accuracy" or k.startswith("pass@") or k == "mean_sample_accuracy")
        and any(isinstance((e or {}).get(k), int | float) for e in evals.values())
    ]
    if not keys:
        return "the eval files have no accuracy or pass@k"
    ax = fig.subplots()
    width = 0.38
    for i, (label, result) in enumerate(evals.items()):
        if not result:
            continue
        xs = [j + (i - 0.5) * width for j in range(len(keys))]
        heights = [float(result.get(k, 0.0)) for k in keys]
        bars = ax.bar(xs, heights, width, label=f"{label} RL")
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylim(0, 1.1)
    missing = [label for label, result in evals.items() if not result]
    title = "held-out prompts"
    if missing:
        title += f" (no eval_{missing[0]}.json: " + (
            "run still going or stopped early)" if missing[0] == "after" else "not evaluated)"
        )
    _finish(ax, None, title)
    return None


def plot_response_length(run: RunData, fig: Figure) -> str | None:
    keys = [k for k in ("response_len_mean", "response_len_max") if run.has(k)]
    if not keys and not run.has("truncated_fraction"):
        return "no response_len_* or truncated_fraction in metrics.jsonl"
    ax = fig.subplots()
    for key in keys:
        ax.plot(*run.series(key), marker=".", label=key)
    ax.set_ylabel("tokens")
    if run.has("truncated_fraction"):
        twin = ax.twinx()
        twin.plot(
            *run.series("truncated_fraction"), "--", color="tab:red", label="truncated_fraction"
        )
        twin.set_ylabel("truncated fraction")
        twin.set_ylim(0, 1.05)
        twin.legend(loc="upper right", fontsize=8)
    _finish(ax, "step", "model-written tokens per sample", legend_loc="upper left")
    return None


def _is_kl(key: str) -> bool:
    return (
        "kl" in key
        and not key.startswith(("mismatch", "sync/"))
        and key != "kl_coef"
        and not key.endswith("kl_coef")
    )


def plot_entropy_kl(run: RunData, fig: Figure) -> str | None:
    kl_keys = run.keys(_is_kl)
    if not run.has("entropy") and not kl_keys:
        return "no entropy or KL keys in metrics.jsonl"
    left, right = fig.subplots(1, 2)
    if run.has("entropy"):
        left.plot(*run.series("entropy"), marker=".", color="tab:purple", label="entropy")
        _finish(left, "step", "policy entropy (nats/token)")
    else:
        _empty(left, "no entropy in metrics.jsonl")
    for key in kl_keys:
        right.plot(*run.series(key), marker=".", label=key)
    if kl_keys:
        _finish(right, "step", "KL estimates")
    else:
        _empty(right, "no KL keys (algo.kl_coef = 0: no reference model)")
    return None


def _is_mismatch(key: str) -> bool:
    return (
        key.startswith("mismatch/")
        or (key.startswith("mismatch") and "abs_logp" in key)
        or key in ("sync/max_abs_dlogp", "sync/mean_abs_dlogp")
    )


def plot_mismatch(run: RunData, fig: Figure) -> str | None:
    keys = run.keys(_is_mismatch)
    if not keys:
        return "no mismatch_* or sync/*_abs_dlogp keys in metrics.jsonl"
    ax = fig.subplots()
    for key in keys:
        ax.plot(*run.series(key), marker=".", label=key)
    ax.set_yscale("symlog", linthresh=1e-9)  # exact agreement (0) is a real value here
    ax.set_ylabel("|Δ logprob|")
    _finish(ax, "step", "engine vs trainer log-probabilities")
    return None


def plot_staleness(run: RunData, fig: Figure) -> str | None:
    hist = _staleness_histogram(run)
    trend = [k for k in ("staleness/mean", "staleness/max") if run.has(k)]
    if not hist and not trend:
        return "no staleness/* keys or pipeline.json histogram (a sync-mode run is on-policy)"
    left, right = fig.subplots(1, 2)
    if hist:
        ages = sorted(hist)
        left.bar(ages, [hist[a] for a in ages], color="tab:orange")
        left.set_xticks(ages)
        _finish(left, "versions behind the trainer", "fraction of trained tokens", legend=False)
    else:
        _empty(left, "no staleness histogram")
    for key in trend:
        right.plot(*run.series(key), marker=".", label=key)
    if trend:
        _finish(right, "step", "staleness per step")
    else:
        _empty(right, "no staleness/mean per step")
    return None


def _staleness_histogram(run: RunData) -> dict[int, float]:
    """Fraction of trained tokens by age: pipeline.json's whole-run histogram, else the mean of
    the per-step ``staleness/frac_<age>``."""
    counts = (run.pipeline or {}).get("staleness_histogram")
    if isinstance(counts, dict) and counts:
        total = sum(counts.values()) or 1
        return {int(a): n / total for a, n in counts.items()}
    out: dict[int, float] = {}
    for key in run.keys(lambda k: re.fullmatch(r"staleness/frac_\d+", k) is not None):
        values = run.series(key)[1]
        out[int(key.rsplit("_", 1)[1])] = sum(values) / len(values)
    return out


def plot_idle(run: RunData, fig: Figure) -> str | None:
    keys = run.keys(lambda k: k.endswith("idle_fraction"))
    if not keys:
        return "no *_idle_fraction keys (measured in the async modes)"
    ax = fig.subplots()
    for key in keys:
        ax.plot(*run.series(key), marker=".", label=key)
    ax.set_ylim(0, 1.05)
    _finish(ax, "step", "fraction of each step's wall time spent waiting")
    return None


STEP_TIME = "time/step_s"


def plot_stage_times(run: RunData, fig: Figure) -> str | None:
    keys = run.keys(lambda k: k.startswith("time/") and k.endswith("_s") and k != STEP_TIME)
    if not keys:
        return "no time/*_s keys in metrics.jsonl"
    order = ("time/rollout_s", "time/wait_s", "time/reward_s", "time/train_s", "time/sync_s")
    keys.sort(key=lambda k: (order.index(k) if k in order else len(order), k))  # pipeline order
    ax = fig.subplots()
    steps = sorted({m["step"] for m in run.metrics})
    bottom = [0.0] * len(steps)
    for key in keys:
        by_step = dict(zip(*run.series(key), strict=True))
        heights = [by_step.get(s, 0.0) for s in steps]
        ax.bar(steps, heights, bottom=bottom, label=key.removeprefix("time/"))
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    if run.has(STEP_TIME):  # the whole step: a gap above the bars is time no stage accounts for
        ax.plot(*run.series(STEP_TIME), "k_", markersize=30, mew=2, label="whole step")
    ax.set_ylabel("seconds")
    _finish(ax, "step", "wall time per step, by stage", legend_loc="outside")
    return None


def plot_timeline(run: RunData, fig: Figure) -> str | None:
    events = run.trace_events
    if not events:
        return "no trace.json (the run crashed before writing it, or wrote none)"
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        return "trace.json has no spans"
    note = ""
    if len(spans) > MAX_SPANS:
        note = f" (latest {MAX_SPANS} of {len(spans)} spans)"
        spans = sorted(spans, key=lambda e: e["ts"] + e["dur"])[-MAX_SPANS:]
    # One band per process; its lanes (concurrent spans, e.g. requests on one server) split
    # the band, so a server with a hundred requests in flight stays one labelled row.
    process = {id(e): names.get(e["pid"], str(e["pid"])) for e in spans}
    processes = sorted(set(process.values()))
    lanes: dict[str, int] = defaultdict(int)
    for e in spans:
        lanes[process[id(e)]] = max(lanes[process[id(e)]], e.get("tid", 0) + 1)
    bars: dict[str, dict[tuple[float, float], list]] = defaultdict(lambda: defaultdict(list))
    for e in spans:
        band, n = processes.index(process[id(e)]), lanes[process[id(e)]]
        height = 0.8 / n
        y = (band - 0.4 + e.get("tid", 0) * height, height)
        bars[e["name"]][y].append((e["ts"] / 1e6, max(e["dur"], 1.0) / 1e6))
    ax = fig.subplots()
    for colour, (name, rows) in zip(_colours(len(bars)), sorted(bars.items()), strict=True):
        for i, (y, spans_on_row) in enumerate(rows.items()):
            ax.broken_barh(spans_on_row, y, color=colour, label=name if i == 0 else None)
    labels = [f"{p} ({lanes[p]} lanes)" if lanes[p] > 1 else p for p in processes]
    ax.set_yticks(range(len(processes)), labels, fontsize=7)
    ax.invert_yaxis()
    _finish(ax, "seconds since the trace began", "spans per process" + note, legend_loc="outside")
    return None


def plot_sync(run: RunData, fig: Figure) -> str | None:
    phases = run.keys(lambda k: k.startswith("sync/") and k.endswith("_s") and k != "sync/total_s")
    has_bytes = run.has("sync/bytes")
    if not phases and not has_bytes and not run.has("sync/total_s"):
        return "no sync/* keys in metrics.jsonl"
    left, right = fig.subplots(1, 2)
    if phases:
        steps = sorted({m["step"] for m in run.metrics})
        bottom = [0.0] * len(steps)
        for key in phases:
            by_step = dict(zip(*run.series(key), strict=True))
            heights = [by_step.get(s, 0.0) for s in steps]
            left.bar(steps, heights, bottom=bottom, label=key.removeprefix("sync/"))
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        _finish(left, "step", "seconds per sync, by phase", legend_loc="outside")
    elif run.has("sync/total_s"):
        left.plot(*run.series("sync/total_s"), marker=".", label="total_s")
        _finish(left, "step", "seconds per sync")
    else:
        _empty(left, "no sync/*_s keys")
    if has_bytes:
        steps, values = run.series("sync/bytes")
        right.plot(steps, [v / 2**20 for v in values], marker=".", color="tab:green", label="MiB")
        right.set_ylim(bottom=0)
        _finish(right, "step", "weights pushed per sync (MiB)", legend=False)
    else:
        _empty(right, "no sync/bytes")
    return None


def plot_infra_errors(run: RunData, fig: Figure) -> str | None:
    keys = [
        k
        for k in ("infra_errors", "untrainable_samples", "failed_requests", "rollout/failed")
        if run.has(k)
    ]
    if not keys:
        return "no infra_errors in metrics.jsonl"
    ax = fig.subplots()
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        steps, values = run.series(key)
        ax.bar(
            [s + (i - (len(keys) - 1) / 2) * width for s in steps],
            values,
            width,
            label=f"{key} (total {sum(values):g})",
        )
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0, top=max(1.0, ax.get_ylim()[1]))
    ax.set_ylabel("samples")
    _finish(ax, "step", "samples the infrastructure failed, per step")
    return None


def plot_ledger(run: RunData, fig: Figure) -> str | None:
    keys = run.keys(lambda k: k.startswith("ledger/"))
    if not keys:
        return "no ledger/* keys in metrics.jsonl (this run kept no token ledger)"
    ax = fig.subplots()
    for key in keys:
        ax.plot(*run.series(key), marker=".", label=key.removeprefix("ledger/"))
    _finish(ax, "step", "token ledger")
    return None


@dataclass(frozen=True)
class Plot:
    name: str
    title: str
    question: str
    draw: Callable[[RunData, Figure], str | None]
    wide: bool = False


PLOTS: tuple[Plot, ...] = (
    Plot("reward", "Reward and accuracy", "Is the policy getting better on its training prompts?", plot_reward),
    Plot("eval", "Held-out eval, before and after", "Did training improve accuracy on prompts it never trained on?", plot_eval),
    Plot("response_length", "Response length", "Are responses growing, and how many hit the token budget?", plot_response_length),
    Plot("entropy_kl", "Entropy and KL", "Is the policy collapsing (entropy falling) or drifting from the reference (KL rising)?", plot_entropy_kl, wide=True),
    Plot("mismatch", "Engine vs trainer |Δ logprob|", "Do the rollout engine and the trainer agree on the log-probabilities of the sampled tokens?", plot_mismatch),
    Plot("staleness", "Staleness", "How far behind the trainer's weights were the tokens it trained on?", plot_staleness, wide=True),
    Plot("idle", "Idle fractions", "Which side of the pipeline waits for the other?", plot_idle),
    Plot("stage_times", "Stage times", "Where does a step's wall time go?", plot_stage_times),
    Plot("timeline", "Timeline", "What ran when, on which process, and what overlapped?", plot_timeline, wide=True),
    Plot("sync", "Weight sync", "What does pushing the new weights to the engines cost, in seconds and bytes?", plot_sync, wide=True),
    Plot("infra_errors", "Infrastructure errors", "Is the infrastructure (not the model) failing samples?", plot_infra_errors),
    Plot("ledger", "Token ledger", "Where did the generated tokens go: trained, filtered, thrown away?", plot_ledger),
)  # fmt: skip


def _finish(
    ax, xlabel: str | None, title: str, legend: bool = True, legend_loc: str = "best"
) -> None:
    """Labels, grid and legend; ``legend_loc="outside"`` puts the legend right of the axes
    (stacked bars leave no free corner)."""
    if xlabel:
        ax.set_xlabel(xlabel)
    if xlabel == "step":
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        if legend_loc == "outside":
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.legend(fontsize=8, loc=legend_loc)


def _empty(ax, note: str) -> None:
    ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, fontsize=9)
    ax.set_axis_off()


def _colours(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# -- the page ----------------------------------------------------------------------------------


@dataclass
class Report:
    html: Path
    images: dict[str, Path] = field(default_factory=dict)  # plot name -> PNG
    skipped: dict[str, str] = field(default_factory=dict)  # plot name -> why


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Draw every plot the run has data for; write the PNGs and ``index.html`` to ``out_dir``
    (default ``RUN_DIR/report``)."""
    from matplotlib.figure import Figure

    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out / "index.html")
    sections = []
    for plot in PLOTS:
        fig = Figure(figsize=(11 if plot.wide else 7, 3.8), dpi=100, layout="constrained")
        note = plot.draw(run, fig)
        if note is not None:
            report.skipped[plot.name] = note
            sections.append(_section(plot, None, note))
            continue
        path = out / f"{plot.name}.png"
        fig.savefig(path, format="png")
        report.images[plot.name] = path
        sections.append(_section(plot, path, None))
    report.html.write_text(_page(run, sections, report))
    return report


def _section(plot: Plot, png: Path | None, note: str | None) -> str:
    head = f'<h2>{html.escape(plot.title)}</h2><p class="q">{html.escape(plot.question)}</p>'
    cls = "plot wide" if plot.wide else "plot"
    if png is None:
        return f'<section id="{plot.name}" class="{cls} skipped">{head}<p class="note">skipped: {html.escape(note or "")}</p></section>'
    data = base64.b64encode(png.read_bytes()).decode()
    alt = html.escape(f"{plot.title}: {plot.question}")
    return f'<section id="{plot.name}" class="{cls}">{head}<img src="data:image/png;base64,{data}" alt="{alt}"></section>'


def run_status(run: RunData) -> str:
    """Finished, or how far it got."""
    planned = ((run.config or {}).get("pipeline") or {}).get("steps")
    done = len({m["step"] for m in run.metrics})
    if run.eval_after is not None:
        return f"finished: {done} steps, evaluated after training"
    progress = f"{done} of {planned} steps logged" if planned else f"{done} steps logged"
    if planned and done >= planned:
        return f"{progress}; no eval_after.json (not evaluated after training, or still evaluating)"
    return f"incomplete: {progress} (still running, or stopped early)"


HEADLINE_KEYS = (
    "reward_mean",
    "accuracy",
    "response_len_mean",
    "entropy",
    "mismatch_abs_logp_diff_mean",
    "staleness/mean",
    "infra_errors",
)


def _page(run: RunData, sections: list[str], report: Report) -> str:
    cfg = run.config or {}
    facts = {
        "status": run_status(run),
        "mode": (cfg.get("pipeline") or {}).get("mode"),
        "model": (cfg.get("model") or {}).get("path"),
        "prompts × samples per step": _per_step(cfg),
    }
    if run.partial_last_line:
        facts["metrics.jsonl"] = "ends in a partial line (being written): left out"
    if run.metrics:
        last = run.metrics[-1]
        facts[f"last step ({last['step']})"] = ", ".join(
            f"{k} {_fmt(last[k])}" for k in HEADLINE_KEYS if isinstance(last.get(k), int | float)
        )
    rows = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in facts.items()
        if v not in (None, "")
    )
    drawn = f"{len(report.images)} plots drawn, {len(report.skipped)} skipped (no data)"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>trident report: {html.escape(run.run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; background: #fafafa; }}
h1 {{ margin: 0 0 .5rem; }} h2 {{ margin: .2rem 0; font-size: 1.05rem; }}
table {{ border-collapse: collapse; margin-bottom: 1rem; }}
th, td {{ text-align: left; padding: .15rem .8rem .15rem 0; vertical-align: top; }}
main {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 1rem; }}
.plot {{ background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: .6rem; }}
.wide {{ grid-column: 1 / -1; }}
.plot img {{ display: block; max-width: 100%; margin: auto; }}
.q {{ margin: 0 0 .4rem; color: #555; font-style: italic; }}
.skipped {{ color: #777; }} .note {{ margin: 0; }}
</style></head><body>
<h1>{html.escape(run.run_dir.name)}</h1>
<p>{html.escape(str(run.run_dir))} · {drawn}</p>
<table>{rows}</table>
<main>
{chr(10).join(sections)}
</main>
</body></html>
"""


def _per_step(cfg: dict) -> str | None:
    prompts = (cfg.get("pipeline") or {}).get("prompts_per_step")
    n = (cfg.get("rollout") or {}).get("n")
    return f"{prompts} × {n}" if prompts and n else None


def _fmt(value: float) -> str:
    return f"{value:.4g}"

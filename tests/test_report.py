"""``trident report``, looked at the way a person does: a real short run's report opened in
headless Chromium (Debian's ``chromium``, driven by playwright: nothing downloaded), every image
decoded and not blank; and reports of run directories a person meets mid-way: a run still
writing its last line, a crashed run (no eval_after, no trace), an async run with a timeline."""

import html
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import SHORT_RUN_STEPS, run_cli
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from trident.telemetry.lineage import read_samples
from trident.telemetry.metrics import read_metrics
from trident.telemetry.report import PLOTS, load_run, write_report
from trident.telemetry.trace import Trace

CHROMIUM = "/usr/bin/chromium"

# A sync run has data for every plot, so none may be skipped: since the controller redesign
# (3c5d66b) it logs staleness/* (all 0: on-policy), the idle fractions and the token ledger like
# the async modes, and it writes trace.json.


def _points(fig: Figure) -> int:
    """Finite data points the figure shows: line vertices, bar heights, and the vertices of
    collections (bands, timeline spans); text, grid lines and ticks are no data."""
    n = 0
    for ax in fig.axes:
        for line in ax.lines:
            xy = np.asarray(line.get_xydata(), dtype=float)
            n += int(np.isfinite(xy).all(axis=1).sum()) if xy.size else 0
        n += sum(math.isfinite(p.get_height()) for p in ax.patches if isinstance(p, Rectangle))
        for c in ax.collections:
            for path in c.get_paths():
                n += int(np.isfinite(path.vertices).all(axis=1).sum())
    return n


def test_report_of_a_real_run(short_run, tmp_path):
    """Every plot is drawn for a real sync run, none skipped, and each shows data: the figure
    ``PLOTS`` builds holds finite points, and the lines named after a metric plot that metric's
    values from metrics.jsonl, step for step."""
    r = run_cli("report", str(short_run), "--out", str(tmp_path / "report"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "index.html" in r.stdout and "skipped" not in r.stdout, r.stdout
    drawn = {p.stem for p in (tmp_path / "report").glob("*.png")}
    assert drawn == {p.name for p in PLOTS}
    page = (tmp_path / "report" / "index.html").read_text()
    assert f"finished: {SHORT_RUN_STEPS} steps" in page
    for plot in PLOTS:
        assert f'id="{plot.name}"' in page and html.escape(plot.question) in page

    run = load_run(short_run)
    assert [m["step"] for m in run.metrics] == list(range(SHORT_RUN_STEPS))
    compared = set()
    for plot in PLOTS:
        fig = Figure()
        assert plot.draw(run, fig) is None, plot.name
        assert _points(fig) >= 1, f"{plot.name} shows no data"
        prefix = "ledger/" if plot.name == "ledger" else ""  # its labels drop the prefix
        for ax in fig.axes:
            for line in ax.lines:
                key = prefix + str(line.get_label())
                if key in run.metrics[0]:
                    assert list(line.get_xdata()) == run.series(key)[0], (plot.name, key)
                    assert list(line.get_ydata()) == run.series(key)[1], (plot.name, key)
                    compared.add(key)
    assert {"reward_mean", "entropy", "mismatch_abs_logp_diff_mean", "staleness/mean"} <= compared


def test_report_renders_in_chromium(short_run, tmp_path):
    """Every image decodes in the browser with a real size, and none is blank."""
    # scripts/setup installs both (the dev extra and Debian's chromium): a missing one is a
    # broken set-up, not a reason to skip the one test that looks at the page
    from playwright import sync_api

    assert Path(CHROMIUM).exists(), "no /usr/bin/chromium: rerun scripts/setup (apt chromium)"
    from PIL import Image

    report = write_report(short_run, tmp_path / "report")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(report.html.as_uri())
        page.wait_for_load_state("load")
        images = page.evaluate(
            """Array.from(document.images).map(img => ({
                section: img.closest('section').id, width: img.naturalWidth,
                height: img.naturalHeight, shown: img.getBoundingClientRect().width}))"""
        )
        shot = page.screenshot(full_page=True)
        browser.close()
    assert sorted(i["section"] for i in images) == sorted(report.images)
    for image in images:
        assert image["width"] > 300 and image["height"] > 200 and image["shown"] > 0, image
    for name, path in report.images.items():
        colours = Image.open(path).convert("RGB").getcolors(maxcolors=1 << 20)
        assert len(colours) > 1, name
    screenshot = Image.open(io.BytesIO(shot))
    assert screenshot.height > 1000 and len(screenshot.convert("RGB").getcolors(1 << 22)) > 10


def _write_metrics(run_dir: Path, n: int, partial: bool = False, **extra: float) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "step": k,
                "reward_mean": 0.1 * k,
                "accuracy": 0.05 * k,
                "response_len_mean": 9.0 + k,
                "response_len_max": 16,
                "truncated_fraction": 0.25,
                "infra_errors": k % 2,
                "entropy": 2.0 - 0.1 * k,
                "mismatch_abs_logp_diff_mean": 1e-7,
                "time/rollout_s": 1.0,
                "time/train_s": 2.0,
                "sync/bytes": 3.6e6,
                "sync/total_s": 0.05,
                **extra,
            }
        )
        for k in range(n)
    ]
    text = "\n".join(lines) + "\n"
    if partial:
        text += f'{{"step": {n}, "reward_mean": 0.'  # the run is writing this line now
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.yaml").write_text("pipeline:\n  mode: sync\n  steps: 10\n")


def test_report_of_a_run_still_going(tmp_path):
    run = tmp_path / "going"
    _write_metrics(run, 4, partial=True)
    (run / "eval_before.json").write_text(json.dumps({"accuracy": 0.4, "pass@4": 0.7}))
    report = write_report(run)
    page = report.html.read_text()
    assert "incomplete: 4 of 10 steps logged" in page
    assert "ends in a partial line" in page
    assert {"reward", "eval", "response_length", "mismatch", "stage_times"} <= set(report.images)
    assert report.skipped["timeline"].startswith("no trace.json")
    assert "staleness" in report.skipped and "ledger" in report.skipped


def test_report_of_a_crashed_run(tmp_path):
    run = tmp_path / "crashed"
    _write_metrics(run, 2)
    (run / "trace.json").write_text('{"traceEvents": [{"ph": "X", "na')  # cut short by the crash
    report = write_report(run)
    assert "eval" in report.skipped and "timeline" in report.skipped
    assert "reward" in report.images
    page = report.html.read_text()
    assert "skipped: no eval_before.json or eval_after.json" in page
    assert "incomplete: 2 of 10 steps logged" in page

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")  # crashed before its first step
    assert write_report(empty).images == {}
    r = run_cli("report", str(tmp_path / "nothing"), timeout=120)
    assert r.returncode == 2 and "no metrics.jsonl" in r.stderr


def test_report_of_an_async_run(tmp_path):
    """Staleness, idle fractions, ledger and the timeline from a real ``Trace``."""
    run = tmp_path / "async"
    _write_metrics(
        run,
        5,
        **{
            "staleness/mean": 0.4,
            "staleness/max": 1.0,
            "staleness/frac_0": 0.6,
            "staleness/frac_1": 0.4,
            "trainer_idle_fraction": 0.3,
            "rollout_idle_fraction": 0.1,
            "ledger/generated_tokens": 1000.0,
            "ledger/trained_tokens": 900.0,
            "generated/reward_mean": 0.3,
        },
    )
    (run / "eval_after.json").write_text(json.dumps({"accuracy": 0.5}))
    clock = [0.0]
    trace = Trace(lambda: clock[0])
    for _ in range(5):
        server = "rollout http://127.0.0.1:8000"
        with trace.span("generate", server), trace.span("generate", server):
            clock[0] += 1.0  # two requests at once: two lanes
        with trace.span("train", "trainer"):
            clock[0] += 2.0
    trace.write(run / "trace.json")
    report = write_report(run)
    assert {"staleness", "idle", "ledger", "timeline", "reward", "eval"} <= set(report.images)
    assert "finished: 5 steps" in report.html.read_text()


def test_inspect_tells_the_story_of_a_real_runs_sample(short_run):
    """Every trained sample of the real run is in its lineage, and its story agrees with the
    run's own metrics: the step, the weight version it produced, the reward."""
    metrics = {m["step"]: m for m in read_metrics(short_run)}
    rows = [r for r in read_samples(short_run) if r["trained"]]
    for step, m in metrics.items():
        trained = [r for r in rows if r["trained_step"] == step]
        assert len(trained) == m["trained_samples"]
        assert {r["version"] for r in trained} == {m["version"]}
        assert sum(r["reward"] for r in trained) / len(trained) == pytest.approx(m["reward_mean"])
        assert all(r["advantage"] is not None and r["mismatch"] is not None for r in trained)
        assert all(str(r["server"]).startswith("http://") for r in trained)
    row = rows[len(rows) // 2]
    r = run_cli("inspect", str(short_run), "--sample", row["sample_id"], timeout=120)
    assert r.returncode == 0, r.stderr
    step, version = row["trained_step"], row["version"]
    assert f"sample {row['sample_id']}" in r.stdout
    assert f"trained at step {step} -> produced weights version {version}" in r.stdout
    assert f"reward: {row['reward']:.4g}" in r.stdout
    assert row["reward_parts"] and "task" in dict(row["reward_parts"])  # each function's part

"""Chaos: one long run with faults injected at random moments, and what each cost.

``trident train`` runs the demo's task (``configs/demo.yaml``) from the demo's warm-up with small
batches, ``pipeline.mode=separate_async`` (generation never stops, so a fault lands mid-request
and partial responses are resubmitted from their prefix: the hardest case) over 2 vLLM servers.
Faults of five kinds, drawn from a seeded RNG, each at a random moment:

- ``engine_kill``: ``kill -9`` of a server's vLLM engine core;
- ``api_kill``: ``kill -9`` of a server's API server;
- ``engine_freeze``: ``SIGSTOP`` of a server's engine core (``rollout.liveness_timeout_s=10``);
- ``trainer_kill``: ``kill -9`` of the trainer rank (``run.max_restarts``: the run restarts
  itself from its newest checkpoint);
- ``driver_kill``: ``kill -9`` of the ``trident train`` process; the benchmark waits for the
  run's processes to go and runs ``trident train ... --resume``.

Pacing: a fault waits until the previous one is recovered from (a server back at the served
weights, or a step completed after a restart) and one more step is complete, then for a random
0-``--jitter`` seconds. So each fault meets a whole run, and each recovery is timed alone. A step
takes ~0.6 s at this batch on 2 cores and a server's recovery ~30 s, during which the steps go
on on the other server, so 100 steps would end before the third fault: the run's
``pipeline.steps`` is ``--steps`` (default 1000, an upper bound), and ``--tail`` (10) steps after
the last recovery the benchmark stops the run (SIGTERM, a clean stop) and counts the steps
logged. A fault that stops the run is recorded as not survived, with its error, and the
benchmark resumes the run (``--resume``) as a user would, and goes on.

Recorded per fault: seconds from the fault to the next completed step (the run's own clock in
``metrics.jsonl`` lines, read every 0.2 s), and for a server fault the seconds to the server's
``rollout server i is back at weight version v after s`` line (the benchmark's clock from the
fault, and trident's own ``s``: detected to back in), plus, for a freeze, to the ``is frozen``
line. At the end: every step trained its whole batch, each trained sample id is in the lineage
once (``read_samples``: samples lost = steps x batch - distinct ids; trained twice = rows -
distinct ids), the ledger balances in samples and tokens, every sync verified.

Run: ``.venv/bin/python benchmarks/chaos.py`` (``--quick``: 150 steps, one fault of each server
kind and one trainer kill); writes ``benchmarks/results/chaos.{json,md}`` (``--quick`` writes
``chaos.{json,md}`` in its run's directory under ``runs/chaos/``, not the results).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from provenance import REPO, load_average, provenance

sys.path.insert(0, str(REPO))

from tests.conftest import cmdline, parent, tagged_env, tagged_processes, wait_gone  # noqa: E402
from trident.rollout.vllm_server import API_SERVER  # noqa: E402
from trident.telemetry.lineage import read_samples  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
DEMO = REPO / "configs" / "demo.yaml"
KINDS = ["engine_kill", "api_kill", "engine_freeze", "trainer_kill", "driver_kill"]
SERVER_KINDS = KINDS[:3]
PROMPTS, N = 8, 4  # a step's batch: 8 prompts x 4 samples
BACK = re.compile(r"rollout server (\d+) is back at weight version (\d+) after ([\d.]+) s")
FROZEN = re.compile(r"rollout server (\d+) \(\S+\) is frozen")
RESTART = re.compile(r"restarting from .+? \((\d+)/")


# ---------------------------------------------------------------------------------------------
# The run's processes (as tests/conftest.py finds them: an environment tag every process inherits)


def server_pids(run_dir: Path, tag: str, i: int) -> tuple[int, int] | None:
    """(API server, engine core) of server ``i``, None while it is not up. Its log (appended to
    by each restart) names its latest port and engine core; the API server is the process with
    that port whose parent does not carry it too (vLLM forks the engine core from it)."""
    log = run_dir / "logs" / f"vllm_server_{i}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    ports = re.findall(r"'port': (\d+),", text)
    cores = re.findall(r"^\(EngineCore pid=(\d+)\)", text, re.M)
    if not ports or not cores or not cmdline(int(cores[-1])):
        return None
    pids = [p for p in tagged_processes(tag) if f"--port {ports[-1]} " in cmdline(p) + " "]
    api = [p for p in pids if parent(p) not in pids and API_SERVER in cmdline(p)]
    return (api[0], int(cores[-1])) if len(api) == 1 else None


def trainer_ranks(tag: str) -> list[int]:
    return [p for p in tagged_processes(tag) if "ray::PolicyWorker" in cmdline(p)]


# ---------------------------------------------------------------------------------------------
# What the run writes, as it writes it


class Watch:
    """Polls the run's ``metrics.jsonl`` and output files every 0.2 s, recording when each new
    step line and each recovery line appeared (the benchmark's clock)."""

    def __init__(self, run_dir: Path, outputs: list[Path]) -> None:
        self.run_dir, self.outputs = run_dir, outputs
        self.steps: list[tuple[float, int]] = []  # (time, step) of each newly seen metrics line
        self.events: list[tuple[float, str, int, float]] = []  # (time, "back"/"frozen", i, s)
        self._seen: set[str] = set()
        self._read: dict[Path, int] = {}
        self._metrics_at = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            metrics = self.run_dir / "metrics.jsonl"
            size = metrics.stat().st_size if metrics.exists() else 0
            if size < self._metrics_at:  # cut back to a checkpoint by a resume
                self._metrics_at = 0
            with contextlib.suppress(FileNotFoundError), metrics.open() as f:
                f.seek(self._metrics_at)
                for line in f.read().splitlines(keepends=True):
                    if not line.endswith("}\n"):
                        break  # being written
                    self._metrics_at += len(line.encode())
                    if line not in self._seen:
                        self._seen.add(line)
                        self.steps.append((now, json.loads(line)["step"]))
            for out in list(self.outputs):
                text = out.read_text(errors="replace") if out.exists() else ""
                new, self._read[out] = text[self._read.get(out, 0) :], len(text)
                for m in BACK.finditer(new):
                    self.events.append((now, "back", int(m[1]), float(m[3])))
                for m in FROZEN.finditer(new):
                    self.events.append((now, "frozen", int(m[1]), 0.0))
                for m in RESTART.finditer(new):
                    self.events.append((now, "restart", 0, float(m[1])))
            time.sleep(0.2)

    def steps_since(self, t: float) -> int:
        return sum(1 for when, _ in self.steps if when > t)

    def first_step_after(self, t: float) -> float | None:
        return next((when for when, _ in self.steps if when > t), None)

    def first_event(self, kind: str, i: int, t: float) -> tuple[float, float] | None:
        return next(((w, s) for w, k, j, s in self.events if k == kind and j == i and w > t), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------------
# The run


class Chaos:
    """One ``trident train`` run (and its resumes) with faults injected into it."""

    def __init__(self, args: argparse.Namespace, model: str, root: Path) -> None:
        self.args, self.tag = args, uuid.uuid4().hex
        self.run_dir = root / "r"
        self.cmd = [
            sys.executable, "-m", "trident.cli", "train", "--config", str(DEMO),
            f"model.path={model}", f"run.dir={root}", "run.name=r", f"run.seed={args.seed}",
            f"pipeline.steps={args.steps}", f"pipeline.prompts_per_step={PROMPTS}", f"rollout.n={N}",
            "pipeline.mode=separate_async", "pipeline.max_staleness=1", "rollout.num_servers=2",
            "checkpoint.every=5", f"run.max_restarts={args.faults}",
            f"rollout.max_restarts={args.faults}", "rollout.liveness_timeout_s=10", "sync.timeout_s=15",
            "eval.before_after=false", "telemetry.progress=false", "trainer.cpu_threads=1",
        ]  # fmt: skip
        self.outputs: list[Path] = []
        self.watch = Watch(self.run_dir, self.outputs)
        self.proc: subprocess.Popen | None = None
        self.planned: list[str] = []
        self.deadline = time.monotonic() + (args.minutes or 1e9) * 60

    def start(self, resume: bool) -> None:
        out = self.run_dir.parent / f"output-{len(self.outputs)}.txt"
        self.outputs.append(out)
        env = tagged_env(self.tag)
        with out.open("w") as f:
            cmd = [*self.cmd, "--resume"] if resume else self.cmd
            self.proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_until(self, ready, what: str, timeout: float = 600) -> bool:
        """Wait for ``ready()``; False if the run ends first; raises past ``timeout``."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not self.alive():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} in {timeout:.0f} s")
            time.sleep(0.2)
        return True

    def inject(self, kind: str, rng: random.Random) -> dict[str, Any]:
        """The fault, once its target is up: what was hit and when (monotonic)."""
        fault: dict[str, Any] = {"kind": kind, "step": self.last_step()}
        if kind in SERVER_KINDS:
            i = rng.randrange(2)
            pids: list[tuple[int, int] | None] = [None]
            self.wait_until(lambda: (pids.__setitem__(0, server_pids(self.run_dir, self.tag, i)))
                            or pids[0] is not None, f"server {i} up")  # fmt: skip
            if pids[0] is None:
                return {}
            api, engine = pids[0]
            pid, sig = {
                "engine_kill": (engine, signal.SIGKILL),
                "api_kill": (api, signal.SIGKILL),
                "engine_freeze": (engine, signal.SIGSTOP),
            }[kind]
            fault["server"] = i
        elif kind == "trainer_kill":
            ranks: list[int] = []
            self.wait_until(lambda: bool(ranks.extend(trainer_ranks(self.tag)) or ranks), "rank")
            if not ranks:
                return {}
            pid, sig = ranks[0], signal.SIGKILL
        else:
            assert self.proc is not None
            pid, sig = self.proc.pid, signal.SIGKILL
        fault["pid"] = pid
        fault["t"] = time.monotonic()
        os.kill(pid, sig)
        return fault

    def last_step(self) -> int:
        return self.watch.steps[-1][1] if self.watch.steps else -1

    def restarted_at(self, fault: dict[str, Any]) -> float | None:
        """When the run was started again after ``fault``: a ``--resume`` (a driver kill, a run
        it stopped), the run's own restart (a trainer kill); the fault's time for the others."""
        if "resumed_t" in fault:
            return fault["resumed_t"]
        if fault["kind"] == "trainer_kill":
            restart = self.watch.first_event("restart", 0, fault["t"])
            return restart[0] if restart else None
        return None if fault["kind"] == "driver_kill" else fault["t"]

    def recovered(self, fault: dict[str, Any]) -> bool:
        """The fault is recovered from: a step completed after the run went on (restarted, if
        it was), and a hit server is back."""
        start = self.restarted_at(fault)
        if start is None or self.watch.first_step_after(start) is None:
            return False
        if fault["kind"] in SERVER_KINDS and "error" not in fault:
            return self.watch.first_event("back", fault["server"], fault["t"]) is not None
        return True

    def run(self, faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rng = random.Random(self.args.seed)
        plan = self.planned = self.plan(rng)
        self.start(resume=False)
        if not self.wait_until(lambda: self.watch.steps_since(0) >= 1, "first step"):
            self.stopped(faults)
        for kind in plan:
            since = faults[-1]["t"] if faults else 0.0
            while not self.wait_until(
                lambda since=since: (
                    (not faults or self.recovered(faults[-1]))
                    and self.watch.steps_since(max(since, self.recovered_at(faults))) >= 1
                ),
                "recovery",
            ):
                if not self.stopped(faults):
                    return faults  # the run finished its steps first
            if time.monotonic() > self.deadline:
                print(f"[chaos] --minutes {self.args.minutes} spent: no more faults", flush=True)
                break
            time.sleep(rng.uniform(0, self.args.jitter))
            if not self.alive():
                continue  # it stopped meanwhile: the next wait resumes it
            fault = self.inject(kind, rng)
            if not fault:
                continue
            faults.append(fault)
            print(f"[chaos] {len(faults)}/{len(plan)} {kind} at step {fault['step']}", flush=True)
            if kind == "driver_kill":
                assert self.proc is not None
                self.proc.wait()
                fault["left_after_kill"] = sorted(wait_gone(self.tag, timeout=180))
                fault["resumed_t"] = time.monotonic()
                self.start(resume=True)
        # --tail more steps after the last recovery, then a clean stop (SIGTERM), unless the
        # run finished its steps first
        while True:
            assert self.proc is not None
            if self.wait_until(
                lambda: (
                    (not faults or self.recovered(faults[-1]))
                    and self.watch.steps_since(self.recovered_at(faults)) >= self.args.tail
                ),
                "last steps",
            ):
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait()
                break
            if not self.stopped(faults):
                break
        time.sleep(0.5)  # the watch's last poll
        return faults

    def stopped(self, faults: list[dict[str, Any]]) -> bool:
        """The run ended. Finished (exit 0): False. Stopped by an error: the last fault was not
        survived (its error recorded); resume the run as a user would (``--resume``): True."""
        assert self.proc is not None
        self.proc.wait()
        if self.proc.returncode == 0:
            return False
        text = self.outputs[-1].read_text(errors="replace").strip().splitlines()
        error = next((line for line in reversed(text) if "Error" in line), text[-1])
        print(f"[chaos] the run stopped (exit {self.proc.returncode}): {error}", flush=True)
        if not faults or "error" in faults[-1] or len(self.outputs) > 3 * len(faults) + 3:
            raise SystemExit(f"the run stopped, not after a fault: {error}")
        faults[-1]["error"] = error
        faults[-1]["exit"] = self.proc.returncode
        faults[-1]["left_after_stop"] = sorted(wait_gone(self.tag, timeout=180))
        faults[-1]["resumed_t"] = time.monotonic()
        self.start(resume=True)
        return True

    def recovered_at(self, faults: list[dict[str, Any]]) -> float:
        """When the last fault was recovered from (its server back, or its next step)."""
        if not faults:
            return 0.0
        f = faults[-1]
        if f["kind"] in SERVER_KINDS and "error" not in f:
            back = self.watch.first_event("back", f["server"], f["t"])
            return back[0] if back else f["t"]
        start = self.restarted_at(f)
        return (self.watch.first_step_after(start) if start else None) or f["t"]

    def plan(self, rng: random.Random) -> list[str]:
        """``--faults`` kinds, as even a mix as the count allows (or ``--mix``), in a random
        order."""
        if self.args.quick:
            kinds = [*SERVER_KINDS, "trainer_kill"]
        elif self.args.mix:
            counts = {k: int(n) for k, n in (kv.split("=") for kv in self.args.mix.split(","))}
            assert set(counts) <= set(KINDS), f"--mix: the kinds are {KINDS}"
            kinds = [k for k in KINDS for _ in range(counts.get(k, 0))]
        else:
            kinds = [KINDS[i % len(KINDS)] for i in range(self.args.faults)]
        rng.shuffle(kinds)
        return kinds


# ---------------------------------------------------------------------------------------------
# What survived, what was lost


def account(run_dir: Path) -> dict[str, Any]:
    """Steps, samples lost or trained twice (lineage), the ledger's balance, syncs verified."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    batch = PROMPTS * N
    ids = [r["sample_id"] for r in read_samples(run_dir) if r["trained"]]
    last = rows[-1] if rows else {}
    ledger = {}
    for unit in ("samples", "tokens"):
        generated = last.get(f"ledger/run/generated_{unit}", 0)
        discarded = sum(
            v for k, v in last.items() if k.startswith("ledger/run/discarded/") and unit in k
        )
        rest = last.get(f"ledger/run/trained_{unit}", 0) + last.get(f"ledger/run/waiting_{unit}", 0)
        ledger[unit] = {"generated": generated, "trained_waiting_discarded": rest + discarded}
    return {
        "steps_logged": [r["step"] for r in rows] == list(range(len(rows))),
        "steps": len(rows),
        "whole_batches": all(r["trained_samples"] == batch for r in rows),
        "trained_rows": len(ids),
        "distinct_ids": len(set(ids)),
        "samples_lost": batch * len(rows) - len(set(ids)),
        "trained_twice": len(ids) - len(set(ids)),
        "ledger": ledger,
        "ledger_balanced": all(
            v["generated"] == v["trained_waiting_discarded"] for v in ledger.values()
        ),
        "ledger_trained_samples": last.get("ledger/run/trained_samples"),
        "syncs_verified": all(r.get("sync/max_abs_dlogp", 1.0) < 1e-3 for r in rows),
        "max_staleness": max((r.get("staleness/max", 0) for r in rows), default=0),
        "rollout_restarts_last_attempt": last.get("rollout/restarts"),
        "resubmitted_last_attempt": last.get("rollout/resubmitted"),
    }


def timings(chaos: Chaos, faults: list[dict[str, Any]]) -> None:
    """Each fault's recovery, by the benchmark's clock and trident's lines."""
    w = chaos.watch
    for f in faults:
        t = f["t"]
        start = chaos.restarted_at(f)
        step = w.first_step_after(start) if start else None
        f["to_next_step_s"] = round(step - t, 1) if step else None
        if f["kind"] in SERVER_KINDS and "error" not in f:
            back = w.first_event("back", f["server"], t)
            f["to_back_s"] = round(back[0] - t, 1) if back else None
            f["trident_recovery_s"] = back[1] if back else None
        if f["kind"] == "engine_freeze" and "error" not in f:
            frozen = w.first_event("frozen", f["server"], t)
            f["to_detected_s"] = round(frozen[0] - t, 1) if frozen else None
        f["survived"] = (
            "error" not in f
            and step is not None
            and (f["kind"] not in SERVER_KINDS or f.get("to_back_s") is not None)
        )
    for f in faults:
        for key in ("t", "resumed_t"):
            f.pop(key, None)


def summary(faults: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind in KINDS:
        fs = [f for f in faults if f["kind"] == kind]
        if not fs:
            continue

        def stat(key: str, fs=fs) -> list[float] | None:
            xs = [f[key] for f in fs if f.get(key) is not None]
            return [min(xs), round(sum(xs) / len(xs), 1), max(xs)] if xs else None

        rows.append(
            {
                "kind": kind,
                "injected": len(fs),
                "survived": sum(f["survived"] for f in fs),
                "stopped_the_run": sum("error" in f for f in fs),
                "to_next_step_s": stat("to_next_step_s"),
                "to_back_s": stat("to_back_s"),
                "trident_recovery_s": stat("trident_recovery_s"),
                "to_detected_s": stat("to_detected_s"),
            }
        )
    return rows


def markdown(result: dict[str, Any]) -> str:
    p, a, c = result["provenance"], result["account"], result["config"]

    def fmt(x: list[float] | None) -> str:
        return "–" if x is None else f"{x[1]:g} ({x[0]:g}–{x[2]:g})"

    lines = [
        f"# Chaos: one run, faults at random moments ({p['date']}, commit `{p['commit']}`)",
        "",
        f"Host: {p['host']['cpu']}, {p['host']['cores']} cores; load average "
        f"{result['load_before']} before, {result['load_after']} after. Written by "
        f"`benchmarks/chaos.py {' '.join(c['argv'])}`: {c['mode']}, {c['servers']} servers, "
        f"{PROMPTS} prompts x {N} samples a step, `checkpoint.every=5`, "
        f"`rollout.liveness_timeout_s=10`. Wall time {result['wall_min']} min; "
        f"{result['attempts']} `trident train` processes (1 + a `--resume` per driver kill "
        f"or stopped run); last exit code {result['returncode']} (143: the benchmark's SIGTERM "
        f"{result['config']['tail']} steps after the last recovery). Faults planned "
        f"{len(c['planned'])}, injected {len(result['faults'])}.",
        "",
        "| fault | injected | survived | stopped the run | to next step, s "
        "| server back in, s (fault -> back) | trident's recovery_s (detected -> back) "
        "| freeze detected, s |",
        "|---|---:|---:|---:|---|---|---|---|",
    ]
    for r in result["summary"]:
        lines.append(
            f"| {r['kind']} | {r['injected']} | {r['survived']} | {r['stopped_the_run']} "
            f"| {fmt(r['to_next_step_s'])} "
            f"| {fmt(r['to_back_s'])} | {fmt(r['trident_recovery_s'])} "
            f"| {fmt(r['to_detected_s'])} |"
        )
    total = sum(r["injected"] for r in result["summary"])
    survived = sum(r["survived"] for r in result["summary"])
    lines += [
        f"| **all** | {total} | {survived} | {total - survived} | | | | |",
        "",
        "Seconds: mean (min–max). To next step: from the fault to the next step line in "
        "`metrics.jsonl` (with 2 servers a step goes on on the other one while one is down; "
        "after a trainer or driver kill, the restart from the newest checkpoint; after a fault "
        "that stopped the run, the `--resume` the benchmark then ran).",
        "",
    ]
    for f in result["faults"]:
        if "error" in f:
            lines.append(
                f"- not survived: {f['kind']}"
                f"{' of server ' + str(f['server']) if 'server' in f else ''} after step "
                f"{f['step']}: the run stopped (exit {f['exit']}) with `{f['error']}`"
            )
    lines += [
        "",
        f"Run: {a['steps']} steps logged (0..{a['steps'] - 1} in order: {a['steps_logged']}), "
        f"every step a whole batch of {PROMPTS * N}: {a['whole_batches']}. Lineage: "
        f"{a['trained_rows']} trained sample rows, {a['distinct_ids']} distinct ids; "
        f"**samples lost: {a['samples_lost']}**, trained twice: {a['trained_twice']}. "
        f"Ledger balanced in samples and tokens: {a['ledger_balanced']} "
        f"({a['ledger']}). Every sync verified: {a['syncs_verified']}; max staleness "
        f"{a['max_staleness']:g}. The run's processes left running at the end (pid: a kill "
        f"-9 left them): {result['left_running'] or 'none'}.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=1000, help="the run's pipeline.steps (an upper bound)"
    )
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jitter", type=float, default=5.0, help="max random wait before a fault, s")
    p.add_argument("--mix", default="", help="faults by kind, e.g. engine_kill=5,api_kill=5")
    p.add_argument("--minutes", type=float, help="inject no fault after this many minutes")
    p.add_argument("--tail", type=int, default=10, help="steps after the last recovery")
    p.add_argument("--quick", action="store_true", help="150 steps, 4 faults: a check")
    p.add_argument("--model", default="/tmp/trident-test-cache/55aa11b94cce1ce8")
    p.add_argument("--root", default=str(REPO / "runs" / "chaos"))
    args = p.parse_args()
    if args.quick:
        args.steps, args.faults = 150, 4
    root = Path(args.root) / f"seed{args.seed}-{'quick' if args.quick else args.steps}"
    if root.exists():
        raise SystemExit(f"{root} exists: move it aside")
    root.mkdir(parents=True)
    load_before = load_average()
    t0 = time.monotonic()
    chaos = Chaos(args, args.model, root)
    faults: list[dict[str, Any]] = []
    try:
        faults = chaos.run(faults)
    except TimeoutError as e:  # a recovery that never came: not survived, the run stopped
        print(f"[chaos] {e}: stopping the run", flush=True)
        if faults:
            faults[-1].setdefault("error", f"benchmark: {e}")
            faults[-1].setdefault("exit", None)
        assert chaos.proc is not None
        chaos.proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            chaos.proc.wait(timeout=120)
    finally:
        if chaos.alive():
            assert chaos.proc is not None
            chaos.proc.kill()
        chaos.watch.stop()
    wall = time.monotonic() - t0
    timings(chaos, faults)
    assert chaos.proc is not None
    result = {
        "provenance": provenance(DEMO),
        "config": {
            "argv": sys.argv[1:],
            "tail": args.tail,
            "seed": args.seed,
            "steps": args.steps,
            "faults": args.faults,
            "quick": args.quick,
            "mode": "separate_async",
            "servers": 2,
            "batch": [PROMPTS, N],
            "model": args.model,
            "command": chaos.cmd[2:],
            "planned": chaos.planned,
        },  # fmt: skip
        "load_before": load_before,
        "load_after": load_average(),
        "wall_min": round(wall / 60, 1),
        "attempts": len(chaos.outputs),
        "returncode": chaos.proc.returncode,
        "left_running": {p: cmdline(p) for p in sorted(wait_gone(chaos.tag, timeout=120))},
        "faults": faults,
        "summary": summary(faults),
        "account": account(chaos.run_dir),
        "run_dir": str(root),
    }
    if chaos.proc.returncode:
        result["error_tail"] = chaos.outputs[-1].read_text(errors="replace")[-3000:]
    out = root / "chaos" if args.quick else RESULTS / "chaos"
    Path(f"{out}.json").write_text(json.dumps(result, indent=2) + "\n")
    Path(f"{out}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

"""Peak memory of the logprob + entropy loss, forward and backward: the whole [tokens, vocab] grid
(``trainer.logprob_chunk_tokens=0``) against vocabulary chunks (issue #30: at 4K tokens the
chunked peak must be <= 1/4 of the whole grid's, with the same values).

The shape is Qwen2.5-0.5B's head: vocabulary 151,936, hidden 896, applied to random final
hidden states by one linear head (no decoder layers: their memory is the same on both paths and
would only hide the difference). The loss is ``sum(logp * a) + sum(entropy * b)`` with random
``a``, ``b``, so both gradient paths run. The figure is the memory above the inputs (the head's
weight, the hidden states, the targets) at its highest during forward + backward; the weight's
gradient (a [vocab, hidden] float32 tensor) is part of it on both paths.

Two measures of it, per tokens x path:

* ``tracked``: every tensor byte alive, counted by torch's ``MemTracker`` on fake tensors
  (``FakeTensorMode``: nothing is allocated), so the whole grid at 8K tokens (~23 GB) is counted
  on a machine that could not hold it.
* ``measured``: the real thing, in a fresh process per case: on CUDA,
  ``torch.cuda.max_memory_allocated`` above what was allocated before; on a CPU host, the peak
  resident set (``ru_maxrss``) above the resident set before. On a CPU host a case runs only if
  its tracked figure is under ``--max-gib`` (default 8), so this machine is not pushed into swap.

Where both paths run for real, their logprobs, entropies and gradients are compared (max
absolute difference of values, max difference of each gradient relative to its largest entry).

    .venv/bin/python benchmarks/logprob_memory.py   # ~15 min on 2 busy cores; on CUDA when present
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from provenance import REPO, provenance

from trident.train.logprobs import chunked_logprobs, grid_logprobs

VOCAB, HIDDEN = 151_936, 896  # Qwen2.5-0.5B (its config.json)
TOKENS = (1024, 4096, 8192)
GIB = 1 << 30


def inputs(tokens: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    opts: dict[str, Any] = dict(generator=g, device=device)
    return {
        "weight": (torch.randn(VOCAB, HIDDEN, **opts) * 0.02).to(dtype).requires_grad_(),
        "hidden": torch.randn(tokens, HIDDEN, **opts).to(dtype).requires_grad_(),
        "targets": torch.randint(0, VOCAB, (tokens,), **opts),
        "a": torch.randn(tokens, **opts),
        "b": torch.randn(tokens, **opts),
    }


def loss_backward(x: dict[str, torch.Tensor], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward + backward of the loss; the logprobs and entropies (detached)."""
    if chunk:
        logp, entropy = chunked_logprobs(
            x["hidden"], x["weight"], None, x["targets"], chunk_tokens=chunk, with_entropy=True
        )
    else:
        logits = torch.nn.functional.linear(x["hidden"], x["weight"])
        logp, entropy = grid_logprobs(logits, x["targets"], with_entropy=True)
    assert entropy is not None
    ((logp * x["a"]).sum() + (entropy * x["b"]).sum()).backward()
    return logp.detach(), entropy.detach()


def tracked_gib(tokens: int, chunk: int, dtype: torch.dtype) -> float:
    """Peak tensor memory above the inputs, counted on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    with FakeTensorMode():
        x = inputs(tokens, "cpu", dtype)
        tracker = MemTracker()
        tracker.track_external(*x.values())
        with tracker:
            before = tracker.get_tracker_snapshot("current")
            loss_backward(x, chunk)
        peak = tracker.get_tracker_snapshot("peak")
    dev = torch.device("cpu")
    return (peak[dev]["Total"] - before[dev]["Total"]) / GIB


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def run_case(tokens: int, chunk: int, device: str, dtype: str, out: Path, keep: bool) -> None:
    """One measured case in this (fresh) process: its figures, and with ``keep`` its values and
    gradients (for comparing the paths), saved to ``out``."""
    x_dtype = getattr(torch, dtype)
    x = inputs(tokens, device, x_dtype)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss()
    start = time.perf_counter()
    logp, entropy = loss_backward(x, chunk)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = time.perf_counter() - start
    grad_h, grad_w = x["hidden"].grad, x["weight"].grad
    assert grad_h is not None and grad_w is not None
    result: dict[str, Any] = {"gib": (peak - before) / GIB, "seconds": seconds}
    if keep:
        result |= {"logp": logp, "entropy": entropy, "grad_hidden": grad_h, "grad_weight": grad_w}
    torch.save({k: v.float().cpu() if torch.is_tensor(v) else v for k, v in result.items()}, out)


def measured(tokens: int, chunk: int, device: str, dtype: str, keep: bool, work: Path) -> dict:
    """``run_case`` in a fresh process (a clean peak), its results loaded back."""
    out = work / f"{tokens}-{chunk}.pt"
    args = [str(tokens), str(chunk), device, dtype, str(out), str(int(keep))]
    subprocess.run([sys.executable, __file__, "--case", *args], check=True, cwd=REPO)
    result = torch.load(out)
    out.unlink()
    return result


def compare(grid: dict, chunked: dict) -> dict[str, float]:
    """Max |difference| of values; of gradients, relative to the gradient's largest entry."""
    out = {k: float((chunked[k] - grid[k]).abs().max()) for k in ("logp", "entropy")}
    for k in ("grad_hidden", "grad_weight"):
        out[k] = float((chunked[k] - grid[k]).abs().max() / grid[k].abs().max())
    return out


def markdown(results: dict[str, Any]) -> str:
    prov, rows = results["provenance"], results["rows"]
    lines = [
        f"# Logprob + entropy memory (benchmarks/logprob_memory.py, {prov['date']}, "
        f"commit `{prov['commit']}`)",
        "",
        f"Host: {prov['host']['cpu']}, {prov['host']['cores']} cores; device `{results['device']}`, "
        f"{results['dtype']}, torch {results['torch']}. One linear head (vocabulary {VOCAB:,}, "
        f"hidden {HIDDEN}, Qwen2.5-0.5B's) on random hidden states; loss = logp·a + entropy·b, "
        f"forward + backward. Peak memory above the inputs, in GiB: *tracked* counts every tensor "
        f"(torch's MemTracker on fake tensors, nothing allocated); *measured* is the real peak "
        f"({results['measure']}), run where it fits under {results['max_gib']} GiB. "
        f"Chunk: {results['chunk']} tokens (`trainer.logprob_chunk_tokens`).",
        "",
        "| tokens | whole grid, tracked | chunked, tracked | ratio | whole grid, measured "
        "| chunked, measured | ratio | seconds whole / chunked | max abs Δ logp, entropy "
        "| max rel Δ grad h, W |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]

    def gib(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f}"

    for r in rows:
        g, c = r["grid"], r["chunked"]
        m_ratio = (
            f"{c['measured_gib'] / g['measured_gib']:.3f}"
            if g["measured_gib"] and c["measured_gib"]
            else "–"
        )
        d = r.get("difference")
        lines.append(
            f"| {r['tokens']:,} | {gib(g['tracked_gib'])} | {gib(c['tracked_gib'])} "
            f"| {c['tracked_gib'] / g['tracked_gib']:.3f} | {gib(g['measured_gib'])} "
            f"| {gib(c['measured_gib'])} | {m_ratio} "
            f"| {gib(g['seconds'])} / {gib(c['seconds'])} "
            + (
                f"| {d['logp']:.1e}, {d['entropy']:.1e} | {d['grad_hidden']:.1e}, "
                f"{d['grad_weight']:.1e} |"
                if d
                else "| – | – |"
            )
        )
    lines += ["", "A dash: not run for real here (it would not fit under the cap)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per chunk")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--max-gib", type=float, default=8.0, help="CPU: skip bigger real runs")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--case", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        tokens, chunk, device, dtype, out, keep = args.case
        run_case(int(tokens), int(chunk), device, dtype, Path(out), keep == "1")
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in args.tokens:
            row: dict[str, Any] = {"tokens": tokens}
            runs = {}
            for name, chunk in (("grid", 0), ("chunked", args.chunk)):
                tracked = tracked_gib(tokens, chunk, getattr(torch, dtype))
                fits = device == "cuda" or tracked * 1.25 < args.max_gib
                row[name] = {"tracked_gib": tracked, "measured_gib": None, "seconds": None}
                if fits:
                    runs[name] = measured(tokens, chunk, device, dtype, True, Path(tmp))
                    row[name] |= {k: runs[name][k] for k in ("gib", "seconds")}
                    row[name]["measured_gib"] = row[name].pop("gib")
                print(tokens, name, row[name], flush=True)
            if len(runs) == 2:
                row["difference"] = compare(runs["grid"], runs["chunked"])
            rows.append(row)
    results = {
        "provenance": provenance(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": dtype,
        "torch": torch.__version__,
        "vocab": VOCAB,
        "hidden": HIDDEN,
        "chunk": args.chunk,
        "max_gib": args.max_gib,
        "measure": "torch.cuda.max_memory_allocated" if device == "cuda" else "peak RSS growth",
        "rows": rows,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    suffix = "" if device == "cpu" else "_cuda"
    (args.out_dir / f"logprob_memory{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    (args.out_dir / f"logprob_memory{suffix}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()

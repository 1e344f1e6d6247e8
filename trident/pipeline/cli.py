"""``trident train``: the RL loop."""

from __future__ import annotations

import argparse


def cmd_train(args: argparse.Namespace) -> int:
    from trident.cli import _resolve

    cfg = _resolve(args)
    if cfg is None:
        return 0
    from rich.console import Console

    from trident.eval import summary_table
    from trident.pipeline.run import run_train

    results = run_train(cfg)
    if "before" in results:
        Console().print(
            summary_table(
                {"before RL": results["before"], "after RL": results["after"]}, cfg.eval.pass_k
            )
        )
    print(f"final checkpoint: {results['final_checkpoint']}")
    print(
        f"run directory: {cfg.derived.run_dir} (metrics.jsonl, tensorboard/, logs/, checkpoints/)"
    )
    return 0


def register(sub) -> None:
    from trident.cli import _job_parser

    p = _job_parser(
        sub,
        "train",
        "RL training (GRPO and friends) with vLLM rollout and FSDP2",
        "Start Ray, vLLM servers and the FSDP2 trainer; run pipeline.steps steps of generate -> reward -> "
        "train -> verified weight sync; evaluate before and after; write the run directory.",
    )
    p.set_defaults(func=cmd_train)

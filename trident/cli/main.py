"""The ``trident`` command line: ``model``, ``sft``, ``eval``, ``train`` here; each other command
group in its own module of this package (``rollout``, ``sandbox``, ``env``, ``data``,
``report``/``inspect``), all sharing ``trident.cli.args``.

Every job command takes ``--config FILE`` (repeatable), dotted overrides (``rollout.n=8``) and
``--dry-run`` (print the resolved config and exit). Expected failures (bad config, missing model,
unreadable data, a port in use, a server that does not start) print one actionable line and exit 2.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from trident.cli import data, envs, rollout, sandbox, telemetry
from trident.cli.args import job_parser, resolve
from trident.config import ConfigError, load_config


def cmd_model_init(args: argparse.Namespace) -> int:
    from trident.models import factory

    if args.like or args.config:
        spec = factory.LIKE[args.like] if args.like else json.loads(Path(args.config).read_text())
        out = factory.init_from_config(
            args.out, spec, layers=args.layers, dtype=args.dtype, seed=args.seed
        )
        what = args.like or args.config
    else:
        out, what = factory.init_model(args.out, args.preset, args.seed), args.preset
    n = factory.checkpoint_parameters(out)
    print(f"wrote {what} checkpoint ({n / 1e6:.2f} M parameters) to {out}")
    return 0


def cmd_sft(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    if cfg is None:
        return 0
    from trident.train.sft import run_sft

    out = run_sft(cfg)
    print(f"SFT checkpoint: {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = resolve(args)
    if cfg is None:
        return 0
    from rich.console import Console

    from trident.pipeline.eval import run_eval, summary_table

    result = run_eval(cfg, args.out)
    Console().print(summary_table({cfg.model.path: result}, cfg.eval.pass_k))
    print(f"results: {result['path']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.resume:
        args.overrides.append("run.resume=auto")
    from trident.pipeline.checkpoint import prepare_run_dir

    cfg = resolve(args, prepare=prepare_run_dir)  # prepared again by the run: a no-op then
    if cfg is None:  # a dry run: the config was printed; the placement plan follows
        from trident.cluster.placement import local_resources, plan_for

        cfg = load_config(args.config, args.overrides)
        plan = plan_for(cfg, local_resources()).describe()
        where = "this machine's" if not cfg.cluster.address else "this machine's, not the cluster's"
        print(f"{plan}\n  (from {where} devices)", file=sys.stderr)
        return 0
    from trident.cluster.ray_cluster import init_ray

    # The pipeline's imports (~1.6 s on 2 cores) run in a thread while Ray starts here (its
    # processes die with the thread that started them: not in a thread of ours)
    pipeline = threading.Thread(target=importlib.import_module, args=("trident.pipeline.run",))
    pipeline.start()
    init_ray(cfg.cluster)
    pipeline.join()
    from rich.console import Console

    from trident.pipeline.eval import summary_table
    from trident.pipeline.run import run_train

    results = run_train(cfg, own_ray=True)
    if "before" in results:
        table = summary_table(
            {"before RL": results["before"], "after RL": results["after"]}, cfg.eval.pass_k
        )
        Console().print(table)
    run_dir = cfg.derived.run_dir
    print(f"final checkpoint: {results['final_checkpoint']}")
    print(
        f"run directory: {run_dir} (metrics.jsonl, trace.json, tensorboard/, logs/, checkpoints/)"
    )
    print(f"report: trident report {run_dir}")
    return 0


def _model_parser(sub) -> None:
    """``trident model init``."""
    model = sub.add_parser(
        "model", help="create local checkpoints", description="Create local checkpoints."
    )
    model_sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    init = model_sub.add_parser(
        "init",
        help="write a random-weight model + tokenizer + chat template",
        description="Write a checkpoint with trident's byte-level BPE tokenizer (trained on the built-in "
        "tasks) and a ChatML chat template (tool calls included); loads in transformers and vLLM. A preset "
        "is a small Qwen2-architecture model; --like and --config build a real architecture at its full "
        "size (layers, heads, vocabulary, RoPE) with random weights, since no weights are downloaded.",
    )
    init.add_argument("out", help="output directory")
    source = init.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        choices=["tiny", "small"],
        default="tiny",
        help="tiny ≈ 0.9 M params (CPU), small ≈ 25 M (GPU)",
    )
    source.add_argument(
        "--like",
        choices=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "llama-3.2-1b"],
        help="a published model's architecture (its config.json), e.g. qwen2.5-0.5b: 494 M params",
    )
    source.add_argument("--config", help="a Hugging Face config.json: its architecture")
    init.add_argument(
        "--layers", type=int, default=None, help="--like/--config: override num_hidden_layers"
    )
    init.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="--like/--config: weight dtype (default: the config's, bfloat16 for the --like models)",
    )
    init.add_argument("--seed", type=int, default=0, help="initialisation seed")
    init.set_defaults(func=cmd_model_init)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trident", description="RL post-training for language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _model_parser(sub)

    p = job_parser(
        sub,
        "sft",
        "supervised fine-tuning (the warm-up RL starts from)",
        "Fine-tune model.path on data (prompt/response rows, chat rows or a built-in task) with FSDP2; "
        "writes an HF checkpoint to sft.output (default <run dir>/model).",
    )
    p.set_defaults(func=cmd_sft)

    p = job_parser(
        sub,
        "eval",
        "greedy accuracy and pass@k on a held-out split",
        "Serve model.path with vLLM, run the test split, print a table and write JSON.",
    )
    p.add_argument("--out", help="JSON output path (default <run dir>/eval.json)")
    p.set_defaults(func=cmd_eval)

    p = job_parser(
        sub,
        "train",
        "RL training (GRPO and friends) with vLLM rollout and FSDP2",
        "Start Ray, vLLM servers and the FSDP2 trainer; run pipeline.steps steps of generate -> reward -> "
        "train -> verified weight sync; evaluate before and after; write the run directory.",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run from the newest complete checkpoint of its run directory",
    )
    p.set_defaults(func=cmd_train)

    for component in (rollout, sandbox, envs, data, telemetry):  # each its own subcommands
        component.register(sub)
    return parser


# The errors that print one line (exit 2), by the module that defines each. Only modules already
# imported are looked at: an error can only be an instance of a class whose module has run, and
# importing the others here would pull Ray into every command's error path (engine-free commands
# run on hosts without Ray or vLLM).
_EXPECTED_ERRORS = {
    "trident.cluster.net": ("PortInUseError",),
    "trident.cluster.placement": ("PlacementError",),
    "trident.data.loaders": ("DataError",),
    "trident.models.load": ("ModelPathError",),
    "trident.pipeline.ledger": ("LedgerError",),
    "trident.pipeline.members": ("ServerDiedError",),
    "trident.pipeline.watchdog": ("HangError",),
    "trident.rollout.engine": ("EngineError",),
    "trident.rollout.membership": ("JoinRefused",),
    "trident.rollout.vllm_server": ("ServerStartError",),
    "trident.train.group": ("TrainerStartError", "TrainerRankError"),
    "trident.weights.control": ("WeightSyncError",),
}


def _expected_errors() -> tuple[type[BaseException], ...]:
    loaded = [
        getattr(sys.modules[module], name)
        for module, names in _EXPECTED_ERRORS.items()
        if module in sys.modules
        for name in names
    ]
    return (ConfigError, FileNotFoundError, *loaded)


def _out_of_memory(error: BaseException) -> str | None:
    if "ray" not in sys.modules:  # no Ray started: not Ray's memory monitor
        return None
    from trident.cluster.ray_cluster import out_of_memory

    return out_of_memory(error)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a scheduler ending the job): unwinds like Ctrl-C, so servers, trainer
    and Ray are stopped on the way out (Python's default would exit without any cleanup)."""


# An unwind after SIGTERM that takes longer than this prints every thread's stack (then goes on)
UNWIND_DUMP_S = 120


def _raise_terminated(signum: int, frame: object) -> None:
    faulthandler.dump_traceback_later(UNWIND_DUMP_S)
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # per-file loading bars are noise
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    # flags may come between the dotted overrides (``train a=1 --resume b=2``): argparse stops
    # collecting the positional list at the flag, so the rest come back here
    args, extra = parser.parse_known_args(argv)
    if extra:
        if isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra
        ):
            args.overrides += extra
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return args.func(args)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        print("terminated" if terminated else "interrupted", file=sys.stderr)
        return 143 if terminated else 130
    except Exception as e:
        if isinstance(e, _expected_errors()):
            print(f"error: {e}", file=sys.stderr)
            return 2
        oom = _out_of_memory(e)
        if oom is not None:  # a page of Ray's memory tables, in one line
            print(f"error: {oom}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

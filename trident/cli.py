"""The ``trident`` command line.

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
from collections.abc import Callable
from pathlib import Path

from trident.config import ConfigError, TridentConfig, dump_config, load_config, save_config

EPILOG = (
    "Overrides are dotted KEY=VALUE pairs, e.g. `model.path=ckpt rollout.n=8`; see docs/config.md."
)


def _job_parser(sub, name: str, help_text: str, description: str) -> argparse.ArgumentParser:
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


def _resolve(
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
    changed = _diff(cfg.model_dump(mode="json"), TridentConfig().model_dump(mode="json"))
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


def _diff(values: dict, defaults: dict) -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            sub = _diff(value, defaults[key])
            if sub:
                out[key] = sub
        elif value != defaults.get(key):
            out[key] = value
    return out


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
    cfg = _resolve(args)
    if cfg is None:
        return 0
    from trident.train.sft import run_sft

    out = run_sft(cfg)
    print(f"SFT checkpoint: {out}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    cfg = _resolve(args)
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

    cfg = _resolve(args, prepare=prepare_run_dir)  # prepared again by the run: a no-op then
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


def cmd_rollout_serve(args: argparse.Namespace) -> int:
    """One vLLM server with trident's weight transfer, until Ctrl-C or SIGTERM; runs attach to
    it with ``rollout.server_urls``, or it joins the running job ``--join RUN_DIR`` (and leaves
    it on SIGTERM once its requests in flight are done: ``trident.rollout.membership``)."""
    run_dir = Path(args.join) if args.join else None
    if run_dir is not None:  # the run's own settings: model, dtype, LoRA, weight transfer
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--join {run_dir}: not a run directory (no config.yaml)")
        cfg = load_config([run_dir / "config.yaml"], args.overrides)
    else:
        cfg = _resolve(args)
        if cfg is None:
            return 0
    from trident.rollout import membership
    from trident.rollout.fleet import server_options
    from trident.rollout.vllm_server import VLLMServer
    from trident.weights.backend import SERVER_BACKENDS, served_model, weight_backend

    backend = weight_backend(cfg.sync, lora=cfg.model.lora)
    logs = Path(run_dir or cfg.derived.run_dir) / "logs"
    log = logs / (f"vllm_server_joined_{os.getpid()}.log" if run_dir else "vllm_server.log")
    server = VLLMServer(
        cfg.model.path, log, port=0 if run_dir else cfg.rollout.base_port, host=args.host,
        **server_options(cfg, SERVER_BACKENDS[backend], served_model(backend)),
    )  # fmt: skip
    print(f"starting a rollout server for {cfg.model.path} (log: {log})", file=sys.stderr)
    url = server.start(cfg.rollout.startup_timeout_s)
    try:
        if run_dir is None:
            print(f"serving at {url}: attach with 'rollout.server_urls=[{url}]'", flush=True)
        else:
            joined = membership.join(run_dir, url, cfg.rollout.startup_timeout_s)
            print(f"serving at {url}: {joined}", flush=True)
        assert server.proc is not None  # started
        try:
            code = server.proc.wait()  # Ctrl-C / SIGTERM raise out of the wait
        except KeyboardInterrupt:
            if run_dir is not None:  # leave: the run stops sending and lets its requests finish
                print(f"leaving {run_dir}", file=sys.stderr, flush=True)
                membership.wait_answer(membership.ask(run_dir, "leave", url), ANSWER_TIMEOUT_S)
                print(f"left {run_dir}", file=sys.stderr, flush=True)
            raise
        print(f"the rollout server exited with code {code} (log: {log})", file=sys.stderr)
        return 2
    finally:
        server.stop()


# How long join and leave wait for the run's answer: a join is one weight push, and a leaver's
# requests in flight finish within rollout requests' own bounds.
ANSWER_TIMEOUT_S = 600


def cmd_rollout_join(args: argparse.Namespace) -> int:
    """Ask the running job in ``args.run_dir`` to bring the server at ``args.url`` (a
    ``trident rollout serve``) to its weights and route to it."""
    from trident.rollout import membership

    print(membership.join(args.run_dir, args.url, ANSWER_TIMEOUT_S), flush=True)
    return 0


def cmd_rollout_leave(args: argparse.Namespace) -> int:
    """Ask the running job in ``args.run_dir`` to stop routing to ``args.url`` and wait until
    its requests in flight are done; the server can then be stopped."""
    from trident.rollout import membership

    request = membership.ask(args.run_dir, "leave", args.url)
    _, answer = membership.wait_answer(request, ANSWER_TIMEOUT_S)
    print(f"{args.url} left {args.run_dir} after {answer['seconds']:.1f} s", flush=True)
    return 0


def _rollout_parser(sub) -> None:
    """``trident rollout serve|join|leave``."""
    rollout = sub.add_parser(
        "rollout", help="rollout servers", description="Rollout servers runs can attach to."
    )
    rollout_sub = rollout.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    p = _job_parser(
        rollout_sub,
        "serve",
        "start one vLLM server that runs attach to (rollout.server_urls)",
        "Start a vLLM server for model.path with trident's weight transfer (the options of the "
        "servers trident train starts: rollout.*, sync.backend) on rollout.base_port, and keep it "
        "up until Ctrl-C or SIGTERM. A run with rollout.server_urls=[URL] syncs and verifies it "
        "like its own and leaves it running.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument(
        "--join",
        metavar="RUN_DIR",
        help="join the job running in RUN_DIR (its model and settings; the overrides apply on top): "
        "the run brings this server to its weights, verified, then routes to it; SIGTERM leaves "
        "the job once the server's requests in flight are done, then stops the server",
    )
    p.set_defaults(func=cmd_rollout_serve)
    p = rollout_sub.add_parser(
        "join",
        help="add a running server to a running job",
        description="Ask the job running in RUN_DIR to bring the server at URL (a `trident "
        "rollout serve` of the job's model) to the job's weights, verified, and route to it.",
    )
    p.add_argument("url", help="the server's url")
    p.add_argument("run_dir", help="the job's run directory")
    p.set_defaults(func=cmd_rollout_join)
    p = rollout_sub.add_parser(
        "leave",
        help="take a server out of a running job",
        description="Ask the job running in RUN_DIR to send URL nothing new and wait until its "
        "requests in flight are done (any server of the job: started, attached or joined). "
        "The server itself is left running.",
    )
    p.add_argument("url", help="the server's url")
    p.add_argument("run_dir", help="the job's run directory")
    p.set_defaults(func=cmd_rollout_leave)


def cmd_tinker_serve(args: argparse.Namespace) -> int:
    """The Tinker API training service (``trident.tinker.serve``) until Ctrl-C or SIGTERM."""
    cfg = _resolve(args, needs_model=False)  # the served checkpoint is tinker.models'
    if cfg is None:
        return 0
    from trident.tinker.serve import serve

    serve(cfg)
    return 0


def _tinker_parser(sub) -> None:
    """``trident tinker serve``."""
    tinker = sub.add_parser(
        "tinker", help="the Tinker API training service", description="The Tinker API service."
    )
    tinker_sub = tinker.add_subparsers(dest="tinker_command", required=True, metavar="ACTION")
    p = _job_parser(
        tinker_sub,
        "serve",
        "serve the Tinker API (forward_backward, optim_step, sample, ...) on tinker.port",
        "Start the trainer, the vLLM servers (or attach to rollout.server_urls) and the Tinker "
        "API on tinker.host:tinker.port, serving the checkpoint tinker.models names; a restart "
        "on the same tinker.state_dir resumes exactly.",
    )
    p.set_defaults(func=cmd_tinker_serve)


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

    p = _job_parser(
        sub,
        "sft",
        "supervised fine-tuning (the warm-up RL starts from)",
        "Fine-tune model.path on data (prompt/response rows, chat rows or a built-in task) with FSDP2; "
        "writes an HF checkpoint to sft.output (default <run dir>/model).",
    )
    p.set_defaults(func=cmd_sft)

    p = _job_parser(
        sub,
        "eval",
        "greedy accuracy and pass@k on a held-out split",
        "Serve model.path with vLLM, run the test split, print a table and write JSON.",
    )
    p.add_argument("--out", help="JSON output path (default <run dir>/eval.json)")
    p.set_defaults(func=cmd_eval)

    p = _job_parser(
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

    _rollout_parser(sub)
    _tinker_parser(sub)
    for register in _plugins():
        register(sub)
    return parser


def _plugins() -> list[Callable]:
    """Subcommands that live with their component."""
    registers = []
    for module in (
        "trident.sandbox.cli",
        "trident.envs.cli",
        "trident.data.cli",
        "trident.telemetry.cli",
    ):
        try:
            registers.append(__import__(module, fromlist=["register"]).register)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return registers


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
    "trident.pipeline.recovery": ("ServerDiedError",),
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

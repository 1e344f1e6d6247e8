"""One trained model of the service: what it starts from, its ``Trainer``, and how each kind of
training request runs on it and what it answers.

Every effect here is a function of the request and the model's state, so replaying the journal
after a snapshot redoes exactly what the first run did: bitwise on CPU under
``run.deterministic`` with the same thread and rank counts; on GPUs once, but not bitwise. A
saved directory records which request wrote it, so a replayed ``save_weights`` finds its own
directory done instead of refusing it as a name already taken.

A model's weights are named by ``weights_seq``, the seq of the request that last changed them
(its ``optim_step`` or legacy ``load_weights``; 0 at creation): a replay gives the same names,
and a sampling session is bound to one (``trident.tinker.sampling``). An unnamed
``save_weights_for_sampler`` pushes the weights to the rollout servers (``publish``); a named
one also exports them, its manifest keeping the ``weights_seq`` it holds.

Places (``<state_dir>/models/<model id>/``): ``snapshots/``, ``weights/<name>/`` (the
trainer's ``save_state`` in ``trainer/``, plus ``model.json``: base model, base path, LoRA
shape, which a create-via-load reads back) and ``sampler_weights/<name>/`` (the trainer's HF
export), named to clients as ``tinker://<model id>/weights/<name>`` and
``.../sampler_weights/<name>``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

from trident.tinker.journal import Result, error
from trident.tinker.snapshots import Snapshots
from trident.train.atomic import is_complete, read_manifest, write_dir
from trident.train.datum import AdamParams, LoraShape
from trident.train.tinker_ops import Trainer

SCHEME = "tinker://"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


# (base path, LoRA shape or None for full fine-tuning) -> a Trainer, or an awaitable of one
TrainerFactory = Callable[[str, LoraShape | None], Trainer | Awaitable[Trainer]]
# (the model, the sampling session to bind to its weights) -> once they are served
Publish = Callable[["TrainedModel", str], Awaitable[None]]


def sampler_id_of(model_id: str, seq_id: int, named: bool = False) -> str:
    """The sampling session a ``save_weights_for_sampler`` binds (deterministic: a replay
    binds the same one); a named save's is not answered (its path is), only journaled."""
    return f"{model_id}:{'saved' if named else 'sampler'}:{seq_id}"


class UserError(Exception):
    """A request that cannot run as asked: answered ``{"error", "category": "user"}``."""


@dataclass(frozen=True)
class Origin:
    """What a model starts from: a base model (and LoRA shape), or saved weights."""

    base_model: str
    base_path: str
    lora: LoraShape | None
    user_metadata: dict[str, Any] | None = None
    load_path: Path | None = None  # create-via-load: the saved weights
    optimizer: bool = False  # ... with their Adam moments

    def record(self) -> dict[str, Any]:
        """What a model's snapshots and saved weights keep of it, to rebuild it from them."""
        lora = asdict(self.lora) if self.lora is not None else None
        return {
            "base_model": self.base_model,
            "base_path": self.base_path,
            "lora": lora,
            "user_metadata": self.user_metadata,
        }

    @staticmethod
    def from_record(record: dict[str, Any]) -> Origin:
        lora = LoraShape(**record["lora"]) if record["lora"] else None
        return Origin(record["base_model"], record["base_path"], lora, record["user_metadata"])


def fields(args: Any) -> dict[str, Any]:
    """A JSON request's fields, whether the codec hands a dict or an SDK model."""
    dump: Callable[[], dict[str, Any]] | None = getattr(args, "model_dump", None)
    return dump() if dump is not None else dict(args)


def model_dir(state_dir: Path, model_id: str) -> Path:
    return state_dir / "models" / quote(model_id, safe="")


def origin_of(kind: str, args: Any, served: Mapping[str, str], state_dir: Path) -> Origin:
    """A model's origin from its seq-0 request as the codec decodes it: ``create_model``
    ``{"base_model", "lora": LoraShape | None, "user_metadata", ...}`` (the codec turns the
    wire's rank, 0 for full fine-tuning, into the shape), or ``load_weights`` ``{"path",
    "optimizer", ...}``, whose saved weights record the base model and shape."""
    body = fields(args)
    if kind == "load_weights":
        path = resolve(state_dir, body["path"], "weights")
        saved = Origin.from_record(json.loads((path / "model.json").read_text()))
        user_metadata = body.get("user_metadata", saved.user_metadata)
        return replace(
            saved, user_metadata=user_metadata, load_path=path, optimizer=bool(body["optimizer"])
        )
    name = body["base_model"]
    # a served name, else a local checkpoint directory (math_rl's model_name=<dir>)
    base_path = served.get(name) or (name if Path(name, "config.json").is_file() else None)
    if base_path is None:
        raise UserError(f"unknown base_model {name!r}: this server serves {sorted(served)}")
    return Origin(name, base_path, body.get("lora"), body.get("user_metadata"))


def resolve(state_dir: Path, uri: str, place: str) -> Path:
    """The directory a ``tinker://<model id>/<place>/<name>`` path names; it must be complete."""
    model_id, sep, name = uri.removeprefix(SCHEME).rpartition(f"/{place}/")
    if not uri.startswith(SCHEME) or not sep or not _NAME.fullmatch(name):
        raise UserError(f"not a {place} path of this server: {uri!r}")
    path = model_dir(state_dir, model_id) / place / name
    if not is_complete(path):
        raise UserError(f"no saved {place} at {uri!r}")
    return path


class TrainedModel:
    """A model and its trainer; ``run`` applies one request (module docstring)."""

    def __init__(
        self, model_id: str, origin: Origin, state_dir: Path, publish: Publish | None = None
    ) -> None:
        """``publish``: pushes this model's weights to the rollout servers (None: none)."""
        self.model_id = model_id
        self.publish = publish
        self.weights_seq = 0
        self.replaying = False  # the request running was journaled before a restart
        self.origin = origin
        self.state_dir = state_dir
        self.dir = model_dir(state_dir, model_id)
        self.snapshots = Snapshots(self.dir / "snapshots")
        self.trainer: Trainer | None = None
        self.optim_steps = 0

    async def build(self, make_trainer: TrainerFactory) -> None:
        """The trainer on the base model (a model load: off the event loop)."""
        made = await asyncio.to_thread(make_trainer, self.origin.base_path, self.origin.lora)
        self.trainer = await made if inspect.isawaitable(made) else made

    async def restore(self, snapshot: Path, manifest: dict[str, Any]) -> None:
        await self.live().load_state(str(snapshot / "trainer"), True)
        self.optim_steps = int(manifest["optim_steps"])
        self.weights_seq = int(manifest["last_seq"])  # a snapshot follows its optim_step

    async def snapshot(self, last_seq: int) -> Path:
        """Commit a snapshot after request ``last_seq`` (right after an ``optim_step``)."""
        return await self.snapshots.commit(
            self.live(), self.model_id, last_seq, self.optim_steps, self.origin.record()
        )

    def live(self) -> Trainer:
        if self.trainer is None:
            raise UserError(f"model {self.model_id} is not loaded")
        return self.trainer

    def info(self) -> dict[str, Any]:
        """What ``get_info`` and ``training_runs/{id}`` answer (the codec shapes them)."""
        config = Path(self.origin.base_path, "config.json")
        arch = json.loads(config.read_text()).get("architectures", [None])[0]
        lora = self.origin.lora
        return {
            "model_id": self.model_id,
            "base_model": self.origin.base_model,
            "is_lora": lora is not None,
            "lora_rank": lora.rank if lora is not None else None,
            "tokenizer_id": self.origin.base_path,  # the SDK's get_tokenizer takes a directory
            "arch": arch,
            "user_metadata": self.origin.user_metadata,
        }

    async def run(self, kind: str, args: Any, rid: str, seq_id: int) -> Result:
        """Apply one request (seq > 0); a failure becomes an error result, never an exception
        (the executor must go on, and replay must fail the same way)."""
        try:
            return await self._run(kind, args, rid, seq_id)
        except (UserError, ValueError, KeyError, TypeError) as exc:
            return error(f"{kind}: {exc}")
        except Exception as exc:  # the trainer's own failure, not the request's
            return error(f"{kind}: {type(exc).__name__}: {exc}", "server")

    async def _run(self, kind: str, args: Any, rid: str, seq_id: int) -> Result:
        trainer = self.live()
        if kind == "forward_backward":
            outputs, metrics = await trainer.forward_backward(
                list(args.data),
                str(args.loss_fn),
                dict(args.loss_fn_config or {}),
                bool(args.forward_only),
            )
            return Result("forward_backward", (outputs, metrics))
        if kind == "optim_step":
            adam = args if isinstance(args, AdamParams) else AdamParams(**fields(args))
            metrics = await trainer.optim_step(adam)
            self.optim_steps += 1
            self.weights_seq = seq_id
            return Result("json", {"metrics": metrics})
        body = fields(args)
        if kind == "save_weights":
            return await self._save(
                "weights", body, rid, lambda d: trainer.save_state(f"{d}/trainer")
            )
        if kind == "save_weights_for_sampler":
            return await self._for_sampler(body, rid, seq_id)
        if kind == "load_weights":  # legacy addressing: a load into this existing model
            path = resolve(self.state_dir, body["path"], "weights")
            await trainer.load_state(str(path / "trainer"), bool(body["optimizer"]))
            self.weights_seq = seq_id
            return Result("json", {"path": body["path"], "model_id": self.model_id})
        raise UserError(f"unknown request kind {kind!r}")

    async def _for_sampler(self, body: dict[str, Any], rid: str, seq_id: int) -> Result:
        """Named: the HF export, then the push (none without rollout servers); unnamed: the
        push, bound to a new sampling session."""
        if body.get("path"):
            done = await self._save("sampler_weights", body, rid, self.live().save_hf)
            if self.publish is not None:
                await self.publish(self, sampler_id_of(self.model_id, seq_id, named=True))
            return done
        if self.publish is None:
            raise UserError("an unnamed save_weights_for_sampler needs rollout servers")
        sampler_id = sampler_id_of(self.model_id, seq_id)
        await self.publish(self, sampler_id)
        kind = "save_weights_for_sampler"
        return Result("json", {"sampling_session_id": sampler_id, "type": kind})

    async def _save(
        self, place: str, body: dict[str, Any], rid: str, save: Callable[[str], Awaitable[Any]]
    ) -> Result:
        name = str(body.get("path") or "")
        if not _NAME.fullmatch(name):
            raise UserError(f"a checkpoint name is letters, digits, '.', '_', '-': {name!r}")
        final = self.dir / place / name
        uri = f"{SCHEME}{self.model_id}/{place}/{name}"
        kind = "save_weights" if place == "weights" else "save_weights_for_sampler"
        done = Result("json", {"path": uri, "type": kind})
        if is_complete(final):
            if read_manifest(final).get("request_id") == rid:
                return done  # replayed: this request already wrote it
            if not body.get("overwrite"):
                raise UserError(f"{uri} exists (pass overwrite=True to replace it)")

        async def fill(tmp: Path) -> None:
            await save(str(tmp))
            (tmp / "model.json").write_text(json.dumps(self.origin.record()) + "\n")

        final.parent.mkdir(parents=True, exist_ok=True)
        manifest = {"model_id": self.model_id, "request_id": rid, "weights_seq": self.weights_seq}
        await write_dir(final, fill, manifest, durable=True)
        return done

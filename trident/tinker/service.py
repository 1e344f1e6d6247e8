"""The training service's state behind the HTTP layer: sessions, models, request futures, and
the exactly-once rules that make a crash invisible to clients (issue #51).

A training request is journaled (fsync) before ``submit`` returns its id (``journal``), then run
by its model's executor strictly in seq order (``scheduler``). Its result is stored durably as
soon as it has run, and after every ``snapshot_every``-th ``optim_step`` the model's trainer
state is snapshotted, after that step's result is stored (rule 4). The first request of a model
(``create_model``, or ``load_weights`` addressed by session) loads it in the background, so the
POST answers at once.

Restart (``start`` on a state directory a previous process left, however it ended): each model
of an unfinished session is rebuilt from its newest snapshot, or from its first request if it
has none, and the journaled requests after the snapshot are queued again in seq order; their
results reach whoever polls, as the first run's would have. Requests already answered keep the
answer that was stored first. A model is known to ``model_info`` from the moment its load
begins. Nothing is deleted unasked: a finished session's models are unloaded, and their files
stay for the weights they saved.

Sampling (``sampling``, when the service has rollout servers): an unnamed
``save_weights_for_sampler`` is a verified push; ``create_sampling_session``, ``sampler_info``
and ``asample`` are ``Sampling``'s; a model of another base model than the servers' is refused
at creation. After a restart, the model the servers held last is replayed and its weights
pushed again before any sample runs (rule 6).

Deliberate simplifications: one process; the journal is never compacted (a long run's journal
holds every ``forward_backward`` body it received); a heartbeat is not required (rule 10:
missed heartbeats must not unload what a restart would want back).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trident.tinker.journal import (
    CREATE_KINDS,
    Journal,
    OpRecord,
    RequestConflict,
    Result,
    ResultStore,
    error,
    model_id_of,
    request_id,
)
from trident.tinker.models import (
    SCHEME,
    Origin,
    TrainedModel,
    TrainerFactory,
    UserError,
    fields,
    model_dir,
    origin_of,
    resolve,
)
from trident.tinker.sampling import ExpiredSample, Sampling
from trident.tinker.scheduler import Futures, ModelExecutor, Queued
from trident.tinker.snapshots import Snapshots
from trident.tinker.wire import SampleCall
from trident.weights.faults import fault_point

KINDS = (
    *CREATE_KINDS,
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
)

__all__ = [
    "ExpiredRequest",
    "Op",
    "RequestConflict",
    "Result",
    "ServiceSettings",
    "TinkerService",
    "UnknownRequest",
    "model_id_of",
]


class UnknownRequest(Exception):
    """A request id this service never issued (HTTP 404)."""


class ExpiredRequest(Exception):
    """A request id issued before a restart whose work is gone, e.g. a sample (HTTP 410)."""


@dataclass(frozen=True)
class Op:
    """One training request as received. ``args`` is the codec's decoding of ``body``:
    ``forward_backward`` an object with ``data`` (``Datum``s), ``loss_fn``,
    ``loss_fn_config``, ``forward_only``; ``optim_step`` ``AdamParams``; the others the JSON
    body (a dict or the SDK's request model)."""

    kind: str
    model_id: str  # create_model / create-via-load: model_id_of(session_id, model_seq_id)
    seq_id: int  # the client's; 0 for a model's first request
    body: bytes  # raw, as received: journaled, its sha256 is the dedup digest
    args: Any


@dataclass(frozen=True)
class ServiceSettings:
    state_dir: Path
    models: Mapping[str, str] = field(default_factory=dict)  # served name -> local path
    snapshot_every: int = 1  # optim_steps between snapshots: the most replay a restart does
    gap_timeout_s: float = 300.0  # the SDK's own POST retry window


class TinkerService:
    """Sessions, models and futures (module docstring). ``await start()`` when serving begins
    (replay starts then rather than at the first request) and ``await close()`` after;
    ``decode(kind, body)`` is the codec's (``wire.decode_call(...).args``), used for replay."""

    def __init__(
        self,
        settings: ServiceSettings,
        make_trainer: TrainerFactory,
        decode: Callable[[str, bytes], Any],
        sampling: Sampling | None = None,
    ) -> None:
        self.settings = settings
        self._make_trainer = make_trainer
        self._decode = decode
        state = settings.state_dir
        self.journal = Journal(state / "journal.log")
        self.results = ResultStore(state / "results")
        self.models: dict[str, TrainedModel] = {}
        self._executors: dict[str, ModelExecutor] = {}
        self._futures = Futures()
        self._refused: dict[str, Result] = {}  # answered at once, never journaled
        self._unloading: set[asyncio.Task[None]] = set()  # unloads and re-pushes
        self._started = False
        self.sampling = sampling
        # the model the servers held before a restart, and the seq after which its weights
        # are pushed again (-1: right after its restore)
        self._repush: tuple[str, int] | None = None
        self._replayed: set[str] = set()  # requests journaled before this process started
        self._served_last = sampling.open(self.journal, self.models, state) if sampling else ""

    # -- sessions ---------------------------------------------------------------------------

    def client_config(self) -> dict[str, Any]:
        """Flags for ``client/config``: the SDK's defaults (chunks posted concurrently, which
        the executors reorder), with plain httpx for loopback robustness."""
        return {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True}

    def create_session(self, body: dict[str, Any]) -> str:
        session_id = uuid.uuid4().hex
        self.journal.record_session(session_id, json.dumps(body).encode())
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        return self.journal.sessions.get(session_id) is False

    def finish_session(self, session_id: str) -> None:
        """Unload the session's models; their results and saved weights stay."""
        if self.journal.sessions.get(session_id) is not False:
            return
        self.journal.record_session_end(session_id)
        self._background(self._unload(session_id))

    def model_info(self, model_id: str) -> dict[str, Any]:
        """``model_id``, ``base_model``, ``is_lora``, ``lora_rank``, ``tokenizer_id``, ``arch``,
        ``user_metadata``; raises ``KeyError`` for a model not loaded (yet)."""
        model = self.models.get(model_id)
        if model is None:
            raise KeyError(f"no model {model_id!r} is loaded")
        return model.info()

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> None:
        """Delete ``weights/<name>`` or ``sampler_weights/<name>`` of a model (the cookbook's
        rolling checkpoints). Refused for the weights a loaded model was created from while it
        has no snapshot: a restart would replay from them. A ``save_weights`` that a restart
        replays writes its checkpoint again."""
        place, _, name = checkpoint_id.partition("/")
        if place not in ("weights", "sampler_weights"):
            raise UserError(f"not a checkpoint id: {checkpoint_id!r}")
        path = resolve(self.settings.state_dir, f"{SCHEME}{model_id}/{checkpoint_id}", place)
        for model in self.models.values():
            if model.origin.load_path == path and model.snapshots.newest() is None:
                raise UserError(
                    f"{checkpoint_id} of {model_id} is where model {model.model_id} started, "
                    "and it has no snapshot yet: a restart would need it"
                )
        shutil.rmtree(path)

    # -- sampling ---------------------------------------------------------------------------

    def _sampling(self) -> Sampling:
        if self.sampling is None:
            raise UserError("this service has no rollout servers to sample from")
        return self.sampling

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        """A sampling session on ``model_path`` (saved sampler weights) or ``base_model``."""
        sampling = self._sampling()
        name = body.get("base_model")
        if not body.get("model_path") and not sampling.serves(
            self.settings.models.get(str(name), str(name))
        ):
            raise UserError(f"base_model {name!r} is not the model the rollout servers serve")
        return sampling.create_sampling_session(body)

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        return self._sampling().sampler_info(sampler_id)

    async def asample(self, call: SampleCall) -> tuple[str, list[str]]:
        await self.start()
        return await self._sampling().asample(call)

    # -- requests ---------------------------------------------------------------------------

    async def submit(self, op: Op) -> str:
        """Journal ``op`` (fsync) and queue it; its request id. A repeat gets the same id; the
        same id with another body raises ``RequestConflict``. A request that cannot belong to
        a model's sequence is answered with an error at once and not journaled."""
        await self.start()
        why = self._refusal(op)
        if why is not None:
            rid = f"refused-{uuid.uuid4().hex}"
            self._refused[rid] = error(why)
            return rid
        rid, new = self.journal.record_op(op.kind, op.model_id, op.seq_id, op.body)
        if new:
            if op.seq_id == 0:
                self._executors[op.model_id] = self._executor(op.model_id, 0)
                self._executors[op.model_id].start()
            self._futures.expect(rid)
            queued = Queued(rid, op.seq_id, op.kind, op.args, time.monotonic())
            self._executors[op.model_id].put(queued)
        return rid

    async def result(self, request_id: str, timeout_s: float) -> Result | None:
        """The request's result, or None if it is not ready within ``timeout_s`` (poll again).
        Raises ``UnknownRequest`` for an id this service never issued."""
        await self.start()
        if request_id in self._refused:
            return self._refused[request_id]
        if Sampling.is_sample(request_id):
            if self.sampling is None:
                raise UnknownRequest(f"unknown request id {request_id!r}")
            try:
                return await self.sampling.result(request_id, timeout_s)
            except ExpiredSample:
                raise ExpiredRequest(f"sample {request_id} is gone (a restart)") from None
        stored = self.results.get(request_id)
        if stored is not None:
            return stored
        if self._futures.knows(request_id):
            return await self._futures.wait(request_id, timeout_s)
        if request_id in self.journal.ops:  # resolved between the two looks above
            return self.results.get(request_id)
        raise UnknownRequest(f"unknown request id {request_id!r}")

    def _refusal(self, op: Op) -> str | None:
        if op.kind not in KINDS:
            return f"unknown request kind {op.kind!r}"
        session_id = op.model_id.rsplit(":train:", 1)[0]
        if op.seq_id == 0 and op.kind in CREATE_KINDS:
            if self.journal.sessions.get(session_id) is not False:
                return f"session {session_id!r} is unknown or finished"
            return None
        if op.seq_id < 1:
            return f"seq_id must be 1 or more for {op.kind}, got {op.seq_id}"
        if request_id(op.model_id, 0) not in self.journal.ops:
            return f"unknown model {op.model_id!r}"
        if self.journal.sessions.get(session_id) is not False:
            return f"model {op.model_id!r} belongs to a finished session"
        return None

    # -- running ----------------------------------------------------------------------------

    def _executor(self, model_id: str, next_seq: int) -> ModelExecutor:
        """A model's executor, not started yet."""

        async def apply(item: Queued) -> None:
            await self._apply(model_id, item)

        def on_gap(held: list[Queued], missing: int) -> None:
            seqs = [item.seq_id for item in held]
            why = (
                f"seq {missing} of model {model_id} did not arrive within "
                f"{self.settings.gap_timeout_s:g} s, so seqs {seqs} waiting behind it never ran"
            )
            for item in held:
                self.journal.record_skip(item.request_id)
                self._deliver(item.request_id, error(why))
            if self._repush is not None and self._repush[0] == model_id:  # its seq never runs
                self._background(self._resume_serving(self.models.get(model_id)))

        return ModelExecutor(model_id, next_seq, apply, on_gap, self.settings.gap_timeout_s)

    async def _apply(self, model_id: str, item: Queued) -> None:
        model = self.models.get(model_id)
        if item.seq_id == 0:
            result = await self._create(model_id, item)
            model = self.models.get(model_id)
        elif model is None:
            result = error(f"model {model_id} failed to load; nothing can run on it")
        else:
            model.replaying = item.request_id in self._replayed
            result = await model.run(item.kind, item.args, item.request_id, item.seq_id)
        self._deliver(item.request_id, result)
        if self._repush == (model_id, item.seq_id):
            await self._resume_serving(model)
        if item.kind == "forward_backward":  # a test's kill between a step's two halves
            fault_point("tinker_forward_backward", [model_id])
        every = self.settings.snapshot_every
        if (
            item.kind == "optim_step"
            and result.kind != "error"
            and model is not None
            and model.optim_steps % every == 0
        ):
            await self._snapshot(model, item.seq_id)

    async def _create(self, model_id: str, item: Queued) -> Result:
        """A model's first request: load it (and its saved weights, for create-via-load)."""
        try:
            origin = self._origin(item.kind, item.args)
            if self.sampling is not None:
                self.sampling.check_model(origin.base_model, origin.base_path, origin.lora)
            model = self.models[model_id] = self._model(model_id, origin)
            await model.build(self._make_trainer)
            if origin.load_path is not None:
                trainer = model.live()
                await trainer.load_state(str(origin.load_path / "trainer"), origin.optimizer)
        except (UserError, ValueError, KeyError, OSError) as exc:
            return self._failed(model_id, error(f"{item.kind}: {exc}"))
        except Exception as exc:
            return self._failed(
                model_id, error(f"{item.kind}: {type(exc).__name__}: {exc}", "server")
            )
        if item.kind == "load_weights":
            uri = fields(item.args)["path"]
            return Result("json", {"model_id": model_id, "path": uri, "type": "load_weights"})
        return Result("json", {"model_id": model_id, "type": "create_model"})

    def _model(self, model_id: str, origin: Origin) -> TrainedModel:
        publish = self.sampling.publish if self.sampling is not None else None
        return TrainedModel(model_id, origin, self.settings.state_dir, publish)

    async def _resume_serving(self, model: TrainedModel | None) -> None:
        """Rule 6: the replayed model's weights back on the servers before any sample."""
        self._repush = None
        assert self.sampling is not None  # only set with sampling
        try:
            if await self.sampling.resume(model):
                assert model is not None  # pushed
                print(
                    f"tinker: the weights of {model.model_id} at seq {model.weights_seq} pushed "
                    "again after the restart (verified)",
                    file=sys.stderr,
                    flush=True,
                )
        except Exception as exc:  # its sessions' samples are refused as stale: say why
            print(f"tinker: re-pushing the weights after a restart failed: {exc}", file=sys.stderr)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._unloading.add(task)  # awaited by close()
        task.add_done_callback(self._unloading.discard)

    def _failed(self, model_id: str, result: Result) -> Result:
        """A model that did not load: nothing runs on it, and get_info does not know it."""
        self.models.pop(model_id, None)
        return result

    def _origin(self, kind: str, args: Any) -> Origin:
        state = self.settings
        return origin_of(kind, args, state.models, state.state_dir)

    async def _snapshot(self, model: TrainedModel, seq_id: int) -> None:
        """Commit a snapshot; a failure (a full disk) costs only a longer replay."""
        try:
            await model.snapshot(seq_id)
        except Exception as exc:
            print(
                f"tinker: snapshot of {model.model_id} at seq {seq_id} failed ({exc}); the "
                "journal still holds every request, so a restart replays further",
                file=sys.stderr,
                flush=True,
            )

    def _deliver(self, rid: str, result: Result) -> None:
        """Store the result (the first stored wins: a replay never changes an answer), then
        wake the pollers."""
        if not self.results.put(rid, result) and self._futures.knows(rid):
            result = self.results.get(rid) or result
        self._futures.resolve(rid, result)

    # -- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild every model of an unfinished session and queue its journaled requests after
        its newest snapshot (module docstring); returns at once, replay runs behind. Called by
        the first ``submit`` or ``result`` if not before; later calls do nothing."""
        if self._started:
            return
        self._started = True
        by_model: dict[str, list[OpRecord]] = {}
        for op in self.journal.ops.values():
            by_model.setdefault(op.model_id, []).append(op)
        for model_id, ops in by_model.items():
            ops.sort(key=lambda op: op.seq_id)
            session_id = model_id.rsplit(":train:", 1)[0]
            if self.journal.sessions.get(session_id) is not False or ops[0].seq_id != 0:
                for op in ops:
                    if not self.results.has(op.request_id):
                        self._deliver(op.request_id, error("the model's session finished"))
                continue
            self._resume(model_id, ops)
        if self.sampling is not None and self._served_last and self._repush is None:
            self._background(self._resume_serving(None))  # its model is not restored

    def _resume(self, model_id: str, ops: list[OpRecord]) -> None:
        newest = Snapshots(model_dir(self.settings.state_dir, model_id) / "snapshots").newest()
        last = newest[1]["last_seq"] if newest is not None else -1
        if model_id == self._served_last:  # re-pushed once its last journaled request ran
            ran = [op.seq_id for op in ops if op.request_id not in self.journal.skipped]
            self._repush = (model_id, max(last, ran[-1]))
        executor = self._executors[model_id] = self._executor(model_id, last + 1)
        for op in ops:
            if op.request_id in self.journal.skipped:
                executor.skip(op.seq_id)
                self._deliver(op.request_id, error("never ran: a seq gap timed out"))
            elif op.seq_id > last:
                if not self.results.has(op.request_id):
                    self._futures.expect(op.request_id)
                try:
                    args = self._decode(op.kind, self.journal.body(op.request_id))
                except Exception as exc:  # a codec that changed under a journal: refuse to guess
                    raise RuntimeError(
                        f"journaled request {op.request_id} ({op.kind}) no longer decodes: {exc}"
                    ) from exc
                self._replayed.add(op.request_id)
                executor.put(Queued(op.request_id, op.seq_id, op.kind, args, time.monotonic()))
        if newest is None:
            executor.start()  # from the first request, which is queued
            return
        snapshot, manifest = newest
        origin = Origin.from_record(manifest["origin"])
        model = self.models[model_id] = self._model(model_id, origin)

        async def restore() -> None:
            try:
                await model.build(self._make_trainer)
                await model.restore(snapshot, manifest)
            except Exception as exc:  # the model stays unloaded: its requests answer an error
                self.models.pop(model_id, None)
                print(f"tinker: cannot restore {model_id} from {snapshot}: {exc}", file=sys.stderr)
            if self._repush == (model_id, last):  # nothing journaled after the snapshot
                await self._resume_serving(self.models.get(model_id))

        executor.start(restore)

    async def _unload(self, session_id: str) -> None:
        prefix = f"{session_id}:train:"
        for model_id in [m for m in self._executors if m.startswith(prefix)]:
            await self._executors.pop(model_id).stop()
            model = self.models.pop(model_id, None)
            if model is not None and model.trainer is not None:
                await model.trainer.close()
        for rid in self._futures.pending():
            if rid.startswith(prefix):
                self._deliver(rid, error("the model's session finished"))

    async def close(self) -> None:
        """Stop the executors and close the trainers (a crash skips this; nothing depends on
        it but tidiness)."""
        await asyncio.gather(*self._unloading, return_exceptions=True)
        for executor in self._executors.values():
            await executor.stop()
        for model in self.models.values():
            if model.trainer is not None:
                await model.trainer.close()
        self._executors.clear()
        self.models.clear()
        self.journal.close()

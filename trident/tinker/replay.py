"""A model's whole journal replayed from its origin on a fresh trainer: the check that a service
which crashed and restarted applied every training request exactly once.

The journal holds every training request a model received, in seq order and each once
(``journal``). Rebuilding the model from its first request (a base model, or saved weights) and
applying its ``forward_backward``, ``optim_step`` and legacy ``load_weights`` requests in that
order, on a trainer built as the service's was, must give the service's final state: bitwise on
CPU under ``run.deterministic`` with the same thread and rank counts (``models``). Saves only read
a trainer's state, so they are not replayed, and nothing is written under the state directory.
Requests failed without running (a seq gap that never filled) are passed over, as the service
passed them.

The service must have stopped: the journal is opened as its owner would open it (locked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from trident.tinker.journal import Journal
from trident.tinker.models import TrainedModel, TrainerFactory, origin_of
from trident.train.tinker_ops import Trainer

# the requests that change a trainer's state
STATEFUL = ("forward_backward", "optim_step", "load_weights")


async def replay(
    state_dir: Path,
    model_id: str,
    make_trainer: TrainerFactory,
    decode: Callable[[str, bytes], Any],
    served: Mapping[str, str] | None = None,
) -> Trainer:
    """A new trainer on which every journaled request of ``model_id`` that changes state has
    run, in seq order. ``make_trainer`` and ``decode`` as the service's; ``served`` its model
    names (``tinker.models``). Raises ``ValueError`` if a replayed request fails (the service
    would have answered the same failure, so a journal of such requests is not a clean run)."""
    journal = Journal(state_dir / "journal.log")
    try:
        ops = sorted(
            (o for o in journal.ops.values() if o.model_id == model_id),
            key=lambda o: o.seq_id,
        )
        if not ops or ops[0].seq_id != 0:
            raise ValueError(f"the journal in {state_dir} has no first request of {model_id}")
        first = ops[0]
        args = decode(first.kind, journal.body(first.request_id))
        origin = origin_of(first.kind, args, served or {}, state_dir)
        model = TrainedModel(model_id, origin, state_dir)
        await model.build(make_trainer)
        trainer = model.live()
        if origin.load_path is not None:
            await trainer.load_state(str(origin.load_path / "trainer"), origin.optimizer)
        for op in ops[1:]:
            if op.kind not in STATEFUL or op.request_id in journal.skipped:
                continue
            args = decode(op.kind, journal.body(op.request_id))
            result = await model.run(op.kind, args, op.request_id, op.seq_id)
            if result.kind == "error":
                raise ValueError(f"replayed {op.request_id} ({op.kind}) failed: {result.payload}")
        return trainer
    finally:
        journal.close()


def state_files(trainer_dir: Path) -> dict[str, bytes]:
    """Every file of a trainer's saved state by its relative path, but torch.distributed
    .checkpoint's ``.metadata`` (it names each save by a random id): two saves of one state
    compare equal as these dicts."""
    files = [p for p in trainer_dir.rglob("*") if p.is_file() and p.name != ".metadata"]
    return {str(p.relative_to(trainer_dir)): p.read_bytes() for p in files}

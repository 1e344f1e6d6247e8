"""Exactly once across retries, reordering and crashes (issue #51): the training service's
journal, scheduler, snapshots and replay, driven through ``TinkerService`` as the HTTP layer
drives it.

Most tests use a small real torch model with AdamW and dropout (so the RNG matters) behind
trident's ``Trainer`` seam; the crash tests also run on trident's own ``local_trainer`` and the
tiny checkpoint. A crash is the service's event loop ending mid-sequence without ``close``
(every task cancelled where it stood, files left as they were), or a real SIGKILL of the
process, at a point a fault injected into the trainer picks. The restarted service must end on
the state of a run that never crashed, bitwise (weights, Adam moments, RNG), and answer every
request as that run did.
"""

from __future__ import annotations

import asyncio
import functools
import io
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from trident.config import load_config
from trident.tinker.journal import Journal, model_id_of
from trident.tinker.models import UserError
from trident.tinker.replay import state_files
from trident.tinker.service import (
    Op,
    RequestConflict,
    ServiceSettings,
    TinkerService,
    UnknownRequest,
)
from trident.train.datum import AdamParams, Datum, LoraShape
from trident.train.tinker_ops import local_trainer

VOCAB = 64
MARK = 32  # the first token of a forward_backward's first datum is MARK + its data's seq


class TinyTrainer:
    """The ``Trainer`` protocol on a real two-layer torch model (embedding, dropout, linear)
    with AdamW and Tinker's sum-semantics cross entropy. ``log`` records what ran, in order."""

    log: list[str]

    def __init__(self, base_path: str, lora: LoraShape | None) -> None:
        torch.manual_seed(0)
        self.lora = lora
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, VOCAB)
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.log = []

    async def forward_backward(
        self, data: list[Datum], loss_fn: str, loss_fn_config: dict[str, float], forward_only: bool
    ) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        if loss_fn != "cross_entropy":
            raise ValueError(f"unknown loss {loss_fn}")
        self.log.append(f"fb{int(data[0].input_tokens[0]) - MARK}")
        outputs, total = [], torch.zeros(())
        for datum in data:
            logits = self.model(datum.input_tokens)
            logprobs = logits.log_softmax(-1).gather(
                -1, datum.loss_inputs["target_tokens"][:, None]
            )[:, 0]
            loss = -(logprobs * datum.loss_inputs["weights"])
            total = total + loss.sum()
            outputs.append({"logprobs": logprobs.detach(), "elementwise_loss": loss.detach()})
        if not forward_only:
            total.backward()
        return outputs, {"loss:sum": total.item()}

    async def optim_step(self, adam: AdamParams) -> dict[str, float]:
        self.log.append("optim")
        for group in self.opt.param_groups:
            group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps)
            group.update(weight_decay=adam.weight_decay)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), float("inf"))
        self.opt.step()
        self.opt.zero_grad()
        return {"grad_norm": norm.item()}

    async def save_state(self, out_dir: str) -> None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        state = {
            "model": self.model.state_dict(),
            "optim": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
        }
        torch.save(state, Path(out_dir) / "state.pt")

    async def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        state = torch.load(Path(ckpt_dir) / "state.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        if optimizer:
            self.opt.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])

    async def save_hf(self, out_dir: str) -> str:
        torch.save(self.model.state_dict(), Path(out_dir) / "model.pt")
        return out_dir

    async def close(self) -> None:
        pass


class Crash:
    """Fault injection around a trainer: at the ``at``-th call of method ``method`` the process
    dies (SIGKILL, ``kill``) or the call never returns (the event loop then ends under it)."""

    def __init__(self, inner: Any, method: str, at: int, kill: bool = False) -> None:
        self.inner, self.method, self.at, self.kill, self.calls = inner, method, at, kill, 0

    async def _fault(self, method: str) -> None:
        if method == self.method:
            self.calls += 1
            if self.calls == self.at and self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.calls == self.at:
                await asyncio.Event().wait()

    async def forward_backward(self, *args: Any) -> Any:
        await self._fault("forward_backward")
        return await self.inner.forward_backward(*args)

    async def optim_step(self, adam: AdamParams) -> dict[str, float]:
        await self._fault("optim_step")
        return await self.inner.optim_step(adam)

    async def save_state(self, out_dir: str) -> None:
        await self.inner.save_state(out_dir)  # the files are written, the manifest is not
        await self._fault("save_state")

    async def load_state(self, ckpt_dir: str, optimizer: bool) -> None:
        await self.inner.load_state(ckpt_dir, optimizer)

    async def save_hf(self, out_dir: str) -> str:
        return await self.inner.save_hf(out_dir)

    async def close(self) -> None:
        await self.inner.close()


# -- the codec's part, for this test: JSON bodies --------------------------------------------


@dataclass(frozen=True)
class ForwardBackward:
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float]
    forward_only: bool


def decode(kind: str, body: bytes) -> Any:
    fields = json.loads(body)
    if kind == "forward_backward":
        data = [
            Datum(
                torch.tensor(d["tokens"]),
                {
                    "target_tokens": torch.tensor(d["targets"]),
                    "weights": torch.tensor(d["weights"]),
                },
            )
            for d in fields["data"]
        ]
        config = fields["loss_fn_config"]
        return ForwardBackward(data, fields["loss_fn"], config, fields["forward_only"])
    if kind == "optim_step":
        return AdamParams(**fields["adam_params"])
    if fields.get("lora"):
        fields["lora"] = LoraShape(**fields["lora"])
    return fields


def op(kind: str, model_id: str, seq_id: int, **fields: Any) -> Op:
    body = json.dumps({"model_id": model_id, "seq_id": seq_id, **fields}).encode()
    return Op(kind, model_id, seq_id, body, decode(kind, body))


def fb_op(model_id: str, seq_id: int, salt: int = 0, data_seq: int | None = None) -> Op:
    tag = data_seq or seq_id
    gen = torch.Generator().manual_seed(tag * 7 + salt)
    data = []
    for _ in range(2):
        tokens = torch.randint(0, MARK, (6,), generator=gen).tolist()
        data.append({"tokens": tokens, "targets": tokens[1:] + [0], "weights": [0.2] * 6})
    data[0]["tokens"][0] = MARK + tag
    return op(
        "forward_backward", model_id, seq_id, data=data, loss_fn="cross_entropy",
        loss_fn_config={}, forward_only=False,
    )  # fmt: skip


def optim_op(model_id: str, seq_id: int) -> Op:
    adam = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    return op("optim_step", model_id, seq_id, adam_params=adam)


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "base"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["TinyForCausalLM"]}))
    return path


def service(state: Path, base: Path, factory: Any = TinyTrainer, **kw: Any) -> TinkerService:
    settings = ServiceSettings(state_dir=state, models={"tiny": str(base)}, **kw)
    return TinkerService(settings, factory, decode)


async def new_model(svc: TinkerService, lora: dict[str, Any] | None = None) -> str:
    session = svc.create_session({"tags": []})
    model_id = model_id_of(session, 0)
    rid = await svc.submit(op("create_model", model_id, 0, base_model="tiny", lora=lora))
    assert (await svc.result(rid, 30)).payload["model_id"] == model_id
    return model_id


async def ready(svc: TinkerService, rid: str) -> Any:
    result = await svc.result(rid, 30)
    assert result is not None and result.kind != "error", result
    return result.payload


# -- retries, conflicts, order ---------------------------------------------------------------


def test_a_repeated_request_runs_once_and_another_payload_under_its_id_is_refused(tmp_path, base):
    async def main() -> None:
        svc = service(tmp_path / "state", base)
        await svc.start()
        model_id = await new_model(svc)
        first = await svc.submit(fb_op(model_id, 1))
        assert await svc.submit(fb_op(model_id, 1)) == first  # the SDK's retry: same future
        with pytest.raises(RequestConflict):
            await svc.submit(fb_op(model_id, 1, salt=1))
        outputs, metrics = await ready(svc, first)
        assert len(outputs) == 2 and metrics["loss:sum"] > 0
        assert await svc.submit(fb_op(model_id, 1)) == first  # and after it ran
        await ready(svc, await svc.submit(optim_op(model_id, 2)))
        assert svc.models[model_id].live().log == ["fb1", "optim"]
        with pytest.raises(UnknownRequest):
            await svc.result(f"{model_id}#9", 0.01)
        session = model_id.split(":")[0]
        assert svc.heartbeat(session)
        svc.finish_session(session)
        assert not svc.heartbeat(session)
        late = await svc.result(await svc.submit(fb_op(model_id, 3)), 1)
        assert late is not None and late.kind == "error"
        await svc.close()

    asyncio.run(main())


def test_create_model_answers_before_the_model_has_loaded(tmp_path, base):
    loaded = threading.Event()

    def slow_load(path: str, lora: LoraShape | None) -> TinyTrainer:
        assert loaded.wait(30)  # a model load that takes longer than the POST may
        return TinyTrainer(path, lora)

    async def main() -> None:
        svc = service(tmp_path / "state", base, slow_load)
        model_id = model_id_of(svc.create_session({}), 0)
        rid = await svc.submit(op("create_model", model_id, 0, base_model="tiny", lora=None))
        first = await svc.submit(fb_op(model_id, 1))  # queued behind the load
        assert await svc.result(rid, 0.05) is None  # the POST was answered; the load goes on
        loaded.set()
        assert (await ready(svc, rid))["model_id"] == model_id
        await ready(svc, first)
        await svc.close()

    asyncio.run(main())


def test_chunks_arriving_2_3_1_are_applied_1_2_3(tmp_path, base):
    async def main() -> None:
        svc = service(tmp_path / "state", base)
        await svc.start()
        model_id = await new_model(svc)
        second = await svc.submit(fb_op(model_id, 2))
        third = await svc.submit(fb_op(model_id, 3))
        assert await svc.result(second, 0.05) is None  # held behind seq 1: "not yet" (408)
        first = await svc.submit(fb_op(model_id, 1))
        for rid in (first, second, third):
            await ready(svc, rid)
        assert svc.models[model_id].live().log == ["fb1", "fb2", "fb3"]
        await svc.close()

    asyncio.run(main())


def test_a_gap_that_never_fills_fails_the_requests_behind_it(tmp_path, base):
    async def main() -> None:
        svc = service(tmp_path / "state", base, gap_timeout_s=0.2)
        await svc.start()
        model_id = await new_model(svc)
        held = await svc.submit(fb_op(model_id, 2))
        failed = await svc.result(held, 5)
        assert failed is not None and failed.kind == "error"
        assert "seq 1" in failed.payload["error"]
        await ready(svc, await svc.submit(fb_op(model_id, 1)))  # the late seq 1 still runs
        await ready(svc, await svc.submit(fb_op(model_id, 3)))  # 2 is passed over
        assert svc.models[model_id].live().log == ["fb1", "fb3"]
        await svc.close()

    asyncio.run(main())


def test_a_torn_last_record_is_dropped_on_open(tmp_path):
    path = tmp_path / "journal.log"
    journal = Journal(path)
    journal.record_session("s", b"{}")
    journal.record_sampler("s:sample:0", b"sampler")
    for seq in range(3):
        journal.record_op("forward_backward", "s:train:0", seq, b"body%d" % seq)
    journal.close()
    whole = path.read_bytes()
    for torn in (whole[:-3], whole[:-3] + b"xyz!"):  # cut short; corrupt in its last bytes
        path.write_bytes(torn)
        reopened = Journal(path)
        assert sorted(o.seq_id for o in reopened.ops.values()) == [0, 1]
        assert reopened.sessions == {"s": False}
        assert reopened.samplers() == {"s:sample:0": b"sampler"}
        assert reopened.body("s:train:0#1") == b"body1"
        assert reopened.record_op("forward_backward", "s:train:0", 2, b"body2")[1]  # new again
        reopened.close()
        assert Journal(path).body("s:train:0#2") == b"body2"


def saved_state(svc: TinkerService, uri: str) -> dict[str, Any]:
    model_id, _, name = uri.removeprefix("tinker://").rpartition("/weights/")
    place = svc.settings.state_dir / "models" / model_id.replace(":", "%3A") / "weights" / name
    return torch.load(place / "trainer" / "state.pt", weights_only=True)


def test_a_model_created_from_saved_weights_continues_bitwise(tmp_path, base):
    async def main() -> None:
        svc = service(tmp_path / "state", base)
        await svc.start()
        model_id = await new_model(svc, lora={"rank": 4, "alpha": 8.0})
        await run_steps(svc, model_id, range(2))
        half = await ready(svc, await svc.submit(op("save_weights", model_id, 7, path="half")))
        for o in (fb_op(model_id, 8), fb_op(model_id, 9), optim_op(model_id, 10)):
            await ready(svc, await svc.submit(o))
        end = await ready(svc, await svc.submit(op("save_weights", model_id, 11, path="end")))
        taken = await svc.result(await svc.submit(op("save_weights", model_id, 12, path="end")), 5)
        assert taken is not None and taken.kind == "error"  # a name is not silently replaced
        snapshots = svc.settings.state_dir / "models" / model_id.replace(":", "%3A") / "snapshots"
        assert sorted(p.name for p in snapshots.iterdir()) == ["seq_10", "seq_6"]  # keep 2

        async def from_state(optimizer: bool) -> str:
            loaded = model_id_of(svc.create_session({}), 0)
            body = {"path": half["path"], "optimizer": optimizer}
            answer = await ready(svc, await svc.submit(op("load_weights", loaded, 0, **body)))
            assert answer == {"model_id": loaded, "path": half["path"], "type": "load_weights"}
            return loaded

        resumed = await from_state(optimizer=True)
        for o in (fb_op(resumed, 1, data_seq=8), fb_op(resumed, 2, data_seq=9)):
            await ready(svc, await svc.submit(o))
        await ready(svc, await svc.submit(optim_op(resumed, 3)))
        again = await ready(svc, await svc.submit(op("save_weights", resumed, 4, path="end")))
        assert_bitwise(saved_state(svc, again["path"]), saved_state(svc, end["path"]))

        fresh = await from_state(optimizer=False)  # weights only: no Adam moments
        plain = await ready(svc, await svc.submit(op("save_weights", fresh, 1, path="w")))
        await ready(svc, await svc.submit(fb_op(fresh, 2, data_seq=8)))
        assert_bitwise(
            saved_state(svc, plain["path"])["model"], saved_state(svc, half["path"])["model"]
        )
        assert saved_state(svc, plain["path"])["optim"]["state"] == {}
        info = svc.model_info(resumed)
        assert svc.models[resumed].live().lora == LoraShape(rank=4, alpha=8.0)  # as saved
        assert info["arch"] == "TinyForCausalLM" and info["is_lora"] and info["lora_rank"] == 4
        assert info["base_model"] == "tiny" and info["tokenizer_id"] == str(base)

        with pytest.raises(UserError):  # ``fresh`` has no snapshot: a restart replays from it
            svc.delete_checkpoint(model_id, "weights/half")
        await ready(svc, await svc.submit(optim_op(fresh, 3)))
        # its snapshot follows the step, before the next request runs
        await ready(svc, await svc.submit(op("save_weights", fresh, 4, path="w2")))
        svc.delete_checkpoint(model_id, "weights/half")  # now a snapshot of ``fresh`` exists
        assert not (snapshots.parent / "weights" / "half").exists()
        await svc.close()
        svc = service(tmp_path / "state", base)  # a restart: from the snapshot, not from "half"
        await svc.start()
        assert svc.model_info(fresh)["lora_rank"] == 4  # known while it restores
        await ready(svc, await svc.submit(fb_op(fresh, 5)))

        missing = model_id_of(svc.create_session({}), 0)
        body = {"path": f"tinker://{model_id}/weights/nope", "optimizer": True}
        refused = await svc.result(await svc.submit(op("load_weights", missing, 0, **body)), 5)
        assert refused is not None and refused.payload["category"] == "user"
        await svc.close()

    asyncio.run(main())


def test_a_second_process_cannot_open_a_journal_in_use(tmp_path):
    path = tmp_path / "journal.log"
    path.touch()
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'ab'); fcntl.lockf(f, fcntl.LOCK_EX)"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"{hold}; print(flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline()  # it holds the lock
        with pytest.raises(RuntimeError, match="in use by another process"):
            Journal(path)
    finally:
        holder.kill()
        holder.wait()
    Journal(path).close()  # the lock went with the process


# -- crash and restart -----------------------------------------------------------------------

STEPS = 4  # each: two forward_backward chunks (posted second first), then optim_step


def step_ops(model_id: str, step: int) -> list[Op]:
    seq = 3 * step + 1
    return [fb_op(model_id, seq + 1), fb_op(model_id, seq), optim_op(model_id, seq + 2)]


async def run_steps(svc: TinkerService, model_id: str, steps: range) -> list[Any]:
    results = []
    for step in steps:
        rids = [await svc.submit(o) for o in step_ops(model_id, step)]
        results.append([await ready(svc, rid) for rid in rids])
    return results


async def finish(svc: TinkerService, model_id: str) -> dict[str, bytes]:
    """Save the model's state and close; every file of the saved state, by its path
    (``state_files``)."""
    seq = 3 * STEPS + 1
    payload = await ready(svc, await svc.submit(op("save_weights", model_id, seq, path="final")))
    assert payload["path"] == f"tinker://{model_id}/weights/final"
    await svc.close()
    saved = svc.settings.state_dir / "models" / model_id.replace(":", "%3A") / "weights"
    return state_files(saved / "final" / "trainer")


def assert_bitwise(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_bitwise(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_bitwise(x, y)
    else:
        assert a == b


# (method that hangs, its call number, snapshot_every): where the first life dies
CRASHES = {
    "between forward_backward and optim_step": ("optim_step", 3, 2),
    "mid-snapshot": ("save_state", 2, 1),
    "after a snapshot, before the next step": ("forward_backward", 5, 1),
    "no snapshot yet": ("optim_step", 3, 100),
}


async def uninterrupted(state: Path, base: Path, every: int, make: Any) -> tuple[list, dict]:
    svc = service(state, base, make, snapshot_every=every)
    await svc.start()
    model_id = await new_model(svc)
    results = await run_steps(svc, model_id, range(STEPS))
    return results, await finish(svc, model_id)


async def first_life(
    state: Path, base: Path, crash: str, kill: bool, progress: Path, make: Any = TinyTrainer
) -> tuple[str, list[str]]:
    """The client's run until the crash; what it was answered ids for goes to ``progress``."""
    method, at, every = CRASHES[crash]
    faulty = functools.partial(Crash, method=method, at=at, kill=kill)
    svc = service(state, base, lambda p, lora: faulty(make(p, lora)), snapshot_every=every)
    await svc.start()
    model_id = await new_model(svc)
    rids: list[str] = []
    for step in range(STEPS):
        rids += [await svc.submit(o) for o in step_ops(model_id, step)]
        progress.write_text(json.dumps([model_id, rids]))
        if await svc.result(rids[-1], 2) is None:
            break  # the crash point: the loop ends without close
    return model_id, rids


async def second_life(
    state: Path, base: Path, every: int, make: Any, model_id: str, rids: list[str]
) -> tuple[list[Any], dict, list[str] | None]:
    svc = service(state, base, make, snapshot_every=every)
    await svc.start()  # restore the newest snapshot, replay the journal after it
    answered = [await ready(svc, rid) for rid in rids]  # journaled ids wait for the replay
    done = len(rids) // 3
    # the client's retries of what it had not seen answered: the same ids
    assert [await svc.submit(o) for o in step_ops(model_id, done - 1)] == rids[-3:]
    later = await run_steps(svc, model_id, range(done, STEPS))
    log = getattr(svc.models[model_id].live(), "log", None)
    results = [answered[i : i + 3] for i in range(0, len(answered), 3)] + later
    return results, await finish(svc, model_id), log


def check_restart(
    tmp_path: Path, base: Path, crash: str, model_id: str, rids: list[str], make: Any = TinyTrainer
) -> None:
    every = CRASHES[crash][2]
    clean_results, clean = asyncio.run(uninterrupted(tmp_path / "clean", base, every, make))
    assert len(rids) < 3 * STEPS  # the first life did crash
    with open(tmp_path / "state" / "journal.log", "ab") as journal:
        journal.write(b"TKJ1\x99")  # and tore the journal's tail as it died
    second = second_life(tmp_path / "state", base, every, make, model_id, rids)
    results, saved, log = asyncio.run(second)

    assert saved == clean  # every byte of the final weights, Adam moments and RNG
    assert_bitwise(results, clean_results)  # every answer, the replayed ones included
    if log is None:
        return
    state = torch.load(io.BytesIO(saved["state.pt"]), weights_only=True)
    assert int(state["optim"]["state"][0]["step"]) == STEPS  # no optim_step applied twice
    # the second life replayed only what followed its snapshot, in seq order, once each
    assert log.count("optim") == len(log) // 3
    fb = [int(entry[2:]) for entry in log if entry.startswith("fb")]
    assert fb[0] % 3 == 1  # from a step's start: a snapshot follows an optim_step
    assert fb == [seq for seq in range(fb[0], 3 * STEPS + 1) if seq % 3]


@pytest.mark.parametrize("crash", list(CRASHES), ids=list(CRASHES))
def test_a_crash_mid_sequence_ends_on_the_uninterrupted_state_bitwise(tmp_path, base, crash):
    progress = tmp_path / "progress.json"
    model_id, rids = asyncio.run(first_life(tmp_path / "state", base, crash, False, progress))
    check_restart(tmp_path, base, crash, model_id, rids)


def test_a_process_killed_between_forward_backward_and_optim_step_loses_and_repeats_nothing(
    tmp_path, base
):
    crash, progress = "between forward_backward and optim_step", tmp_path / "progress.json"
    args = [str(tmp_path / "state"), str(base), crash, str(progress)]
    proc = subprocess.run([sys.executable, __file__, *args], timeout=300, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    model_id, rids = json.loads(progress.read_text())
    # both lives on one thread, as the killed process runs: a float sum over another number of
    # threads (an earlier test's trainer.cpu_threads) rounds differently
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        check_restart(tmp_path, base, crash, model_id, rids)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("crash", ["between forward_backward and optim_step", "mid-snapshot"])
def test_the_real_trainer_restarts_on_the_uninterrupted_state_bitwise(tmp_path, tiny_model, crash):
    """As above with trident's trainer (``local_trainer``, FSDP2 world size 1, deterministic)
    on the tiny checkpoint: snapshots and saved weights are its DCP files, compared byte for
    byte."""
    overrides = ["trainer.cpu_threads=1", "run.deterministic=true", "telemetry.progress=false"]
    cfg = load_config([], [f"model.path={tiny_model}", *overrides])
    make = functools.partial(local_trainer, cfg=cfg)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        progress, base = tmp_path / "progress.json", Path(tiny_model)
        first = first_life(tmp_path / "state", base, crash, False, progress, make)
        model_id, rids = asyncio.run(first)
        check_restart(tmp_path, base, crash, model_id, rids, make)
    finally:  # run.deterministic switched torch's kernels process-wide
        torch.use_deterministic_algorithms(before)


if __name__ == "__main__":  # the killed process of the test above
    state, base_dir, crash, progress = sys.argv[1:]
    torch.set_num_threads(1)
    asyncio.run(first_life(Path(state), Path(base_dir), crash, True, Path(progress)))

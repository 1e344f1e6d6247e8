"""The Tinker API's sampling side (issue #51): which weights the rollout servers hold, the
verified pushes that change them, the sampling sessions bound to them, and ``asample`` through
trident's ``Router``.

Rules:

- **One weight version per fleet.** The servers hold one model's weights at one point of its
  training, named ``(model_id, weights_seq)`` (``trident.tinker.models``), or the base model
  they started with. A sampling session is bound to one such point; a sample on a session whose
  weights the servers no longer hold is refused with a user error (several adapter versions at
  once are not kept). Under the ``adapter`` backend the base model stays servable beside the
  adapters (requests name the base model); under any other backend a push replaces it.
- **A push** (``publish``, on ``save_weights_for_sampler``) is the trainer's
  ``WeightSender.push`` (every push verified by the probe), then a prefix-cache reset, then the
  weights are named served. It waits for the samples in flight and holds new ones back
  (``_Barrier``), so no sample straddles a push.
- **Samples are reads**: not journaled; each is deduplicated by ``(sampling_session_id,
  seq_id)`` and its result kept in memory. An id of a sample from before a restart is
  ``ExpiredRequest`` (HTTP 410): the SDK resubmits the sample.
- **Restart** (rule 6): the journaled sampling sessions come back, and no sample is served
  until the service has replayed the model the servers held last (the model of the newest
  session: every push journals one) and pushed its current weights again (``resume``). A
  replayed push whose session is journaled ran before the crash and is not pushed again (the
  servers would otherwise end on whichever model's replay came last); one that never ran is
  pushed, and being the newest, ``resume`` then leaves it served.

Simplifications: a sample's result is kept until the process ends; top-k logprobs are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trident.rollout.engine import EngineError, SamplingParams
from trident.rollout.router import Router
from trident.tinker.journal import Journal, Result, error
from trident.tinker.models import TrainedModel, UserError, resolve
from trident.tinker.wire import SampleCall, SampledOutput
from trident.train.atomic import read_manifest
from trident.train.datum import LoraShape

BASE = ("", 0)  # the weights the servers started with: the base model


class ExpiredSample(Exception):
    """A sample id issued before a restart: its work is gone (HTTP 410, the SDK resubmits)."""


@dataclass(frozen=True)
class Binding:
    """What a sampling session samples: a model's weights at ``weights_seq`` (``model_id``
    empty: the base model), and what ``GET samplers/{id}`` answers."""

    model_id: str
    weights_seq: int
    base_model: str
    model_path: str | None = None

    @property
    def weights(self) -> tuple[str, int]:
        return (self.model_id, self.weights_seq)


class _Barrier:
    """Samples run together; a push waits for them to finish and keeps new ones out."""

    def __init__(self) -> None:
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._push = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def sample(self) -> AsyncIterator[None]:
        while not self._open.is_set():
            await self._open.wait()
        self._running += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def push(self) -> AsyncIterator[None]:
        async with self._push:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


class Sampling:
    """The servers behind ``router`` (serving ``base_path``) as the Tinker API samples them.
    ``base_router``: the same servers asked for the base model (the ``adapter`` backend only);
    ``fresh``: the servers hold the base model (trident started them); attached servers may hold
    a previous process's weights."""

    def __init__(
        self,
        router: Router,
        backend: str,
        base_path: str,
        base_router: Router | None = None,
        fresh: bool = True,
        default_max_tokens: int = 16,
    ) -> None:
        self.router, self.backend, self.base_router = router, backend, base_router
        self.base_path = str(Path(base_path).resolve())
        self.default_max_tokens = default_max_tokens
        self.served: tuple[str, int] | None = BASE if fresh else None
        self.version = 0  # bumped by every push
        self.sessions: dict[str, Binding] = {}
        self._samples: dict[str, asyncio.Task[Result]] = {}
        self._barrier = _Barrier()
        self._ready = asyncio.Event()
        self._ready.set()
        self._journal: Journal | None = None
        self._models: Mapping[str, TrainedModel] = {}
        self._state_dir = Path(".")

    def open(self, journal: Journal, models: Mapping[str, TrainedModel], state_dir: Path) -> str:
        """Called by the service once: the sessions journaled before, and the model the servers
        held last ("" if none), whose weights ``resume`` pushes again before any sample."""
        self._journal, self._models, self._state_dir = journal, models, state_dir
        last = ""
        for sampler_id, body in journal.samplers().items():
            self.sessions[sampler_id] = binding = Binding(**json.loads(body))
            last = binding.model_id or last
        if last:
            self._ready.clear()
        return last

    def serves(self, base_path: str) -> bool:
        """Whether a model of ``base_path`` can be sampled here (one base model per server)."""
        return str(Path(base_path).resolve()) == self.base_path

    def check_model(self, name: str, base_path: str, lora: LoraShape | None) -> None:
        """At ``create_model``: a ``UserError`` for a model whose weights cannot be pushed here."""
        if not self.serves(base_path):
            raise UserError(
                f"base_model {name!r}: the rollout servers serve one model, {self.base_path}"
            )
        if self.backend == "adapter" and (lora is None or lora.rank == 0 or lora.train_unembed):
            raise UserError(
                "the servers take LoRA adapters (model.lora.sync=adapter), which vLLM loads on "
                "attention and MLP layers only: create a LoRA model with train_unembed=False, "
                "or serve with model.lora.sync=merged"
            )

    # -- pushes -----------------------------------------------------------------------------

    async def publish(self, model: TrainedModel, sampler_id: str) -> None:
        """Serve ``model``'s current weights (a verified push unless the servers hold them);
        bind ``sampler_id`` to them (module docstring: a replayed push)."""
        if model.replaying and sampler_id in self.sessions:
            return
        await self._serve(model)
        binding = Binding(model.model_id, model.weights_seq, model.origin.base_model)
        self._bind(sampler_id, binding)

    async def resume(self, model: TrainedModel | None) -> bool:
        """After a restart's replay of the model the servers held last: push its weights again
        unless a push of this process came first (None: it could not be restored), then let
        samples through. Whether it pushed."""
        try:
            if model is None or self.version > 0:
                return False
            await self._serve(model)
            return True
        finally:
            self._ready.set()

    async def _serve(self, model: TrainedModel) -> None:
        weights = (model.model_id, model.weights_seq)
        async with self._barrier.push():
            if self.served == weights:
                return
            self.served = None  # unknown until the push is verified
            self.version += 1
            await model.live().push(self.version, self.router.up_urls, self.backend)
            if not await self.router.reset_prefix_cache():
                raise EngineError("a server refused /reset_prefix_cache with nothing in flight")
            self.served = weights

    # -- sessions ---------------------------------------------------------------------------

    def create_sampling_session(self, body: dict[str, Any]) -> str:
        """A session on saved sampler weights (``model_path``) or on the base model."""
        sampler_id = f"{body['session_id']}:sampling:{body['sampling_session_seq_id']}"
        if sampler_id in self.sessions:  # the SDK's retry
            return sampler_id
        if body.get("model_path"):
            binding = self._saved(str(body["model_path"]))
        else:
            binding = self._base(str(body.get("base_model") or ""))
        self._bind(sampler_id, binding)
        return sampler_id

    def _saved(self, uri: str) -> Binding:
        manifest = read_manifest(resolve(self._state_dir, uri, "sampler_weights"))
        model = self._models.get(manifest["model_id"])
        if model is None:
            raise UserError(f"{uri}: its model is not loaded; only a loaded model is sampled")
        if model.weights_seq != manifest["weights_seq"]:
            raise UserError(
                f"{uri} holds older weights than model {model.model_id} has now: the rollout "
                "servers hold one weight version, the latest one pushed"
            )
        return Binding(model.model_id, model.weights_seq, model.origin.base_model, uri)

    def _base(self, name: str) -> Binding:
        if self.base_router is None and self.served != BASE:
            raise UserError(
                f"base_model {name!r}: the rollout servers hold trained weights now; sampling "
                "the base model beside a LoRA model needs LoRA adapter sync "
                "(model.lora.sync=adapter)"
            )
        return Binding("", 0, name)

    def _bind(self, sampler_id: str, binding: Binding) -> None:
        assert self._journal is not None  # open() was called
        if self.sessions.get(sampler_id) == binding:
            return
        self._journal.record_sampler(sampler_id, json.dumps(asdict(binding)).encode())
        self.sessions[sampler_id] = binding

    def sampler_info(self, sampler_id: str) -> dict[str, Any]:
        binding = self.sessions.get(sampler_id)
        if binding is None:
            raise UserError(f"unknown sampling session {sampler_id!r}")
        return {"base_model": binding.base_model, "model_path": binding.model_path}

    # -- samples ----------------------------------------------------------------------------

    @staticmethod
    def is_sample(request_id: str) -> bool:
        return request_id.startswith("sample:")

    async def asample(self, call: SampleCall) -> tuple[str, list[str]]:
        """Start the sample (once per ``(sampling_session_id, seq_id)``); its request id and
        one sequence id per sample."""
        rid = f"sample:{call.sampling_session_id}:{call.seq_id}"
        if rid not in self._samples:
            if call.sampling_session_id not in self.sessions:
                raise UserError(f"unknown sampling session {call.sampling_session_id!r}")
            if call.topk_prompt_logprobs or call.topk_sample_logprobs:
                raise UserError("top-k logprobs are not served")
            self._samples[rid] = asyncio.create_task(self._sample(call), name=rid)
        return rid, [f"{rid}/{i}" for i in range(call.num_samples)]

    async def result(self, request_id: str, timeout_s: float) -> Result | None:
        """A sample's result, or None if not ready within ``timeout_s``."""
        task = self._samples.get(request_id)
        if task is None:
            raise ExpiredSample(request_id)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        return None

    async def _sample(self, call: SampleCall) -> Result:
        await self._ready.wait()
        try:
            async with self._barrier.sample():
                return await self._generate(call)
        except UserError as e:
            return error(f"asample: {e}")
        except EngineError as e:
            return error(f"asample: {e}", "server")

    def _router(self, binding: Binding) -> Router:
        if not binding.model_id and self.base_router is not None:
            return self.base_router
        if self.served != binding.weights:
            raise UserError(
                "this sampling session's weights are no longer on the rollout servers, which "
                "hold one weight version (the latest pushed): save_weights_for_sampler again"
            )
        return self.router

    async def _generate(self, call: SampleCall) -> Result:
        router = self._router(self.sessions[call.sampling_session_id])
        stop = call.stop or []
        params = SamplingParams(
            n=call.num_samples,
            temperature=call.temperature,
            top_p=call.top_p,
            top_k=call.top_k,
            max_tokens=call.max_tokens or self.default_max_tokens,
            stop=[s for s in stop if isinstance(s, str)],
            stop_token_ids=[s for s in stop if isinstance(s, int)],
            seed=call.seed,
            include_stop_str_in_output=True,  # the stop sequence's tokens are returned
        )
        completions = await router.generate(call.prompt_tokens, params) if call.num_samples else []
        if any(c.finish_reason == "abort" for c in completions):
            raise EngineError("a sample was aborted by its server")
        sequences = [
            SampledOutput(
                c.token_ids, c.logprobs, "stop" if c.finish_reason == "stop" else "length"
            )
            for c in completions
        ]
        prompt: list[float | None] | None = None
        if call.prompt_logprobs:
            prompt = [None, *await router.prompt_logprobs(call.prompt_tokens)]
            if call.prompt_logprobs_last_n is not None:  # only the last n are asked for
                keep = len(prompt) - call.prompt_logprobs_last_n
                prompt = [None if i < keep else v for i, v in enumerate(prompt)]
        return Result("sample", (sequences, prompt, None))

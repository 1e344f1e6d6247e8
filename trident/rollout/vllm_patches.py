"""What trident changes in its vLLM servers' processes, and the environment that asks for it.

The supervisor (``trident.rollout.vllm_server``) starts each server with ``SERVER`` set and its
own pid in ``PARENT_PID`` (CPU servers also with ``FORK``); trident's vLLM plugin
(``trident.weights.vllm_plugin.register``, run in every vLLM process) calls ``apply``, which in
such a process makes it die with its parent, drops the settling sleep of vLLM's pause and, on
CPU, forks the engine core and inspects model classes in process. Each patch says what it
replaces and why, and one that no longer matches the installed vLLM is left out.

This module imports only the standard library at import time: vLLM imports it in each of its
processes.
"""

from __future__ import annotations

import functools
import os
import signal

SERVER = "TRIDENT_VLLM_SERVER"  # "1": a server trident started (every process dies with it)
FORK = "TRIDENT_VLLM_FORK"  # "1": fork the engine core (CPU servers)
PARENT_PID = "TRIDENT_PARENT_PID"  # the pid each of a server's processes expects as its parent
API_SERVER_PID = "TRIDENT_VLLM_API_PID"  # set by the API server for the processes below it
ORPHAN_GRACE_S = 20.0  # an orphaned API server's shutdown (SIGTERM), before it is killed


def _die_with_parent() -> None:
    """This vLLM process dies with the one that started it (``PARENT_PID``, set by the
    supervisor for the API server and by each process for its children, so a parent that died
    before the request is caught too): the API server by SIGTERM, whose shutdown stops its engine
    core, and by SIGKILL if that shutdown has not ended ``ORPHAN_GRACE_S`` later (an API server
    outlived its killed supervisor so, under memory pressure); every process below it by
    SIGKILL, since each one's own children die with it in turn (a SIGTERMed engine core was seen
    to outlive its killed API server)."""
    from trident.cluster.process import die_with_parent

    me = str(os.getpid())
    top = API_SERVER_PID not in os.environ
    parent = int(os.environ.get(PARENT_PID) or 0) or None
    if top:
        die_with_parent(signal.SIGTERM, parent=parent, kill_after_s=ORPHAN_GRACE_S)
        os.environ[API_SERVER_PID] = me
    else:
        die_with_parent(signal.SIGKILL, parent=parent)
    os.environ[PARENT_PID] = me


def fork_engine_core() -> None:
    """Start the API server's engine core by ``fork`` instead of ``spawn``: the child inherits
    the parent's imports instead of importing torch and vLLM again (tiny model, 2 cores: server
    start 22 -> 12 s). vLLM's CPU platform asks for ``spawn`` unconditionally; fork is safe at
    that point on CPU because the API server has run no model yet (no OpenMP pool, no device
    context). Only the engine-core launcher is changed; GPU servers keep vLLM's choice."""
    import multiprocessing

    import vllm.v1.engine.utils as engine_utils

    setattr(engine_utils, "get_mp_context", functools.partial(multiprocessing.get_context, "fork"))  # noqa: B010


def inspect_models_in_process() -> None:
    """Let vLLM read a model class's capabilities in this process instead of a new interpreter.
    vLLM inspects an architecture in a subprocess (to leave CUDA uninitialised in the API
    server) and caches the answer under ``~/.cache/vllm/modelinfos``, keyed by the hash of the
    model's module; the subprocess imports torch and vLLM again, so a machine's first server started ~6 s later than
    the next ones (tiny model, 2 cores: 12.9 s against 6.3-8.9 s). On CPU (``TRIDENT_VLLM_FORK``)
    there is no device to protect, and the engine core forked from this process inherits the
    model's module."""
    import vllm.model_executor.models.registry as registry

    setattr(registry, "_run_in_subprocess", lambda fn: fn())  # noqa: B010


# vLLM's AsyncLLM.pause_generation, statement by statement, as pause_without_settling knows it
_PAUSE_AWAITS = [
    "await self.renderer.clear_mm_cache_async()",
    "await self.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)",
    "await asyncio.sleep(0.02)",
]


def pause_without_settling() -> bool:
    """Drop the fixed 20 ms ``asyncio.sleep`` that ends vLLM's ``AsyncLLM.pause_generation``
    (behind ``/pause``), which its comment calls "not required for correctness": it lets the
    last outputs of aborted requests out before the call returns. trident aborts its requests
    and waits until every one is back before it pauses (``WeightGate.update``), so nothing is
    left to settle, and the sleep was most of every sync's pause (CPU demo: 24 of a 70 ms
    sync). The method keeps its two calls. A vLLM whose method is not these statements is left
    as it is; returns whether it was patched."""
    import inspect

    from vllm.v1.engine.async_llm import AsyncLLM

    lines = inspect.getsource(AsyncLLM.pause_generation).splitlines()
    if [line.strip() for line in lines if line.strip().startswith("await ")] != _PAUSE_AWAITS:
        return False

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        if clear_cache:
            await self.renderer.clear_mm_cache_async()
        await self.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)

    pause_generation.__doc__ = AsyncLLM.pause_generation.__doc__
    setattr(AsyncLLM, "pause_generation", pause_generation)  # noqa: B010
    return True


def apply() -> None:
    """Called by the plugin hook in every vLLM process: in a server trident started, once per
    process (plugins may load more than once), make this process (the engine core, its
    workers) and any process forked from it die with its parent, so a killed API server leaves
    none behind, and pause without vLLM's settling sleep (``pause_without_settling``); with
    ``FORK`` (CPU servers), fork the engine core (``fork_engine_core``) and inspect model
    classes in this process (``inspect_models_in_process``)."""
    if os.environ.get(SERVER) != "1" or os.environ.get(PARENT_PID) == str(os.getpid()):
        return
    _die_with_parent()
    os.register_at_fork(after_in_child=_die_with_parent)  # a forked child runs no plugin
    pause_without_settling()
    if os.environ.get(FORK) == "1":
        fork_engine_core()
        inspect_models_in_process()

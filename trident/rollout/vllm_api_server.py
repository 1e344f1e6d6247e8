"""``python -m trident.rollout.vllm_api_server ARGS``: vLLM's OpenAI API server with ARGS, its
import run with the garbage collector paused (``collector_paused``: server up in ~9 s instead
of ~12.5 s on 2 cores, the tiny model; the forked engine core inherits the frozen heap).
"""

from __future__ import annotations

import runpy

from trident.cluster.process import collector_paused

SERVER = "vllm.entrypoints.openai.api_server"

if __name__ == "__main__":
    with collector_paused():
        __import__(SERVER)
    runpy.run_module(SERVER, run_name="__main__", alter_sys=True)

"""Named moments of a weight sync at which a test can kill a server, deterministically.

Inert unless ``TRIDENT_FAULT_DIR`` is set (the run's processes inherit it). A test arms moment
``m`` by creating the file ``$TRIDENT_FAULT_DIR/m`` (empty, or holding ``n``: the ``n``-th time
from now); when the process reaches ``m`` that time it consumes the file, writes ``m.hit`` (a JSON list of the servers involved) and waits until the
test has done what it wanted (killed one of them) and deleted ``m.hit``, for at most
``WAIT_S``; then the sync goes on into the failure. The moments (``WeightSync``):

- ``push``: the push's servers are paused, nothing is sent yet;
- ``pushed``: the push is done and the servers resumed, the verification has not started;
- ``rejoin``: a restarted server's transfer engine is set up again, its weights not sent yet.

And of the training service (``trident.tinker.service``), where a test kills the whole server:

- ``tinker_forward_backward``: a ``forward_backward`` has run on the model and its result is
  stored; the request after it (the step's ``optim_step``) has not run.

A kill at other moments (during generation) needs no hook: ``tests/test_server_recovery.py``
kills a server while requests are in flight on it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

WAIT_S = 300.0


def fault_point(moment: str, urls: list[str]) -> None:
    """Called at ``moment`` with the servers involved; returns at once unless a test armed it."""
    directory = os.environ.get("TRIDENT_FAULT_DIR")
    if not directory:
        return
    armed, hit = Path(directory) / moment, Path(directory) / f"{moment}.hit"
    try:
        text = armed.read_text().strip()
        if text and int(text) > 1:  # not this time: count down
            scratch = armed.with_suffix(".count")
            scratch.write_text(str(int(text) - 1))
            scratch.rename(armed)
            return
        armed.unlink()  # one-shot: a second process or a later sync finds nothing
    except FileNotFoundError:
        return
    scratch = hit.with_suffix(".tmp")
    scratch.write_text(json.dumps(urls))
    scratch.rename(hit)
    deadline = time.monotonic() + WAIT_S
    while hit.exists() and time.monotonic() < deadline:
        time.sleep(0.05)

"""Ray and vLLM made unimportable, as on a GPU machine whose image has neither: on ``PYTHONPATH``
this runs at every interpreter's start-up (children included) and hides the packages from the
path finder, so ``import ray`` fails with "No module named 'ray'" and ``find_spec`` answers None,
exactly as if they were not installed (tests/test_engine_free.py). Also hidden: what such an
image lacks that trident uses only off the engine-free paths (``datasets`` for saved dataset
directories, ``math_verify`` for math rewards, ``zstandard`` for delta sync, and ``dill``)."""

import importlib.machinery
import sys

REFUSED = frozenset({"ray", "vllm", "datasets", "math_verify", "zstandard", "dill"})


class _PathFinderWithoutEngines(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in REFUSED:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [
    _PathFinderWithoutEngines if finder is importlib.machinery.PathFinder else finder
    for finder in sys.meta_path
]

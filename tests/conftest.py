import os
import sys
import tempfile

import torch

# tests import the shared harness as a plain module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "autoshard-inductor"))
# One ATen thread in the test process: the suite runs one pytest worker per core (README: -n 2), and its tests
# fork gloo ranks from this process, where an OpenMP thread pool made by earlier work would not survive the fork
# (autoshard/testing/launch.py).
torch.set_num_threads(1)
# cluster=None prices on the cpu preset in the tests, whatever `autoshard profile` cached for this machine, and
# autotune times its candidates rather than reading an earlier run's choice (autoshard/cluster/machine.py): an
# empty cache of each test process's own, which the ranks and examples it launches inherit
os.environ["AUTOSHARD_CACHE"] = tempfile.mkdtemp(prefix="autoshard-tests-cache-")
# ... and says so once per process: here, at start-up, not inside whichever test first prices on it
from autoshard.cluster.presets import get_cluster  # noqa: E402

get_cluster(None)


def pytest_collection_finish(session) -> None:
    """Start early what a selected test marks ``start_early`` (a background subprocess that the test collects).
    Not under pytest-xdist: every worker collects every test, so each would start it; the test starts it then."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    started = set()
    for item in session.items:
        start = getattr(getattr(item, "function", None), "start_early", None)
        if start is not None and start not in started:
            started.add(start)
            start()


def pytest_sessionfinish(session) -> None:
    for mod in {item.module for item in session.items if hasattr(item, "module")}:
        stop = getattr(mod, "stop_all", None)
        if callable(stop) and getattr(mod, "_started", None):
            stop()

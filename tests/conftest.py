import os
import sys

# tests import the shared harness as a plain module
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "autoshard-inductor"))


def pytest_collection_finish(session) -> None:
    """Start early what a selected test marks ``start_early`` (a background subprocess that the test collects)."""
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

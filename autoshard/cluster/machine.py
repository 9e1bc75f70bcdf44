"""The machine autoshard runs on, as the cluster ``cluster=None`` prices: its own measured profile when
``autoshard profile`` has measured it, else the ``"cpu"`` preset, said plainly.

``autoshard profile`` measures this machine (``cluster/calibrate.py``: matmul throughput per dtype, memory
bandwidth, kernel overhead, gloo collectives between forked ranks; cores and memory) and caches the profile under
``$AUTOSHARD_CACHE`` (default ``~/.cache/autoshard``), keyed by what identifies the machine (host, CPU model,
usable cores, memory): another machine, or this one with other cores, is not priced with it. Without a cached
profile, ``cluster=None`` warns once per process (on rank 0: ``messages.py``) that it prices on the ``"cpu"``
preset, which was measured on autoshard's CI machine (its CPU named), and how to measure this one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
from pathlib import Path

from autoshard.cluster.profile import ClusterProfile
from autoshard.messages import warn

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("AUTOSHARD_CACHE") or "~/.cache/autoshard").expanduser()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        return os.cpu_count() or 1


@functools.cache
def machine_identity() -> dict[str, object]:
    """What the cached profile is keyed by: host, CPU model, usable cores, memory."""
    from autoshard.cluster.calibrate import cpu_name, memory_total

    return {"host": socket.gethostname(), "cpu": cpu_name(), "cores": usable_cores(), "memory": memory_total()}


def profile_path() -> Path:
    """Where this machine's measured profile is cached."""
    key = hashlib.sha256(json.dumps(machine_identity(), sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"machine-{key}.json"


def this_machine(reference: ClusterProfile) -> ClusterProfile:
    """This machine's cached profile, else ``reference`` (the ``"cpu"`` preset) with a warning saying so."""
    path = profile_path()
    if path.is_file():
        profile = ClusterProfile.from_dict(json.loads(path.read_text()))
        _said(f"cluster=None: priced on this machine's profile, measured by autoshard profile ({path})")
        return profile
    _warn_reference(reference.device.name, str(path))
    return reference


@functools.cache
def _said(text: str) -> None:
    log.info("%s", text)


@functools.cache
def _warn_reference(device: str, path: str) -> None:
    ident = machine_identity()
    warn(
        log,
        "cluster=None: this machine (%s, %s cores, %.0f GiB) has no measured profile, so plans are priced on the "
        "'cpu' preset, measured on autoshard's CI machine (%s), not on this one; run `autoshard profile` once to "
        "measure it (cached at %s), or pass cluster=",
        ident["cpu"],
        ident["cores"],
        int(ident["memory"]) / 2**30,
        device,
        path,
    )


__all__ = ["cache_dir", "machine_identity", "profile_path", "this_machine", "usable_cores"]

"""The machine autoshard runs on, as the cluster ``cluster=None`` prices: its own measured profile when
``autoshard profile`` has measured it, else the ``"cpu"`` preset, said plainly.

``autoshard profile`` measures this machine (``cluster/calibrate.py``: matmul throughput per dtype, memory
bandwidth, kernel overhead, gloo collectives between forked ranks; cores and memory) and caches the profile under
``$AUTOSHARD_CACHE`` (default ``~/.cache/autoshard``), keyed by what identifies the machine (host, CPU model,
usable cores, memory): another machine, or this one with other cores, is not priced with it. Without a cached
profile, ``cluster=None`` prices on this machine's own memory (read, not measured: ``os.sysconf``) at the ``"cpu"``
preset's rates (throughput, bandwidth, links), which were measured on autoshard's CI machine, and warns once per
process (on rank 0: ``messages.py``) that it does, naming both machines and how to measure this one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import socket
from dataclasses import replace
from pathlib import Path

from autoshard.cluster.profile import ClusterProfile
from autoshard.messages import warn

log = logging.getLogger(__name__)


CACHE_ENV = "AUTOSHARD_CACHE"


def cache_dir() -> Path:
    """autoshard's one cache folder (this machine's profile, autotune's choices): ``$AUTOSHARD_CACHE``, default
    ``~/.cache/autoshard``."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/autoshard").expanduser()


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
    """This machine's cached profile, else its memory at ``reference``'s rates (the ``"cpu"`` preset), with a
    warning saying so."""
    path = profile_path()
    if path.is_file():
        profile = ClusterProfile.from_dict(json.loads(path.read_text()))
        _said(f"cluster=None: priced on this machine's profile, measured by autoshard profile ({path})")
        return profile
    _warn_reference(reference.device.name)
    return _own_memory(reference)


def _own_memory(reference: ClusterProfile) -> ClusterProfile:
    """``reference`` with this machine's memory shared by its ranks per node, as the preset shares its own."""
    ident = machine_identity()
    ranks = reference.devices_per_node
    memory = int(ident["memory"]) // ranks
    device = replace(
        reference.device,
        name=f"this machine ({ident['cpu']}) at the rates of {reference.device.name}",
        memory_bytes=memory,
        sources={
            **reference.device.sources,
            "memory_bytes": f"this machine: {int(ident['memory']) / 2**30:.1f} GiB of memory (os.sysconf) divided "
            f"by the {ranks} ranks per node",
        },
    )
    return replace(reference, device=device)


@functools.cache
def _said(text: str) -> None:
    log.info("%s", text)


@functools.cache
def _warn_reference(device: str) -> None:  # (once per process, wherever the cache is pointed)
    ident = machine_identity()
    warn(
        log,
        "cluster=None: this machine (%s, %s cores, %.0f GiB) has no measured profile, so plans are priced on its "
        "memory at the 'cpu' preset's rates, measured on autoshard's CI machine (%s), not on this one; run "
        "`autoshard profile` once to measure it (cached at %s), or pass cluster=",
        ident["cpu"],
        ident["cores"],
        int(ident["memory"]) / 2**30,
        device,
        profile_path(),
    )


__all__ = ["CACHE_ENV", "cache_dir", "machine_identity", "profile_path", "this_machine", "usable_cores"]

"""Collective algorithms on one mesh axis, priced on the links the axis is laid over (docs/design.md, "Communication").

An axis of ``n`` devices lies ``m`` to a node on ``k`` nodes (``n = m*k``, :meth:`ClusterProfile.axis_layout`).
Inside a node its hops use the intra-node link (latency ``a_i``, bandwidth ``B_i`` per direction per device),
between nodes the network (``a_e``, ``B_e`` per device: one NIC per GPU, as on DGX). ``b`` is the message's full
(gathered) size on the axis. All formulas are alpha-beta models: a latency per step plus bytes over bandwidth.

``ring`` (flat; NCCL's classic algorithm, and its only one for all_gather / reduce_scatter over plain links)::

    one pass      = (n-k)*a_i + (k-1)*a_e + b*(n-1)/n / B_ring
    B_ring        = B_i                                  if k == 1
                  = min(m*B_e, m*B_i/(m-1))               if k > 1   (= B_e when m == 1)
    all_gather, reduce_scatter = one pass;  all_reduce = two passes (reduce_scatter + all_gather)

  Latency: NCCL's tuning model (src/graph/tuning.cc, ``ncclTopoTuneModel``) charges each of the ``n-1`` ring
  steps the latency of the hop it crosses, ``k-1`` of which leave a node. Bandwidth across nodes: NCCL runs one
  ring per channel and routes each channel through a different NIC, so a node's ``m`` devices on this axis push
  its network traffic through their ``m`` NICs at once (tuning.cc: bus bandwidth = channels x per-channel
  speed). A device's traffic then goes ``1/m`` through its NIC and ``(m-1)/m`` over the intra-node link, hence
  the min. With ``m == 1`` every hop is a network hop: the ring is bounded by one NIC per device, ``B_e``.

``tree`` (all_reduce only; NCCL: a chain inside each node, a double binary tree across nodes)::

    2*((m-1)*a_i + floor(log2 k)*a_e) + 2*b / (0.9 * B_ring)

  The latency is tuning.cc's tree latency (up the tree and back down; the depth of a binary tree of ``k``
  nodes is ``floor(log2 k)``). Bandwidth: each node sends and receives the whole ``b`` once in the reduce and
  once in the broadcast (half through each of the two trees), which is tuning.cc's ``algBw = busBw / 2``, vs
  the ring's ``2*(n-1)/n*b``; tuning.cc also takes 0.9 of the bus bandwidth for trees (``busBw*.9``). So the
  tree wins on latency (small messages, many nodes) and the ring on bytes. Inside one node (``k == 1``) the
  chain has the ring's latency and more bytes, so ``auto`` never picks it there, as NCCL doesn't.

``hierarchical`` (axis spans nodes with several devices in each: ``m > 1`` and ``k > 1``)::

    all_reduce     = RS(b, m; intra) + AR(b/m, k; network) + AG(b, m; intra)
    all_gather     = AG(b/m, k; network) + AG(b, m; intra)      (the slow link moves the small message)
    reduce_scatter = RS(b, m; intra) + RS(b/m, k; network)

  with RS / AG / AR the single-link ring formulas above. The ``m`` inter-node sub-rings (one per position
  inside the node, each over ``k`` devices on ``k`` nodes) run at once, each on its own device's NIC.

``all_to_all`` depends on the backend (:attr:`ClusterProfile.all_to_all`). ``pairwise`` (NCCL): every device
sends its ``b/n``-byte buffer cut in ``n`` pieces, one to each peer at once, so it sends ``b*(n-1)/n**2``::

    pairwise      = a*(n-1) + b*max((m-1)/B_i, (n-m)/B_e)/n**2

  (``m-1`` peers over the intra-node link, ``n-m`` through its own NIC: every device sends off-node at the same
  time, so there are no idle NICs to borrow, unlike a ring.) ``ring`` (gloo): DTensor has no CPU all-to-all and
  all-gathers the whole tensor, keeping its chunk: an all-gather's one pass, ``n`` times the bytes. The
  design's ``b*(n-1)/n/B`` is the pairwise formula with ``b`` the per-device buffer.

``auto`` takes the cheapest applicable algorithm, ties going to the first of :data:`ALGORITHMS`, the way
NCCL's tuner picks the algorithm with the least predicted time. Plain arithmetic, no state.
"""

from __future__ import annotations

from autoshard.cluster.profile import AxisLayout, Link
from autoshard.errors import InputError

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "TREE_BANDWIDTH_FACTOR",
    "algorithm_time",
    "applicable_algorithms",
    "best_algorithm",
    "ring_bandwidth",
    "ring_pass",
]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
ALGORITHMS = ("ring", "tree", "hierarchical", "pairwise")
TREE_BANDWIDTH_FACTOR = 0.9  # NCCL src/graph/tuning.cc: tree bus bandwidth = 0.9 x the graph's


def ring_pass(nbytes: float, n: int, latency: float, bandwidth: float) -> float:
    """One ring pass (an all_gather or a reduce_scatter) over ``n`` devices on a single link: ``n-1`` steps,
    each device sending ``nbytes/n`` per step: ``latency*(n-1) + nbytes*(n-1)/n/bandwidth``."""
    if n <= 1:
        return 0.0
    return latency * (n - 1) + nbytes * (n - 1) / n / bandwidth


def ring_bandwidth(layout: AxisLayout, intra: Link, inter: Link) -> float:
    """Bytes/s per device of a flat ring over the axis: ``B_i`` inside a node, else ``min(m*B_e, m*B_i/(m-1))``
    (each of the ``m`` ring channels leaves the node through its own NIC; see the module docstring)."""
    m = layout.per_node
    if layout.nodes == 1:
        return intra.bandwidth
    if m == 1:
        return inter.bandwidth
    return min(m * inter.bandwidth, m * intra.bandwidth / (m - 1))


def applicable_algorithms(kind: str, layout: AxisLayout, all_to_all: str = "pairwise") -> tuple[str, ...]:
    """The algorithms that exist for ``kind`` on this layout, in tie-break order; ``all_to_all``: the one the
    backend runs for that kind (``pairwise``, or ``ring`` where it all-gathers)."""
    _check_kind(kind)
    if kind == "all_to_all":
        if all_to_all not in ("pairwise", "ring"):
            raise InputError(f"all_to_all algorithm {all_to_all!r}: known are 'pairwise' (NCCL) and 'ring' (gloo)")
        return (all_to_all,)
    algorithms: tuple[str, ...] = ("ring", "tree") if kind == "all_reduce" else ("ring",)
    if layout.per_node > 1 and layout.nodes > 1:
        algorithms += ("hierarchical",)
    return algorithms


def algorithm_time(
    kind: str, nbytes: float, layout: AxisLayout, intra: Link, inter: Link, algorithm: str, all_to_all: str = "pairwise"
) -> float:
    """Seconds for collective ``kind`` of full size ``nbytes`` with ``algorithm`` (formulas: module docstring).

    Raises ValueError for an unknown kind or algorithm, or one that does not apply (``tree`` is all_reduce only;
    ``hierarchical`` needs ``m > 1`` and ``k > 1``; ``all_to_all`` runs the backend's one)."""
    applicable = applicable_algorithms(kind, layout, all_to_all)
    if algorithm not in applicable:
        if algorithm not in ALGORITHMS:
            raise InputError(f"unknown collective algorithm {algorithm!r}; known: {', '.join(ALGORITHMS)}, auto")
        raise InputError(
            f"{algorithm} does not apply to {kind} on an axis of {layout.size} devices laid {layout.per_node} per "
            f"node over {layout.nodes} node(s); applicable: {', '.join(applicable)} "
            f"(tree: all_reduce only; hierarchical: more than one node and more than one device per node)"
        )
    n, m, k = layout.size, layout.per_node, layout.nodes
    if n <= 1:
        return 0.0
    if kind == "all_to_all" and algorithm == "pairwise":
        latency = (m - 1) * intra.latency + (n - m) * inter.latency
        return latency + nbytes * max((m - 1) / intra.bandwidth, (n - m) / inter.bandwidth) / n**2
    if kind == "all_to_all":  # gathered whole, then each device keeps its chunk
        link = intra if k == 1 else inter
        return ring_pass(nbytes, n, link.latency, link.bandwidth)
    if algorithm == "ring":
        one = (
            (n - k) * intra.latency
            + (k - 1) * inter.latency
            + nbytes * (n - 1) / n / ring_bandwidth(layout, intra, inter)
        )
        return 2.0 * one if kind == "all_reduce" else one
    if algorithm == "tree":
        depth = k.bit_length() - 1  # floor(log2 k)
        bandwidth = TREE_BANDWIDTH_FACTOR * ring_bandwidth(layout, intra, inter)
        return 2.0 * ((m - 1) * intra.latency + depth * inter.latency) + 2.0 * nbytes / bandwidth
    # hierarchical: intra-node ring passes over m at full size, inter-node ring passes over k at 1/m size
    local = ring_pass(nbytes, m, intra.latency, intra.bandwidth)
    network = ring_pass(nbytes / m, k, inter.latency, inter.bandwidth)
    return 2.0 * (local + network) if kind == "all_reduce" else local + network


def best_algorithm(
    kind: str, nbytes: float, layout: AxisLayout, intra: Link, inter: Link, all_to_all: str = "pairwise"
) -> tuple[str, float]:
    """``(algorithm, seconds)`` of the cheapest applicable algorithm; ties go to the earlier one in
    :data:`ALGORITHMS` (so a 1-device axis, or an empty message, reports ``ring``)."""
    best_name, best_time = "", float("inf")
    for name in applicable_algorithms(kind, layout, all_to_all):
        t = algorithm_time(kind, nbytes, layout, intra, inter, name, all_to_all)
        if t < best_time:
            best_name, best_time = name, t
    return best_name, best_time


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise InputError(f"unknown collective kind {kind!r}; known kinds: {', '.join(COLLECTIVES)}")

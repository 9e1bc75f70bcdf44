"""Pipeline parallelism: layers split into stages over sub-meshes, micro-batches, a schedule.

- ``search``: the one stage search over stage counts, stage sub-meshes and micro-batch counts, which both
  ``plan(pipeline="auto")`` and ``compile`` run (each option planned intra-op on its sub-mesh, cut into pieces,
  split by the inter-op DP in ``autoshard.solver.inter_op``); ``pricing``: one configuration priced, exactly or
  estimated from solved neighbours, and what the two callers may choose (``SearchSpace``); ``solves``: the
  intra-op solves behind it, kept and reused (captures per micro-batch, layouts across stage counts);
- ``costs``: a solved intra-op plan cut into per-layer pieces (what the inter-op DP splits);
- ``megatron``: Megatron-LM's fixed (TP, PP, DP) configurations priced by the same model;
- ``plan``: the pipelined :class:`~autoshard.plans.plan.Plan` (one stage plan per stage);
- ``offline``: ``autoshard.plan(..., pipeline="auto")`` on the offline path (options, the recipe rows, the choice);
- ``compile`` and ``wiring``: ``autoshard.compile`` with stages: the model cut by
  ``torch.distributed.pipelining``, every stage planned and compiled, values routed between stages.

The package imports none of its modules here (the runtime imports ``wiring``; ``compile`` imports the runtime).
"""

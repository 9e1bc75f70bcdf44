"""The Plan value and what is read off it.

- ``plan.py``: :class:`Plan` (stages, tensors, collectives, memory, predicted step time), JSON round trip;
- ``report.py``: the plain-text report (``Plan.report()``);
- ``collectives.py``: the collectives a solved graph's plan makes, priced as the lowering runs them;
- ``fingerprint.py``: what a saved plan was made for (model, mesh, cluster, options, versions).
"""

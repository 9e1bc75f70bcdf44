"""The Plan value and what is read off it.

- ``plan.py``: :class:`Plan` (stages, tensors, collectives, memory, predicted step time), JSON round trip;
- ``fingerprint.py``: what a saved plan was made for (model, mesh, cluster, options, versions);
- ``words.py``: the plan in one sentence (each mesh axis's role, pipeline, memory, speed against the recipes);
- ``report.py``: the plain-text report (``report(plan)``, ``autoshard.report``);
- ``explain.py``: why two plans differ, priced (``autoshard explain``);
- ``html/``: the plan as one self-contained HTML page (``write_html``).
"""

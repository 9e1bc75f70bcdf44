"""The searches: loops that run the planning passes more than once and keep the best result.

- ``planned``: one solve (``plan_once``) and its typed result (``Planned``: plan, graph, context); the recipe
  fallback (a recipe's layouts kept when predicted faster at the plan's accounting);
- ``recompute``: ``plan_graph``, every whole-program plan's entry; under a budget, the mix of saved, selective and
  fully recomputed layers;
- ``accumulate``: the fewest gradient-accumulation micro-batches that fit the budget;
- ``autotune``: the solver's k best plans and the fitting recipes, timed on the mesh.

The fifth, the pipeline-stage search, is ``autoshard/pipeline/search.py``: it shares that package's stage costs
and wiring.
"""

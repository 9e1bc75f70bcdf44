"""partition: this rank's joint graph -> a forward graph and a backward graph.

Needs: ``lower`` (a rank's joint graph: placeholders ``primals_*`` then ``tangents_*``; outputs the forward's
``ctx.forward_outputs`` outputs, then the gradients).

Guarantees on exit: ``ctx.forward_graph`` returns the forward outputs followed by the tensors saved for
backward; ``ctx.backward_graph`` takes the saved tensors followed by the tangents of the outputs that have one
(``ctx.tangent_of``) and returns the gradients. torch's partitioner (``default_partition``) decides what is
saved; ``_torch_compat.partition_joint`` first tags the forward ops (a ``make_fx`` trace has no tags, and
untagged the forward would end at the last primal, so every backward would recompute the whole forward). The
joint graph is returned unchanged.
"""

from __future__ import annotations

import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.compiler.context import PassContext


def partition(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.forward_graph, ctx.backward_graph = tc.partition_joint(gm, num_fwd_outputs=ctx.forward_outputs)
    ctx.stats["saved_for_backward"] = (
        len(ctx.forward_graph.graph.find_nodes(op="output")[0].args[0]) - ctx.forward_outputs
    )
    return gm

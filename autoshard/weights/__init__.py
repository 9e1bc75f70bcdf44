"""Where a rank's parameter values come from when the model was never whole on it.

A model built on the meta device (``with torch.device("meta"):``) has shapes and no values. ``autoshard.compile``
allocates only this rank's shard of each parameter (``shards``); the values then come from one of:

- ``init``: the model's own initialization (torch modules' ``reset_parameters``, Hugging Face's ``_init_weights``,
  a user's ``init_weights()``), run one whole parameter at a time and cut to the shards, seeded per parameter
  name so that the same seed gives the same full tensors on every mesh and plan;
- ``pretrained``: a ``save_pretrained`` directory (safetensors) read slice by slice into the shards through
  ``torch.distributed.checkpoint``'s Hugging Face reader, with the keys and shapes checked first; and the way
  back, a sharded model exported as a ``from_pretrained``-loadable directory.

This layer knows DTensors and modules, not plans or programs: the runtime's modules call it.
"""

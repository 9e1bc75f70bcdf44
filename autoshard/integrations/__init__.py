"""The training loops people already have, taking a module autoshard compiled with nothing else changed.

Most of what a loop needs is on the module itself (``autoshard/runtime/model_face.py``: the model's signature,
already distributed). What a loop does from one process only or around the model (the Hugging Face Trainer's
checkpoints, written by rank 0) needs the loop's own code to call autoshard: ``install_loaded()`` installs that for
each loop package the process has imported, when ``compile`` runs and again at the first call. Any other model
takes the loop's own path.
"""

from __future__ import annotations

import sys
from typing import Any


def install_loaded() -> None:
    """Install the integration of every loop package already imported (cheap when done)."""
    if "transformers" in sys.modules or "trl" in sys.modules:
        from autoshard.integrations.hf_trainer import install

        install()


def loop_defaults(module: Any) -> None:
    """Just before a lazy module is planned: what the process's training loop decides (its data loader's rows,
    its mixed precision; ``autoshard/integrations/accelerate.py``)."""
    from autoshard.integrations.accelerate import loop_defaults as from_accelerate

    from_accelerate(module)

"""Adapters that make fastpersist the checkpoint storage of a training framework.

Each submodule imports its framework when it is imported, never before; ``import fastpersist``
imports none of them. Install the frameworks with the ``integrations`` extra.

- :mod:`fastpersist.integrations.lightning`: ``FastPersistCheckpointIO`` and
  ``AsyncFastPersistCheckpointIO``, Lightning ``CheckpointIO`` plugins.
- :mod:`fastpersist.integrations.transformers`: ``FastPersistTrainer``, a Hugging Face
  ``Trainer`` whose ``save_steps`` checkpoints go through a Checkpointer.
- :mod:`fastpersist.integrations.accelerate`: ``AcceleratorCheckpointer``, ``save_state`` /
  ``load_state`` of an ``Accelerator`` through a Checkpointer.
"""

__all__: list[str] = []

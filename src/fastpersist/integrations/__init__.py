"""Adapters that make fastpersist the checkpoint storage of a training framework.

Each submodule imports its framework when it is imported, never before; ``import fastpersist``
imports none of them. Install the frameworks with the ``integrations`` extra.

- :mod:`fastpersist.integrations.lightning`: ``FastPersistCheckpointIO`` and
  ``AsyncFastPersistCheckpointIO``, Lightning ``CheckpointIO`` plugins, and the
  ``FastPersistDDPStrategy`` / ``FastPersistModelParallelStrategy`` strategies.
- :mod:`fastpersist.integrations.transformers`: ``FastPersistTrainer``, a Hugging Face
  ``Trainer`` whose ``save_steps`` checkpoints go through a Checkpointer.
- :mod:`fastpersist.integrations.accelerate`: ``AcceleratorCheckpointer``, ``save_state`` /
  ``load_state`` of an ``Accelerator`` through a Checkpointer.
- :mod:`fastpersist.integrations.torchtitan`: ``FastPersistCheckpointManager``, torchtitan's
  checkpoint manager writing and reading through the DCP layer.

The Trainer and accelerate adapters save and load FSDP2 state, and Lightning's FSDP2 strategy
loads it, through torch's state-dict functions as ``_fsdp2`` wraps them.
"""

__all__: list[str] = []

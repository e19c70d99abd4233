"""Hugging Face ``Trainer`` checkpoints through a fastpersist Checkpointer.

::

    from fastpersist.integrations.transformers import FastPersistTrainer

    trainer = FastPersistTrainer(model=model, args=TrainingArguments(output_dir, save_steps=1,
                                 save_total_limit=3, ...), train_dataset=data)
    trainer.train(resume_from_checkpoint=True)     # the latest committed checkpoint, if any

Every ``save_steps`` the Trainer decides to save (its ``TrainerControl.should_save``, so
``save_strategy``, ``save_steps`` and callbacks keep their meaning); the checkpoint of the model,
optimizer, LR scheduler, gradient scaler, ``TrainerState`` (global step, epoch, log history,
stateful callbacks: the data position follows from it, as in the Trainer) and each rank's RNG
states is written by one Checkpointer under ``<output_dir>/fastpersist`` (or the roots given),
in the background by default. ``save_total_limit`` becomes the Checkpointer's ``keep``.
``resume_from_checkpoint`` takes ``True`` (latest), a step number, or a step directory, and
restores all of it through the Trainer's own resume sequence, so the data skipping and the
moment the RNG states are put back are the Trainer's.

Why a subclass: the Trainer has no public hook for where a checkpoint is written or read. A
callback can veto the Trainer's own save (``control.should_save = False``) and save instead,
but resuming needs the Trainer's private loaders (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``) to read from
fastpersist, and ``_save_checkpoint`` is where the Trainer assembles exactly what it saves.
The subclass overrides those five methods and ``train``, nothing else; the Trainer's resume
logic itself (``trainer_state.json`` in the directory it is given) is used as is, from a
temporary directory holding only that file.

FSDP2 (``fsdp_config={"fsdp_version": 2}``): the model's and optimizer's state is taken with
torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (DTensors by parameter name)
and every rank writes the chunks it owns; a resume fills the current mesh's DTensors at any
number of processes (resharding), after the Trainer has sharded the model, and hands them back
with ``set_model_state_dict`` / ``set_optimizer_state_dict``.

Not supported (a clear error): ``load_best_model_at_end`` and ``save_strategy="best"`` (they
need the Trainer's checkpoint directories), DeepSpeed and FSDP1 (state in their engines' own
formats: see docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from transformers import Trainer
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState

from fastpersist.storage import catalog
from fastpersist.checkpointer import Checkpointer, list_checkpoints, load_checkpoint
from fastpersist.errors import CheckpointError, CheckpointNotFoundError
from fastpersist.format import manifest as mf
from fastpersist.integrations import _fsdp2 as fsdp2
from fastpersist.state import RNGState
from fastpersist.storage.backend import REAL_FILES, FileBackend
from fastpersist.tiers.resolve import open as open_view

logger = logging.getLogger(__name__)

__all__ = ["FastPersistTrainer"]


class FastPersistTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are written and read by fastpersist.

    Args:
        *args: the Trainer's arguments.
        fastpersist_roots: checkpoint roots (one per SSD); default ``<output_dir>/fastpersist``.
        fastpersist_mode: the Checkpointer's mode, ``"snapshot"`` (default: save returns once
            the state is copied, the write overlaps the next steps), ``"overlap"`` or ``"sync"``.
        fastpersist_kwargs: further :class:`fastpersist.Checkpointer` arguments (``keep_every``,
            ``snapshot_bytes``, ``config``, ``backend``, ...).
        **kwargs: the Trainer's keyword arguments.

    Raises:
        CheckpointError: a Trainer setting this integration cannot honour.
    """

    def __init__(self, *args: Any, fastpersist_roots: str | Sequence[str] | None = None,
                 fastpersist_mode: str = "snapshot", fastpersist_kwargs: dict[str, Any] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _check_supported(self)
        roots = fastpersist_roots if fastpersist_roots is not None else os.path.join(self.args.output_dir, "fastpersist")
        self.fastpersist_roots = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
        self.fastpersist_mode = fastpersist_mode
        self.fastpersist_kwargs = dict(fastpersist_kwargs or {})
        self._fp: Checkpointer | None = None
        self._fp_resume_dir: str | None = None
        self._fp_loaded: tuple[dict[str, Any], dict[str, Any] | None] | None = None

    @property
    def _fp_files(self) -> FileBackend:
        """The file seam given in ``fastpersist_kwargs`` (``backend``), else real files."""
        backend = self.fastpersist_kwargs.get("backend")
        return backend if isinstance(backend, FileBackend) else REAL_FILES

    @property
    def checkpointer(self) -> Checkpointer:
        """The Checkpointer (created on first use, on every rank)."""
        if self._fp is None:
            kwargs = {"keep": self.args.save_total_limit, **self.fastpersist_kwargs}
            self._fp = Checkpointer(self.fastpersist_roots, mode=self.fastpersist_mode, **kwargs)
            if self.fastpersist_mode == "overlap" and self.optimizer is not None:
                inner: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
                self._fp.protect(inner)
        return self._fp

    # ------------------------------------------------------------------------------------- save

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Checkpoint the training state as step ``state.global_step`` (in the background)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._export_callback_states()
        # Replicated (written once, split over the ranks): the model's parameters, the optimizer,
        # the scheduler, the scaler. Rank 0's own: the TrainerState (its log history holds
        # per-process timings, and the Trainer itself writes trainer_state.json from the main
        # process) and the model's buffers (BatchNorm statistics: each ddp rank's differ).
        # Each rank's own: its RNG states.
        model = fsdp2.model_state(self.model) if self._fsdp2 else self.model.state_dict()
        buffers = {name for name, _ in self.model.named_buffers()}
        own_buffers = {k: model.pop(k) for k in list(model) if k in buffers}
        state: dict[str, Any] = {"model": model}
        rank_state: dict[str, Any] = {}
        if self.args.process_index == 0:
            rank_state.update(trainer_state=_state_json(self.state), model_buffers=own_buffers)
        if not self.args.save_only_model:
            state["optimizer"] = fsdp2.optimizer_state(self.model, self.optimizer) if self._fsdp2 else self.optimizer
            state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            rank_state["rng"] = RNGState()
        self.checkpointer.save(self.state.global_step, state, rank_state=rank_state or None,
                               metadata={"trainer": "transformers", "global_step": self.state.global_step})

    @property
    def _fsdp2(self) -> bool:
        return bool(getattr(self, "is_fsdp_enabled", False)) and _fsdp_version(self) == 2

    def _export_callback_states(self) -> None:
        """Put the stateful callbacks' current state into ``TrainerState`` (as the Trainer does)."""
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()

    # ------------------------------------------------------------------------------------- resume

    def train(self, resume_from_checkpoint: str | bool | int | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` is ``True`` (the latest committed
        checkpoint), a step number, or a checkpoint's step directory in the first root. The
        checkpoints in flight are committed, and the roots released, when it returns."""
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return self._train_and_wait(None, trial, ignore_keys_for_eval, **kwargs)
        step_dir = self._step_dir(resume_from_checkpoint)
        self._fp_loaded = self._read(step_dir)
        files = self._fp_files
        self._fp_resume_dir = files.make_temp_dir("fastpersist-resume-")
        try:
            doc = json.loads(self._fp_loaded[0]["trainer_state"])
            doc.update(is_local_process_zero=self.is_local_process_zero(),  # this process's, not the saver's
                       is_world_process_zero=self.is_world_process_zero())
            files.write_small(os.path.join(self._fp_resume_dir, TRAINER_STATE_NAME),
                              json.dumps(doc, indent=2, sort_keys=True).encode(), -1)
            return self._train_and_wait(self._fp_resume_dir, trial, ignore_keys_for_eval, **kwargs)
        finally:
            try:
                files.rmtree(self._fp_resume_dir, lambda p, e: logger.debug("could not remove %s: %s", p, e))
            except OSError as e:
                logger.debug("could not remove %s: %s", self._fp_resume_dir, e)
            self._fp_resume_dir = None
            self._fp_loaded = None

    def _train_and_wait(self, resume: str | None, trial: Any, ignore_keys_for_eval: Any, **kwargs: Any) -> Any:
        try:
            return super().train(resume_from_checkpoint=resume, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval,
                                 **kwargs)
        finally:
            if self._fp is not None:  # commit what is in flight and release the roots' lock
                fp_, self._fp = self._fp, None
                fp_.close()

    def _step_dir(self, which: str | bool | int) -> str:
        """The step directory (first root) of the checkpoint ``which`` names."""
        if isinstance(which, str) and self._fp_files.is_dir(which):
            return os.path.abspath(which)
        committed = [c for c in list_checkpoints(os.path.abspath(self.fastpersist_roots[0])) if c.committed]
        if which is True:
            latest = [c for c in committed if c.latest] or committed[-1:]
            if not latest:
                raise CheckpointNotFoundError(f"no committed checkpoint in {self.fastpersist_roots[0]} to resume from")
            return latest[0].path
        found = [c for c in committed if not isinstance(which, bool) and isinstance(which, int) and c.step == which]
        if not found:
            raise CheckpointNotFoundError(
                f"resume_from_checkpoint={which!r}: no such committed checkpoint in {self.fastpersist_roots[0]} "
                f"(committed steps: {[c.step for c in committed]})")
        return found[0].path

    def _read(self, step_dir: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The replicated state and this rank's own state of the checkpoint in ``step_dir``."""
        others = [os.path.abspath(r) for r in self.fastpersist_roots[1:]]
        # under FSDP2 the replicated state is read once the Trainer has sharded the model (its
        # DTensors are the destinations: see _load_from_checkpoint)
        state: dict[str, Any] = ({"step_dir": step_dir} if self._fsdp2
                                 else load_checkpoint(step_dir, others, map_location="cpu"))
        objects = catalog.read_manifest(step_dir).objects
        first = load_checkpoint(step_dir, others, rank=0, map_location="cpu") if mf.rank_object(0) in objects else {}
        if self._fsdp2 and "trainer_state" not in first:
            raise CheckpointError(f"{step_dir} was saved by an earlier fastpersist, without FSDP2 (its TrainerState is "
                                  "in the replicated state); resume it without FSDP")
        if "trainer_state" in first:  # (checkpoints of earlier versions hold it in the replicated state)
            state["trainer_state"] = first["trainer_state"]
            state["model_buffers"] = first.get("model_buffers", {})
            if "model" in state:
                state["model"] = {**state["model"], **state["model_buffers"]}
        rank = self.args.process_index
        logger.info("rank %d resumes from %s", rank, step_dir)
        own = first if rank == 0 else (load_checkpoint(step_dir, others, rank=rank, map_location="cpu")
                                       if mf.rank_object(rank) in objects else {})
        if "rng" in first and "rng" not in own:
            logger.warning("the checkpoint in %s was saved by fewer processes: process %d has no RNG state to "
                           "restore (as the Trainer's own checkpoints; resuming is not bit-exact then)", step_dir, rank)
        return state, own if "rng" in own else None

    def _loaded(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        if self._fp_loaded is None:
            raise CheckpointError("fastpersist: no checkpoint is being resumed from")
        return self._fp_loaded

    def _ours(self, checkpoint: str | None) -> bool:
        return checkpoint is not None and checkpoint == self._fp_resume_dir and self._fp_loaded is not None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = self.model if model is None else model
        state = self._loaded()[0]
        if self._fsdp2:
            self._load_sharded(target, state)
            return None
        target.load_state_dict(state["model"])
        return None

    def _load_sharded(self, model: Any, state: dict[str, Any]) -> None:
        """Under FSDP2: read the replicated state into this process's DTensors at the current
        mesh (each rank reads only the bytes its shards overlap) and hand the model its own."""
        step_dir = state["step_dir"]
        view = open_view([os.path.dirname(step_dir), *(os.path.abspath(r) for r in self.fastpersist_roots[1:])],
                         config=self.fastpersist_kwargs.get("config"), backend=self.fastpersist_kwargs.get("backend"))
        step = catalog.parse_step_dir(os.path.basename(step_dir))
        if step is None:
            raise CheckpointError(f"{step_dir} is not a checkpoint's step directory")
        templates = {"model": fsdp2.model_state(model, cpu_offload=True)}
        into: dict[str, Any] = dict(templates)
        if any(e.path[0] == "optimizer" for e in view.manifest(step).sharded):
            into["optimizer"] = fsdp2.optimizer_template(model, self.optimizer)
        expected = fsdp2.sharded_names(templates)
        loaded = view.load(step, into=into, map_location="cpu")  # fills the templates: nothing live yet
        fsdp2.check_sharded(loaded, expected, step_dir)
        state.update(loaded)
        fsdp2.set_model_state(model, {**state["model"], **state.get("model_buffers", {})})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        state = self._loaded()[0]
        if "optimizer" in state:
            if self._fsdp2:
                fsdp2.set_optimizer_state(self.model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["scheduler"])
        return None

    def _load_scaler(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        state = self._loaded()[0]
        if scaler is not None and "scaler" in state:
            scaler.load_state_dict(state["scaler"])
        return None

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if not self._ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        own = self._loaded()[1]
        if own is None:
            logger.info("the checkpoint holds no RNG state (save_only_model); reproducibility is not "
                        "guaranteed")
            return None
        RNGState().load_state_dict(own["rng"])
        return None


def _state_json(state: Any) -> str:
    """``TrainerState`` as the JSON text ``TrainerState.save_to_json`` writes."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _fsdp_version(trainer: Trainer) -> int:
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    return int(getattr(plugin, "fsdp_version", 1))


def _check_supported(trainer: Trainer) -> None:
    args = trainer.args
    if args.load_best_model_at_end or str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
        raise CheckpointError("FastPersistTrainer does not support load_best_model_at_end or save_strategy='best' "
                              "(they rely on the Trainer's checkpoint directories); use the plain Trainer for them")
    if getattr(trainer, "is_deepspeed_enabled", False) or (
            getattr(trainer, "is_fsdp_enabled", False) and _fsdp_version(trainer) != 2):
        raise CheckpointError(
            "FastPersistTrainer does not support DeepSpeed or FSDP1: their engines keep the state in formats of "
            "their own (ZeRO partitions, flat parameters); fastpersist saves FSDP2's DTensor state "
            "(fsdp_config={'fsdp_version': 2}); use the plain Trainer for these")
    if args.push_to_hub:
        raise CheckpointError("FastPersistTrainer does not push checkpoints to the Hub (push_to_hub=True)")

"""The checkpoint lifecycle of a run: find, restore (falling back over damage), save, keep, lock.

    checkpointer = Checkpointer(run)             # a nanoflow.run.Run (or a Config: its run is opened)
    with checkpointer.locked():                  # the run folder's lock, from before anything is read
        state = checkpointer.restore()           # a fresh state, or the one the checkpoint to resume from holds
        ...
        checkpointer.after_step(state, stopping=why)   # after each step: commits a save in flight once
                                                       # written, saves when due (save(state) saves now)

nanoflow.training.loop.open_training makes these calls in the order a training run needs (docs/design.md, "Shape").
Under torchrun every rank makes the same calls. Rank 0 lists the checkpoints, takes the lock and
commits; every rank reads and writes only the boxes it holds (nanoflow.parallel.shards); every rank
agrees on each outcome (nanoflow.parallel.agree), so that an error on one rank stops them all instead
of leaving the others waiting. The bytes, the layout and the commit protocol are nanoflow.io's.

With [checkpoints] async_save, a save copies this rank's boxes to host memory and a background thread
(nanoflow/checkpoint/async_save.py) writes them while training goes on; the commit, by the same protocol, follows
at the first poll() that finds every rank's files written, or at finish(). Every collective stays on
the calling thread, in the order every rank makes its calls (docs/resume.md says why); the writing
thread only writes this rank's files.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, TextIO

import attrs

from nanoflow import console, io
from nanoflow.build import build_model, build_optimizer, init_state, is_fused
from nanoflow.checkpoint.async_save import BackgroundWork, HostCopy
from nanoflow.checkpoint.lineage import Lineage, begun_from_start, flags_note
from nanoflow.checkpoint.resume_checks import Findings, check_data, check_lr, check_model, check_optimizer, check_rope
from nanoflow.config import Config
from nanoflow.errors import StorageLostError
from nanoflow.io.checkpoint import commit, new_save, no_intact_checkpoint, write_files
from nanoflow.io.store import StoreError
from nanoflow.parallel import threads
from nanoflow.parallel.agree import any_failed, every_rank, on_every_rank, on_main
from nanoflow.parallel.mesh import Topology, gather_objects
from nanoflow.parallel.shards import load_ema, load_moments, load_weights, state_blocks
from nanoflow.run import Run, as_run
from nanoflow.schedule import (
    ResumePoint,
    TrainingMetadata,
    active_stage,
    begun_stages,
    is_save_step,
    resume_point,
    training_metadata,
)
from nanoflow.state import TrainState, ema_of

log = logging.getLogger(__name__)

@attrs.frozen
class InFlight:
    """An asynchronous save of step `step` being written; `info` is what its metadata records."""

    step: int
    info: dict
    work: BackgroundWork


def checkpoint_info(state: TrainState, data_fingerprint: dict | None = None, lineage: Lineage = Lineage(),
                    eval_fingerprint: dict | None = None) -> dict:
    """What a checkpoint of `state` records besides its tensors (with `data_fingerprint`, {stage name:
    fingerprint} of the begun stages, and `eval_fingerprint`, {eval set name: fingerprint}, when given; `lineage`:
    where the run began, nanoflow/checkpoint/lineage.py)."""
    info: dict[str, Any] = {
        "training": training_metadata(state.schedule, state.step).to_dict(),
        "lr_origin": state.lr_origin,
        "lineage": lineage.to_dict(),
        "topology": state.topology.to_dict(),
        "threads": threads.current(),   # the intra-op threads it trained with: a resume keeps them
        "config": state.config.to_dict(),
    }
    # The AdamW implementation it trained with, resolved (the key may be unset: fused by default): a resume keeps it
    info["config"]["optimizer"]["optimizer_factory"]["torch_adam_is_fused"] = is_fused(state.optimizer)
    if data_fingerprint is not None:
        info["data_fingerprint"] = data_fingerprint
    if eval_fingerprint:   # absent without [evaluation]
        info["eval_fingerprint"] = eval_fingerprint
    return info


class Checkpointer:
    """The checkpoints of a run (checkpoints_path, resume_checkpoint_path) on its topology.

    `run` is a nanoflow.run.Run, or a Config whose run is opened here (on `topology`, by default the one
    torchrun's environment describes). The data fingerprints its checkpoints record are the run's. Messages
    go through logging (nanoflow/console.py), to `out` alone when given.
    """

    def __init__(self, run: Run | Config, topology: Topology | None = None, *, out: TextIO | None = None):
        self.run = as_run(run, topology)
        self.config, self.topology = self.run.config, self.run.topology
        self.out = out
        self._host_copy = HostCopy()          # async_save: the host buffers, reused by every save
        self._in_flight: InFlight | None = None
        self._lock: io.RunLock | None = None  # rank 0's hold on the run folder, inside locked()
        self.lineage = Lineage()              # where the run restored began (nanoflow/checkpoint/lineage.py): its saves record it

    def _say(self, text: str) -> None:
        if self.topology.is_main:
            log.info(text)

    def _warn(self, text: str) -> None:
        if self.topology.is_main:
            log.warning(text)

    def _messages(self):
        """Where this call's messages go: to `out` when given, else wherever logging sends them."""
        return console.routed(self.out, enabled=self.topology.is_main) if self.out is not None else contextlib.nullcontext()

    # -- the run lock ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self):
        """Rank 0 holds checkpoints_path's lock (nanoflow.io.lock) inside the block; every rank fails together
        if it cannot be taken. A save still in flight when the block ends is committed before the lock goes
        (when the block raised, only where that needs no other rank: see _settle_after_error)."""
        path, held = self.config.checkpoints.checkpoints_path, []
        with self._messages():  # held on rank 0 alone (a lock is no object to send to the other ranks)
            on_main(lambda: held.append(io.RunLock.acquire(path, run=self.config.general.run)), self.topology)
        self._lock = held[0] if held else None
        try:
            yield self
            self.finish()  # a save left in flight is committed while the lock is still held
        except BaseException as e:
            self._settle_after_error(e)
            raise
        finally:
            lock, self._lock = self._lock, None
            problem = lock.release() if lock is not None else None
            if problem:
                with self._messages():
                    self._warn(problem)

    def _confirm_lock(self) -> None:
        """Rank 0: renew the run lock now and raise LockLostError if another run has taken it (nothing outside
        locked(), where this checkpointer holds no lock)."""
        if self._lock is not None:
            self._lock.confirm()

    # -- restoring -------------------------------------------------------------------------------

    def restore(self, fresh: bool = False) -> TrainState:
        """A fresh state, or the one the checkpoint to resume from recorded, on this topology.

        resume_checkpoint_path, when set, must hold a committed checkpoint (never a silent fresh
        start); otherwise the run's own checkpoints_path is resumed from when it holds one, so
        rerunning the same command after a crash continues the run. `fresh` ignores both. Rank 0
        lists the checkpoints to try; every rank then reads, and checks, just the shards it holds. A
        checkpoint found damaged on any rank gives way, on all of them, to the next older intact one
        of a run folder (a step folder named on its own has none: its damage is the error).
        """
        with self._messages():
            return self._restore(fresh)

    def _restore(self, fresh: bool) -> TrainState:
        root, folders, start = on_main(lambda: self._checkpoints_to_try(fresh), self.topology)
        self.lineage = Lineage.started()   # a fresh start begins a history of its own
        if not folders:
            self._settle_threads(None)   # before the weights are drawn: the count is part of the numbers
            return init_state(self.run)
        state, reader, point, self.lineage = self._first_intact(root, folders, start)
        checkpoints, schedule = self.config.checkpoints, self.run.schedule
        if state.step >= schedule.train_steps:
            self._say(f"nothing to do: {reader.path} has all {schedule.train_steps} steps done")
            return state
        skipped = [] if start is None else [
            what for what, loaded in (("optimizer moments", checkpoints.load_optimizer),
                                      ("LR schedule position", checkpoints.load_lr_scheduler)) if not loaded]
        self._say(f"resuming from {reader.path}: step {state.step} done, next step {point.step} "
                  f'(stage "{schedule.stages[point.stage].name}", {point.samples_in_stage} samples in)'
                  + (f"; fresh {' and '.join(skipped)}" if skipped else ""))
        note = None if start is not None else flags_note(checkpoints.load_optimizer, checkpoints.load_lr_scheduler,
                                                         self.lineage)
        if note:
            self._say(note)
        return state

    def _first_intact(self, root: str, folders: list[str], start: str | None):
        """_restore_from the first of `folders` (of `root`) that every rank reads back intact: one found damaged
        gives way, on every rank, to the next older one; a step folder named on its own has none (its damage is
        the error)."""
        damaged = []
        for folder in folders:
            try:
                return self._restore_from(folder, start)
            except io.DamagedCheckpointError as e:
                if len(folders) == 1:
                    raise
                damaged.append(str(e))
                self._warn(f"{folder} is damaged, trying an older checkpoint: {e}")
        raise no_intact_checkpoint(root, damaged)

    def _checkpoints_to_try(self, fresh: bool) -> tuple[str, list[str], str | None]:
        """(the folder listed, the step folders to resume from in the order to try them, resume_checkpoint_path
        when they are its: the run starts there); no folders for a fresh start."""
        checkpoints = self.config.checkpoints
        root, folders, start = checkpoints.checkpoints_path, [], None
        if fresh:
            self._say_what_fresh_ignores()
        elif checkpoints.resume_checkpoint_path is not None and (own := self._own_checkpoints()):
            # resume_checkpoint_path is where the run began (a branch, or an older checkpoint of its own): once the
            # run has committed checkpoints that began there, rerunning the same command continues them instead
            # of starting over (and of applying load_optimizer / load_lr_scheduler = false again).
            folders = own
            self._say(f"checkpoints_path = {root} holds this run's own checkpoints: continuing them, not "
                      f"resume_checkpoint_path = {checkpoints.resume_checkpoint_path} (where the run began)")
        elif checkpoints.resume_checkpoint_path is not None:
            root = start = checkpoints.resume_checkpoint_path
            folders = io.checkpoints_to_try(root)
            if not folders:
                raise io.CheckpointError(
                    f"checkpoints.resume_checkpoint_path = {root} holds no committed checkpoint; refusing to "
                    "start from scratch (unset it, or pass --fresh)")
        else:
            try:
                folders = io.checkpoints_to_try(root)
            except io.DamagedCheckpointError as e:
                raise io.DamagedCheckpointError(f"{e}\nRefusing to start from scratch over them: repair or "
                                                "move them, or pass --fresh") from None
        return root, folders, start

    def _own_checkpoints(self) -> list[str]:
        """The committed checkpoints of checkpoints_path that began from resume_checkpoint_path, newest first: they
        were committed after it was read, so they lead the commit order. Inside the run's own folder, the older
        history the start rewinds follows them (and is not theirs); a checkpoint of another start is said."""
        checkpoints = self.config.checkpoints
        assert checkpoints.resume_checkpoint_path is not None   # called only with one
        descendants, passed_over = begun_from_start(checkpoints.checkpoints_path, checkpoints.resume_checkpoint_path)
        if passed_over:
            self._say(passed_over)
        return descendants

    def _say_what_fresh_ignores(self) -> None:
        """Name the committed checkpoints --fresh passes over, so that nobody takes a fresh start for a resume."""
        checkpoints, seen = self.config.checkpoints, set()
        for key in ("checkpoints_path", "resume_checkpoint_path"):
            where = getattr(checkpoints, key)
            if where is None or where in seen:
                continue
            seen.add(where)
            try:
                steps = sorted(int(folder.rstrip("/").rpartition("/")[2]) for folder in io.checkpoints_to_try(where))
            except Exception as e:  # noqa: BLE001 - only a message: what cannot be listed must not stop a fresh start
                self._say(f"--fresh: could not list checkpoints.{key} = {where} ({type(e).__name__}: {e})")
                continue
            if steps:
                self._say(f"--fresh: starting from step 1, ignoring the committed checkpoints of checkpoints.{key} = "
                          f"{where} (step{'s' * (len(steps) > 1)} {', '.join(map(str, steps))}); they are not "
                          "deleted: a step is replaced only when this run commits its own")
            elif key == "resume_checkpoint_path":   # set, and not used: without --fresh it would be an error
                self._say(f"--fresh: starting from step 1; checkpoints.resume_checkpoint_path = {where} is not used "
                          "(it holds no committed checkpoint either)")

    def _restore_from(self, folder: str, start: str | None) -> tuple[TrainState, io.CheckpointReader, ResumePoint,
                                                                      Lineage]:
        """The state step folder `folder` holds, its reader, where training goes on from it and the lineage the
        run's checkpoints record from now on; checked before any tensor is read: the trained history
        (ScheduleDriftError), the begun stages' RoPE (ScheduleDriftError), the model, the data, the LR
        (LRChangedError). With `start` (the run starts from resume_checkpoint_path), load_optimizer /
        load_lr_scheduler = false act: fresh AdamW state, the LR schedule restarted (warmup included) at the resume
        step; a resume of the run's own checkpoint continues what it holds."""
        reader = on_every_rank(lambda: io.CheckpointReader(folder), self.topology)
        self._settle_threads(reader.metadata.get("threads"))
        trained = TrainingMetadata.from_dict(reader.metadata["training"])
        point = resume_point(self.run.schedule, trained)  # raises ScheduleDriftError if the config rewrites history
        self._tell(check_rope(reader, self.run, trained))   # first: a [model] RoPE change that refuses is not said
        self._tell(check_model(reader, self.run))
        self._tell(check_data(reader, self.run))
        fused, findings = check_optimizer(reader, self.run)
        self._tell(findings)
        checkpoints, saved_origin = self.config.checkpoints, int(reader.metadata.get("lr_origin", 0))
        saved = Lineage.of(reader.metadata) or Lineage()
        if start is None:
            lr_origin, lineage, moments = saved_origin, saved, True
        else:
            lr_origin = saved_origin if checkpoints.load_lr_scheduler else trained.completed
            lineage = Lineage.started(saved.optimizer_origin if checkpoints.load_optimizer else trained.completed,
                                      start.rstrip("/"), trained.completed)
            moments = checkpoints.load_optimizer
        if lr_origin == saved_origin:  # (a restarted schedule was asked for: its LR is new by design)
            self._tell(check_lr(reader, self.run, trained.completed, lr_origin))
        state = on_every_rank(lambda: self._read_state(reader, trained, lr_origin, moments, fused),
                              self.topology)
        return state, reader, point, lineage

    def _settle_threads(self, recorded: int | None) -> None:
        """The intra-op thread count this run trains with (nanoflow.parallel.threads): the count the checkpoint
        resumed from recorded, else one chosen now, by rank 0 for every rank; or the user's, said when it
        differs from the recorded one."""
        if threads.chosen():
            count, line = on_main(lambda: threads.choose(recorded), self.topology)
            threads.apply(count)
            self._say(line + ("; a resume keeps it, bit for bit" if recorded is None else ""))
        elif (line := threads.mismatch(recorded)) is not None:
            self._warn(line)

    def _read_state(self, reader: io.CheckpointReader, trained: TrainingMetadata, lr_origin: int,
                    moments: bool, fused: bool) -> TrainState:
        """This rank's boxes of the weights (and of the AdamW state, with `moments`) into a new model and optimizer
        (fused as the checkpoint's was, where the config leaves it to the checkpoint)."""
        config = self.config
        model = build_model(config, self.topology, init=False,   # the RoPE of the stage that trained its last step
                            stage=active_stage(self.run.schedule, max(trained.completed, 1)))
        load_weights(model, reader, reader.path)
        optimizer = build_optimizer(model, config.optimizer, recorded_fused=fused)
        if moments:
            load_moments(model, optimizer, reader)
        ema = None
        if config.keeps_ema:
            # A checkpoint saved without an EMA (ema_decay set on a resume) starts one from the weights it holds.
            ema = load_ema(model, reader)
            if ema is None:
                ema = ema_of(model)
                self._say(f"ema_decay: {reader.path} holds no weight EMA; the EMA starts from its "
                          f"weights at step {trained.completed}")
        return TrainState.create(step=trained.completed, model=model, optimizer=optimizer, lr_origin=lr_origin,
                                 run=self.run, ema=ema)

    def _tell(self, findings: Findings) -> None:
        for line in findings.warnings:
            self._warn(line)
        for line in findings.notes:
            self._say(line)

    # -- saving ----------------------------------------------------------------------------------

    def should_save(self, step: int, stopping=None) -> bool:
        """Whether the loop saves after `step`: every checkpoint_interval steps, after the last one
        (nanoflow.schedule.is_save_step), and when stopping (a signal, or a planned stop: `stopping` says why)."""
        return is_save_step(step, self.config.checkpoints.checkpoint_interval, self.run.schedule.train_steps) \
            or bool(stopping)

    def after_step(self, state: TrainState, *, stopping=None) -> str | None:
        """What the loop calls after every step: commit the save in flight once every rank has written it,
        then save `state` when should_save says so (waiting for the commit at the run's last step or a stop:
        `stopping` says why the run stops after it). The folder committed by this call, if any.

        Storage lost on the way (S3 unreachable, a write refused) is a StorageLostError: what was committed
        before stands."""
        with _storage_lost():
            committed = self.poll()
            if not self.should_save(state.step, stopping):
                return committed
            return self.save(state, last=bool(stopping) or state.step == self.run.schedule.train_steps)

    def save(self, state: TrainState, *, last: bool = False) -> str | None:
        """Commit `state` as a checkpoint of step state.step under checkpoints_path; the step folder.

        Rank 0 confirms the run lock is still this run's and marks the folder as a save; every rank
        writes its boxes; rank 0 commits (the metadata, then latest.txt) and drops what `keep` no longer
        keeps; no rank goes on before the commit has landed.

        With [checkpoints] async_save, each rank's boxes are copied to host memory here and written by a
        background thread while training goes on; poll() or finish() commits them once every rank's files
        are written (rank 0 confirming the lock first). This returns None then — or, with `last` (the
        run's end, a stop), waits and returns the folder. A save still in flight is committed first: at
        most one is. What the metadata records (the schedule position, the data fingerprints) is taken
        here, at the save step.
        """
        state.check_live()
        self.finish()
        topology, checkpoints = self.topology, self.config.checkpoints
        fingerprint = evals = None
        if topology.is_main:  # only rank 0 writes the metadata
            fingerprint = self.run.fingerprints.of([s.name for s in begun_stages(state.schedule, state.step)])
            evals = self.run.fingerprints.evals()
        info = checkpoint_info(state, fingerprint, self.lineage, evals)
        groups = state_blocks(state.model, state.optimizer, topology, state.ema)
        root, step = checkpoints.checkpoints_path, state.step
        on_main(self._confirm_lock, self.topology)  # still ours: renewed now
        suffix = on_main(lambda: new_save(root, step, groups), self.topology)
        if not checkpoints.async_save:
            gathered = gather_objects(write_files(root, step, groups, suffix, topology.rank), topology)
            return self._commit(step, gathered, info)
        host = self._host_copy
        copied = host.copy(groups)

        def write() -> tuple[dict, dict]:
            host.ready()
            return write_files(root, step, copied, suffix, topology.rank)

        self._in_flight = InFlight(step, info, BackgroundWork(write, name=f"nanoflow: saving step {step}"))
        return self.finish() if last else None

    def poll(self) -> str | None:
        """Commit the save in flight if every rank has written its files by now; its folder, else None. Cheap:
        nothing while no save is in flight, one small collective under torchrun while one is."""
        if self._in_flight is None:
            return None
        if not every_rank(self._in_flight.work.done, self.topology):
            return None
        return self.finish()

    def finish(self) -> str | None:
        """Wait for the save in flight, if any, and commit it once every rank's files are written; its folder.

        A write that failed on any rank fails every rank alike (StorageLostError, naming the step and the
        rank): nothing of it is committed, and the checkpoints committed before stand."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        failure = None
        try:
            written = in_flight.work.wait()
        except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
            written, failure = None, e
        gathered, failed = any_failed(written, failure, self.topology)
        if failed is not None:
            rank, report = failed
            where = f" (on rank {rank})" if self.topology.world_size > 1 else ""
            raise StorageLostError(f"the checkpoint of step {in_flight.step} could not be written{where}: {report}\n"
                                   "nothing of it was committed; the last committed checkpoint stands: run the "
                                   "same command again to resume from it") from failure
        return self._commit(in_flight.step, gathered, in_flight.info)

    def _commit(self, step: int, gathered: list[tuple[dict, dict]], info: dict) -> str:
        root, checkpoints = self.config.checkpoints.checkpoints_path, self.config.checkpoints

        def commit_on_main() -> str:
            if checkpoints.async_save:  # the write took a while, in the background: still ours?
                self._confirm_lock()
            return commit(root, step, gathered, info, keep=checkpoints.keep)

        with self._messages():
            folder = on_main(commit_on_main, self.topology)
            self._say(f"saved step {step}: {folder}")
        return folder

    def _settle_after_error(self, error: BaseException) -> None:
        """The block under locked() raised `error`: commit a save still in flight if that needs no other rank
        (a single process, an ordinary exception), else leave it uncommitted, saying so (under torchrun the
        other ranks may never reach the agreement; after a second Ctrl-C nobody waits for a write)."""
        if self._in_flight is None:
            return
        step = self._in_flight.step
        if self.topology.world_size == 1 and isinstance(error, Exception):
            try:
                self.finish()
                return
            except Exception as e:  # noqa: BLE001 - the error that stopped the run is the one raised
                problem = str(e).partition("\n")[0]
        else:
            self._in_flight = None
            problem = "the run stopped before every rank had written it"
        with self._messages():
            self._warn(f"the checkpoint of step {step} was not committed: {problem}")


@contextlib.contextmanager
def _storage_lost():
    """Storage failing once training has begun (a StoreError, or a checkpoint error it caused) as a
    StorageLostError: not the config's fault, and what was committed stands."""
    try:
        yield
    except (StoreError, io.CheckpointError) as e:
        if isinstance(e, io.CheckpointError) and not isinstance(e.__cause__, StoreError):
            raise
        raise StorageLostError(f"{e}\nthe last committed checkpoint stands: run the same command again to resume "
                               "from it") from None

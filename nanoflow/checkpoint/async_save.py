"""The two pieces of an asynchronous save ([checkpoints] async_save): a host copy of the state's blocks,
taken at the save step, and the thread that writes it while training goes on.

When to copy, wait and commit, and the agreement between ranks, are the Checkpointer's
(nanoflow/checkpoint/checkpointer.py); the bytes are nanoflow.io's. Nothing here runs a collective.
"""

from __future__ import annotations

import threading

import attrs
import torch

from nanoflow.io import Block


class HostCopy:
    """Host buffers holding a copy of a state's blocks, reused from one save to the next.

    At most one save is in flight, and the next copy is taken only once it is written, so a buffer is
    free again by then: the first save allocates (and faults in) the buffers, later ones only copy.
    From CUDA they are pinned, so the device-to-host copy runs at the bus's speed without a staging
    copy, queued on the current stream (behind the step that made the values, ahead of the next one
    that changes them); `ready()` waits for it, on the writing thread.
    """

    def __init__(self):
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def copy(self, groups: dict[str, dict[str, Block]]) -> dict[str, dict[str, Block]]:
        """`groups` with each block's data copied into this copy's buffers (the same shapes, names, offsets)."""
        copied: dict[str, dict[str, Block]] = {}
        on_cuda = False
        for group, blocks in groups.items():
            copied[group] = {}
            for name, block in blocks.items():
                on_cuda |= block.data.is_cuda
                buffer = self._buffer((group, name), block.data)
                buffer.copy_(block.data, non_blocking=block.data.is_cuda)
                copied[group][name] = attrs.evolve(block, data=buffer)
        self._copied = None
        if on_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return copied

    def ready(self) -> None:
        """Wait until the last copy has landed in host memory (at once for a copy from the CPU)."""
        if self._copied is not None:
            self._copied.synchronize()

    def _buffer(self, key: tuple[str, str], data: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
            buffer = torch.empty(data.shape, dtype=data.dtype, device="cpu",
                                 pin_memory=data.is_cuda and torch.cuda.is_available())
            self._buffers[key] = buffer
        return buffer


# The writing threads alive in this process. A fact of the process, not of a run: exit_process must know of a thread
# still in torch's code whichever run (or none, once it raised) started it, and it has no run to ask.
_running: set[threading.Thread] = set()


def writing() -> bool:
    """Whether a BackgroundWork thread is still running in this process."""
    return any(thread.is_alive() for thread in _running)


class BackgroundWork:
    """work() on a thread of its own, started at once; wait() returns what it returned or raises what it raised.

    A daemon thread: a process that must end at once (a second Ctrl-C, an error under torchrun) is not
    held up by a write, which then ends like a killed one (nothing committed, the temporaries cleaned
    up by the next commit)."""

    def __init__(self, work, name: str):
        self._result = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        _running.add(self._thread)
        self._thread.start()

    def _run(self, work) -> None:
        try:
            self._result = work()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits, on the main thread
            self._error = e
        finally:
            _running.discard(threading.current_thread())

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

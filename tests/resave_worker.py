"""Run under torchrun by test_parallel.py: restore a checkpoint on this layout, then save it again unchanged.

    torchrun --nproc_per_node=N tests/resave_worker.py SOURCE DESTINATION [SECTION.KEY=VALUE ...]

The re-saved checkpoint must hold exactly the tensors of the source: what a layout reads is what it writes.
"""

import sys

from helpers import TINY

from nanoflow import load_config
from nanoflow.checkpoint.checkpointer import Checkpointer
from nanoflow.parallel.mesh import exit_process, init_topology, shutdown

source, destination, *overrides = sys.argv[1:]
config = load_config(TINY, [
    *overrides, f'checkpoints.resume_checkpoint_path="{source}"', f'checkpoints.checkpoints_path="{destination}"'])
topology = init_topology(config)
checkpointer = Checkpointer(config, topology)
checkpointer.save(checkpointer.restore())
shutdown()
exit_process(0)

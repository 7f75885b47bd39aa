"""What test_resume.py and its process-level tests share."""


from nanoflow.checkpoint.checkpointer import Checkpointer


def restore(config, *, fresh: bool = False, out):
    return Checkpointer(config, out=out).restore(fresh=fresh)

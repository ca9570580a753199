"""A SIGKILL at a chosen point, for the checkpoint tests. Python imports this file at start-up when its directory is
on PYTHONPATH; it acts only in the rank named by KILL_RANK, at the point named by KILL_AT:
    KILL_AT=backward:9          at that rank's 9th backward pass (in the middle of a training step)
    KILL_AT=replace:step_000004  when that rank renames a file of the step-4 checkpoint into place (mid-save: the
                                 shard is written to its temporary file, and is never renamed)
SIGKILL, like a node lost or an out-of-memory kill: no exception, no clean-up, no flushing."""
import os
import signal

if os.environ.get("KILL_AT") and os.environ.get("RANK") == os.environ.get("KILL_RANK"):
    what, where = os.environ["KILL_AT"].split(":", 1)
    if what == "backward":
        import torch.autograd
        calls, backward = [0], torch.autograd.backward

        def counted_backward(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(where):
                os.kill(os.getpid(), signal.SIGKILL)
            return backward(*args, **kwargs)
        torch.autograd.backward = counted_backward
    elif what == "replace":
        replace = os.replace

        def watched_replace(src, dst, *args, **kwargs):
            if where in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
            return replace(src, dst, *args, **kwargs)
        os.replace = watched_replace
    else:
        raise SystemExit(f"KILL_AT={os.environ['KILL_AT']}: expected backward:N or replace:TEXT")

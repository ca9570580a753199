"""A disk that fills up, for the NVMe tier's tests. Python imports this file at start-up when its directory is on
PYTHONPATH; with DISK_FULL_AFTER=K, the (K+1)-th os.pwritev of the process (nvme.StateFile's writes) fails as a full
disk does: OSError ENOSPC, nothing written (with DISK_FULL_RANK=r, only in rank r's process). With DISK_FREE_BYTES=B,
os.statvfs reports B bytes available."""
import errno
import os

rank = os.environ.get("DISK_FULL_RANK")
if os.environ.get("DISK_FULL_AFTER") and rank in (None, os.environ.get("RANK")):
    calls, pwritev = [0], os.pwritev

    def filling_pwritev(fd, buffers, offset, *args):
        calls[0] += 1
        if calls[0] > int(os.environ["DISK_FULL_AFTER"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return pwritev(fd, buffers, offset, *args)
    os.pwritev = filling_pwritev

if os.environ.get("DISK_FREE_BYTES"):
    statvfs = os.statvfs

    class Small:
        """os.statvfs's answer, with B bytes available to this user (in blocks of f_frsize bytes)."""
        def __init__(self, real):
            self.real = real
            self.f_frsize = real.f_frsize
            self.f_bavail = int(os.environ["DISK_FREE_BYTES"]) // real.f_frsize

        def __getattr__(self, name):
            return getattr(self.real, name)

    os.statvfs = lambda path: Small(statvfs(path))

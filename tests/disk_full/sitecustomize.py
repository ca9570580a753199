"""A disk that fills up, for the NVMe tier's tests. Python imports this file at start-up when its directory is on
PYTHONPATH; with DISK_FULL_AFTER=K, the (K+1)-th os.pwritev of the process (nvme.StateFile's writes) fails as a full
disk does: OSError ENOSPC, nothing written."""
import errno
import os

if os.environ.get("DISK_FULL_AFTER"):
    calls, pwritev = [0], os.pwritev

    def filling_pwritev(fd, buffers, offset, *args):
        calls[0] += 1
        if calls[0] > int(os.environ["DISK_FULL_AFTER"]):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return pwritev(fd, buffers, offset, *args)
    os.pwritev = filling_pwritev

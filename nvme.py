"""
nvme.py: the file I/O of ZeRO-Infinity's NVMe tier (arXiv 2104.07857), kept in one place: a rank's optimizer states in
a file of its own, read and written in large aligned blocks that bypass the page cache (O_DIRECT), off the Python
thread, each transfer a Future that the caller waits for explicitly.

    with StateFile(nvme_path, "rank0", nbytes) as f:
        buffer = aligned(4 << 20)
        f.write(0, buffer).result()  # every wait explicit: the buffer may be reused only after it
        f.read(0, buffer).result()

Why O_DIRECT: a page-cached read of what was just written comes from memory, so it would measure (and spend) host
memory, which the tier exists to save. O_DIRECT asks that the buffer's address, the offset and the length be multiples
of the logical block size: ALIGN, 4096, is a multiple of every block size in use. Where a filesystem refuses O_DIRECT
(tmpfs before Linux 6.6) the file is opened buffered, and `direct` and `mode` say so.
"""
import errno
import itertools
import mmap
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from devices import leave_word

ALIGN = 4096


def round_up(nbytes):
    return -(-nbytes // ALIGN) * ALIGN


ON_DISK = ("master", "adam_m", "adam_v")  # the model states the tier keeps in its state file (train_gpt's names)


def nvme_buffer_bytes(buffer_count, largest_bucket, world_size):
    """The tier's host buffers: buffer_count of them, each one bucket's states (12 bytes an element of the largest
    bucket's shard; largest_bucket is padded to a multiple of N), rounded up to ALIGN."""
    return buffer_count * round_up(12 * largest_bucket // world_size)


def nvme_theory(states, world_size, buffer_count, largest_bucket):
    """The tier's formula (offload.py --offload_optimizer nvme), from the model states of offload in host memory: the
    fp32 master and Adam's moments (12Ψ/N) go to the disk, and the host holds buffer_count buffers instead
    (nvme_buffer_bytes). Returns the states left in memory and the bytes on disk."""
    kept = {k: v for k, v in states.items() if k not in ON_DISK}
    kept["nvme_buffers"] = nvme_buffer_bytes(buffer_count, largest_bucket, world_size)
    return kept, sum(states[k] for k in ON_DISK)


def aligned(nbytes):
    """A uint8 CPU tensor of nbytes rounded up to ALIGN whose data_ptr is a multiple of ALIGN: a buffer O_DIRECT can
    read into and write from. An anonymous mapping starts on a page and is exactly its size (the tensor keeps the
    mapping alive)."""
    return torch.frombuffer(mmap.mmap(-1, round_up(nbytes)), dtype=torch.uint8)


def gib(nbytes):
    return f"{nbytes:,} bytes ({nbytes / 2**30:.2f} GiB)"


class NVMeError(SystemExit):
    """A read or write of a state file failed: one line naming the file, the operation, the offset, the bytes and the
    OS error, which ends the run as SystemExit does (no traceback). `errno` is the OS error's number."""
    def __init__(self, message, number):
        super().__init__(message)
        self.errno = number


class StateFile:
    """One rank's optimizer states on disk: a file of nbytes (rounded up to ALIGN) under `directory`, reserved at
    creation, read and written by a pool of `threads` threads (os.preadv and os.pwritev release the GIL, so they run
    beside the Python thread and beside each other). `direct` says whether the file bypasses the page cache; `mode`
    says the same in words, for the engine to print."""
    def __init__(self, directory, name, nbytes, threads=2):
        self.nbytes = round_up(nbytes)
        # A unique name: two runs, or two ranks, given the same directory and name never share a file.
        self.path = os.path.join(directory, f"{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.states")
        self.fd = None
        buffered = self._create(directory)
        # O_DIRECT where the filesystem allows it; the buffered descriptor otherwise.
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_DIRECT)
            os.close(buffered)
            self.direct = True
            self.mode = "O_DIRECT"
        except OSError as e:
            self.fd = buffered
            self.direct = False
            self.mode = f"buffered (the filesystem refuses O_DIRECT: {e.strerror}; reads may come from the page cache)"
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="nvme")

    def _create(self, directory):
        """Every refusal in one place, before anything is written: a missing directory, one this process cannot
        create a file in, or less free space than the file needs. Each is one line naming the path, the bytes and
        the fix. Returns a descriptor of the new file, its space reserved."""
        need = gib(self.nbytes)
        if not os.path.isdir(directory):
            raise SystemExit(f"error: nvme path {directory} does not exist (a state file of {need} goes there): "
                             f"create it (mkdir -p {directory}) or give another directory")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SystemExit(f"error: nvme path {directory} is not writable: cannot create {self.path} ({e.strerror}) "
                             f"for a state file of {need}: give a directory this user can write to") from None
        stat = os.statvfs(directory)
        free = stat.f_bavail * stat.f_frsize
        if free < self.nbytes:
            os.close(fd)
            os.unlink(self.path)
            raise SystemExit(f"error: nvme path {directory} has {gib(free)} free, and a state file there needs "
                             f"{need}: free {self.nbytes - free:,} bytes there or give another directory")
        # Reserve the blocks now, so that a full disk shows here and not in the middle of a step; a filesystem
        # without fallocate gets the file's size alone.
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                os.unlink(self.path)
                raise SystemExit(f"error: nvme path {directory}: cannot reserve {need} for {self.path} "
                                 f"({e.strerror}): free space there or give another directory") from None
            os.ftruncate(fd, self.nbytes)
        return fd

    def read(self, offset, buffer):
        """Start reading the file's bytes [offset, offset + buffer's bytes) into buffer: a Future of the bytes read."""
        return self._submit("read", offset, buffer)

    def write(self, offset, buffer):
        """Start writing buffer's bytes at offset: a Future of the bytes written. The buffer must not change until
        the Future is done."""
        return self._submit("write", offset, buffer)

    def wait(self, future):
        """Wait for a read or write (the same as future.result()): its bytes, or its NVMeError raised here."""
        return future.result()

    def _submit(self, op, offset, buffer):
        # O_DIRECT's rules, kept on a buffered file too, so that code that runs on one runs on the other.
        nbytes = buffer.numel() * buffer.element_size()
        assert buffer.device.type == "cpu" and buffer.is_contiguous(), f"{op}: the buffer is no contiguous CPU tensor"
        assert buffer.data_ptr() % ALIGN == 0, f"{op}: the buffer's address is not a multiple of {ALIGN}: use aligned()"
        assert offset % ALIGN == 0 and nbytes % ALIGN == 0, (
            f"{op}: offset {offset:,} and length {nbytes:,} must be multiples of {ALIGN}")
        assert 0 <= offset and offset + nbytes <= self.nbytes, (
            f"{op}: bytes [{offset:,}, {offset + nbytes:,}) lie outside {self.path} ({self.nbytes:,} bytes)")
        memory = memoryview(buffer.view(-1).view(torch.uint8).numpy())
        return self.pool.submit(self._transfer, op, offset, memory)

    def _transfer(self, op, offset, memory):
        """One read or write, on a pool thread. A transfer may move fewer bytes than asked: go on from where it
        stopped until all are moved."""
        call = os.preadv if op == "read" else os.pwritev
        done = 0
        while done < len(memory):
            try:
                moved = call(self.fd, [memory[done:]], offset + done)
            except OSError as e:
                self._fail(op, offset, len(memory), e.errno, e.strerror)
            # a read at the end of the file, or a write that moved nothing, would loop forever
            if moved == 0:
                self._fail(op, offset, len(memory), errno.EIO, f"{op} moved no bytes at offset {offset + done:,}")
            done += moved
        return done

    def _fail(self, op, offset, nbytes, number, reason):
        if number == errno.ENOSPC:
            reason = "disk full"
        message = f"error: {op} of {nbytes:,} bytes at offset {offset:,} of {self.path} failed: {reason}"
        # the other ranks, which may wait for this one in a collective, say this line too when it has gone
        leave_word(message)
        raise NVMeError(message, number) from None

    def close(self, remove=True):
        """Wait for every read and write in flight, stop the threads, close the file and (remove=True) delete it."""
        if self.fd is None:
            return
        self.pool.shutdown(wait=True)
        os.close(self.fd)
        self.fd = None
        if remove:
            os.unlink(self.path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class DiskStates:
    """One rank's optimizer states on disk, bucket by bucket, and the host buffers they pass through (ZeRO-Infinity's
    swapper). Bucket k's fp32 master, Adam m and v (numels[k] elements each) lie side by side in the file from an
    offset aligned to ALIGN, and always pass through buffer k % count: reading bucket k waits only for that buffer's
    last write, and with count >= 2 a read of the next bucket runs beside the update of this one (3: its write too)."""
    def __init__(self, directory, name, numels, count):
        self.numels = numels
        self.sizes = [round_up(12 * n) for n in numels]
        self.offsets = [sum(self.sizes[:k]) for k in range(len(numels))]
        self.file = StateFile(directory, name, sum(self.sizes))
        self.buffers = [aligned(max(self.sizes)) for _ in range(count)]
        # the write in flight from each buffer; the reads in flight, by bucket
        self.writes = [None] * count
        self.reads = {}

    def _bytes(self, k):
        """Bucket k's part of its buffer, once the buffer's last write is done (a read must not overwrite states that
        are not on disk yet)."""
        write = self.writes[k % len(self.buffers)]
        if write is not None:
            write.result()
        return self.buffers[k % len(self.buffers)][:self.sizes[k]]

    def buffer(self, k):
        """Bucket k's buffer as (master, m, v) fp32 views, once the buffer's last write is done."""
        return self._bytes(k)[:12 * self.numels[k]].view(torch.float32).view(3, -1).unbind()

    def read(self, k):
        """Start reading bucket k's states into its buffer."""
        self.reads[k] = self.file.read(self.offsets[k], self._bytes(k))

    def states(self, k):
        """Bucket k's (master, m, v) in its buffer, read (now, if no read was started ahead)."""
        if k not in self.reads:
            self.read(k)
        self.reads.pop(k).result()
        return self.buffer(k)

    def write(self, k):
        """Start writing bucket k's states back from its buffer."""
        self.writes[k % len(self.buffers)] = self.file.write(self.offsets[k], self._bytes(k))

    def put(self, k, states):
        """Bucket k's states (master, m, v: host or device tensors of numels[k] elements) to the file, through its
        buffer."""
        for view, state in zip(self.buffer(k), states):
            view.copy_(state)
        self.write(k)

    def gather(self):
        """Every bucket's states read into host memory: (master, m, v), each one flat tensor of the buckets in order
        (a rank's flat shard of them, for a checkpoint)."""
        held = [torch.empty(sum(self.numels)) for _ in range(3)]
        for k, start in enumerate(itertools.accumulate([0] + self.numels[:-1])):
            for state, view in zip(held, self.states(k)):
                state[start:start + self.numels[k]] = view
        return held

    def scatter(self, held):
        """gather()'s inverse: every bucket's states (master, m, v: flat tensors of the buckets in order) from host
        memory to the file."""
        for k, start in enumerate(itertools.accumulate([0] + self.numels[:-1])):
            self.put(k, [state[start:start + self.numels[k]] for state in held])

    def close(self):
        """Wait for every read and write, and remove the file."""
        self.file.close()

"""
tests/fake_memory.py: the fake CUDA device's memory (tests/fake_cuda.py hooks it in), counted from the live storages
the fake device tags, as torch's allocators count theirs.

Device memory, per device (CUDACachingAllocator's rules): a block is the request rounded up to 512 bytes; requests up
to 1 MiB come from the small pool's 2 MiB segments, larger ones are rounded up to 2 MiB segments of their own; freed
blocks stay reserved (cached) until empty_cache(). Fragmentation is not modelled: reserved is what the live blocks
need, at its high-water mark. memory_allocated, max_memory_allocated (reset_peak_memory_stats), memory_reserved and
max_memory_reserved answer from it. The device's free memory is a budget per rank: FAKE_CUDA_FREE_BYTES, one number
for every rank or a comma list indexed by the local rank ("4e9,2e9": rank 1 has less); mem_get_info is (budget less
reserved, budget). An allocation that the budget cannot hold, even with the cache emptied, raises
torch.cuda.OutOfMemoryError with torch's message, naming the project's line that asked.

Pinned host memory (CachingHostAllocator's rules): a block is the request rounded up to a power of two; a freed block
is kept, cached, and handed out again to a request of its size; host_memory_stats reports as torch 2.13 does:
allocated_bytes (the blocks owned, active + cached), active_bytes (the blocks handed out), allocations,
active_requests, num_host_alloc and num_host_free.

cuBLAS's workspaces (CublasHandlePool.cpp): the first matmul on a (thread's handle, stream) pair allocates one,
WORKSPACE bytes on the fake device's sm90 (32 MiB, as measured on an H200: tests/gpu_facts_h200.json), through the
caching allocator, so it counts in memory_allocated and its peak; torch._C._cuda_clearCublasWorkspaces frees them all.
A leak: after_step() compares the device memory allocated after each optimizer step, less the workspaces, with the one
before; from the third step on, growth beyond LEAK_ALLOWANCE is a finding naming the file:line that made the blocks
still held.
"""
import collections, os, weakref

import torch

SMALL, ROUND, SEGMENT = 1 << 20, 512, 2 << 20  # the small pool's largest request; block rounding; segment size
LEAK_ALLOWANCE = 4096  # bytes a step may add to what is allocated (a scalar or two), once the run is steady
BUDGET = 2**36  # free bytes per rank when FAKE_CUDA_FREE_BYTES is not set
WORKSPACE = 32 << 20  # one cuBLAS workspace on sm90 (the fake device's capability, (9, 0))


class Block:
    """One live storage's block: its device ("cuda:i" or "pinned"), bytes as the allocator counts them, the line that
    made it, and the optimizer step in which it was made."""
    def __init__(self, device, size, made, step):
        self.device, self.size, self.made, self.step = device, size, made, step


class DeviceMemory:
    def __init__(self, index):
        self.index, self.allocated, self.peak, self.small, self.large = index, 0, 0, 0, 0
        self.reserved, self.peak_reserved = 0, 0

    def need(self):
        """Reserved bytes the live blocks need: whole 2 MiB segments of the small pool, the large blocks' own."""
        return -(-self.small // SEGMENT) * SEGMENT + self.large

    def budget(self):
        budgets = os.environ.get("FAKE_CUDA_FREE_BYTES", str(BUDGET)).split(",")
        return int(float(budgets[min(self.index, len(budgets) - 1)]))


devices = {}
blocks = {}  # id(block) -> block, for every live block (device and pinned)
host = collections.Counter()  # host_memory_stats
cached = collections.Counter()  # pinned block size -> free blocks kept for reuse
steps = dict(done=0, allocated=[])  # optimizer steps finished; device memory allocated after each
workspaces = {}  # (device index, handle, stream) -> the workspace's bytes


def device_block(nbytes):
    return ROUND * max(1, -(-nbytes // ROUND)) if nbytes else 0

def pinned_block(nbytes):
    return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0

def memory(index):
    if index not in devices:
        devices[index] = DeviceMemory(index)
    return devices[index]

def size_text(n):
    """As torch's format_size: bytes, KiB, MiB, GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"

def take(m, size, made):
    """The device's accounting for a new block of `size`; OutOfMemoryError where the budget cannot hold it."""
    pool = "small" if size <= SMALL else "large"
    grown = -(-size // SEGMENT) * SEGMENT if pool == "large" else size
    setattr(m, pool, getattr(m, pool) + grown)
    if m.need() > m.budget():
        setattr(m, pool, getattr(m, pool) - grown)
        budget = m.budget()
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {size_text(size)}. GPU {m.index} has a total capacity of "
            f"{size_text(budget)} of which {size_text(max(0, budget - m.reserved))} is free. Of the allocated memory "
            f"{size_text(m.allocated)} is allocated by PyTorch, and {size_text(m.reserved - m.allocated)} is reserved "
            f"by PyTorch but unallocated. (fake CUDA: asked at {made}; FAKE_CUDA_FREE_BYTES sets the budget)")
    m.allocated += size
    m.peak = max(m.peak, m.allocated)
    m.reserved = max(m.reserved, m.need())
    m.peak_reserved = max(m.peak_reserved, m.reserved)

def give(m, size):
    pool = "small" if size <= SMALL else "large"
    setattr(m, pool, getattr(m, pool) - (-(-size // SEGMENT) * SEGMENT if pool == "large" else size))
    m.allocated -= size

def counted(kind, value, sign):
    host[f"{kind}.current"] += sign * value
    host[f"{kind}.peak"] = max(host[f"{kind}.peak"], host[f"{kind}.current"])
    host[f"{kind}.{'allocated' if sign > 0 else 'freed'}"] += value

def pinned_take(size):
    if cached[size]:  # a cached block of this size is handed out again
        cached[size] -= 1
    else:
        host["num_host_alloc"] += 1
        counted("allocations", 1, 1)
        counted("allocated_bytes", size, 1)
    counted("active_requests", 1, 1)
    counted("active_bytes", size, 1)

def pinned_give(size):
    cached[size] += 1  # kept for reuse: still allocated_bytes
    counted("active_requests", 1, -1)
    counted("active_bytes", size, -1)

def allocated(storage, device, made):
    """A new storage on the fake device ("cuda:i") or in pinned host memory ("pinned"): counted while it lives."""
    if device == "pinned":
        block = Block(device, pinned_block(storage.nbytes()), made, steps["done"])
        if block.size:
            pinned_take(block.size)
    else:
        block = Block(device, device_block(storage.nbytes()), made, steps["done"])
        if block.size:
            take(memory(int(device.split(":")[1])), block.size, made)
    blocks[id(block)] = block
    weakref.finalize(storage, freed, block)
    return block

def freed(block):
    blocks.pop(id(block), None)
    if not block.size:
        return
    if block.device == "pinned":
        pinned_give(block.size)
    else:
        give(memory(int(block.device.split(":")[1])), block.size)

def resized(block, nbytes, made):
    """A storage resized in place (stage 3 frees a parameter's storage with resize_(0) and brings it back)."""
    freed(block)
    block.size = (pinned_block if block.device == "pinned" else device_block)(nbytes)
    block.made = made
    block.step = steps["done"]
    blocks[id(block)] = block
    if block.size and block.device == "pinned":
        pinned_take(block.size)
    elif block.size:
        take(memory(int(block.device.split(":")[1])), block.size, made)

def workspace(index, handle, stream, made):
    """A matmul on device `index` by `handle` (a thread's cuBLAS handle) on `stream`: the pair's workspace, made at
    its first matmul (OutOfMemoryError where the budget cannot hold it) and kept."""
    if (index, handle, stream) not in workspaces:
        take(memory(index), WORKSPACE, made)
        workspaces[index, handle, stream] = WORKSPACE

def workspace_bytes(index):
    return sum(size for (i, _, _), size in workspaces.items() if i == index)

def clear_workspaces():
    """torch._C._cuda_clearCublasWorkspaces: every workspace freed (the next matmul on a pair makes it again)."""
    for (index, _, _), size in workspaces.items():
        give(memory(index), size)
    workspaces.clear()

def empty_cache():
    for m in devices.values():
        m.reserved = m.need()
    for size, n in list(cached.items()):
        host["num_host_free"] += n
        counted("allocations", n, -1)
        counted("allocated_bytes", size * n, -1)
    cached.clear()

def reset_peak(index):
    m = memory(index)
    m.peak, m.peak_reserved = m.allocated, m.reserved

def mem_get_info(index):
    m = memory(index)
    return max(0, m.budget() - m.reserved), m.budget()

def host_memory_stats():
    return dict(host)

def grew(index):
    """Whether the device holds more than after the previous step, by more than the allowance (a leak, if it stays)."""
    if steps["done"] < 2:
        return False
    return memory(index).allocated - workspace_bytes(index) - steps["allocated"][-1] > LEAK_ALLOWANCE


def after_step(index):
    """Called after each optimizer step: (the file:line that made most of it, a finding) when the device holds more
    than after the previous step, from the third step on (the first steps make Adam's moments and the buffers that
    are then reused)."""
    steps["done"] += 1
    now = memory(index).allocated - workspace_bytes(index)  # (the workspaces: cuBLAS's, cleared and made again)
    steps["allocated"].append(now)
    if steps["done"] < 3 or now - steps["allocated"][-2] <= LEAK_ALLOWANCE:
        return None
    kept = collections.Counter()
    for b in blocks.values():
        if b.device != "pinned" and b.step == steps["done"] - 1:  # made in this step, still held
            kept[b.made] += b.size
    held = ", ".join(f"{size_text(n)} made at {at}" for at, n in kept.most_common(3))
    first = kept.most_common(1)[0][0] if kept else "?"
    return first, (f"device memory leak: {size_text(now - steps['allocated'][-2])} more allocated after step "
                   f"{steps['done']} than after step {steps['done'] - 1}; held: {held}")

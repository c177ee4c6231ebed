"""hostmem.release: a server that made its own copy of part of a shared region gives those pages back to the pod
(strategy experts' quantized layers), while the rest of the region, and every other mapping of it, stays."""
import os

import torch
from vllm_hybrid.cpupod import hostmem

MIB = 1 << 20


def resident(region) -> int:
    """Bytes the region's file holds in memory (its shmem pages)."""
    return os.fstat(region.fd).st_blocks * 512


def test_released_pages_go_back_and_the_rest_stays():
    region = hostmem.allocate("hybrid-test-release", 8 * MIB, "shmem")
    try:
        flat = torch.frombuffer(region.map, dtype=torch.uint8)
        flat.fill_(7)  # written, as the main stage's loader writes a layer's experts
        other = torch.frombuffer(hostmem.open_fd(region.fd)[0], dtype=torch.uint8)  # another process's mapping
        before = resident(region)
        assert before >= 8 * MIB
        # a view that starts and ends inside pages: only the whole pages within it go
        freed = hostmem.release(flat[100:4 * MIB + 100])
        assert freed == 4 * MIB - 4096
        assert before - resident(region) == freed
        assert int(flat[4096:4 * MIB].max()) == 0 and int(other[4096:4 * MIB].max()) == 0  # read back as zeros
        assert int(flat[:4096].min()) == 7 and int(flat[4 * MIB:].min()) == 7  # the partial pages and the rest stay
        assert hostmem.release(flat[10:20]) == 0  # less than a page: nothing
    finally:
        region.close()

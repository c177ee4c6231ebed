"""One copy of a CPU stage's weights in host RAM, read by its CPU and streamed to a GPU (balanced);
the stage's loader writes the weights straight into it (gemm_split.place_weights).

The region is a memfd: no name in /dev/shm (nothing to leak when a pod dies) and it can be handed to
the GEMM helper in the GPU pod over their Unix socket (SCM_RIGHTS). It lives on 2 MiB pages when the
pod may use them (memfd on hugetlb: Kubernetes' `hugepages-2Mi` resource), else on shmem pages with
a transparent-huge-page hint; 4 KiB pages cost the CPU's reads (bench/page_size.py measures by how
much), so the page size is reported.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HUGE_PAGE = 2 << 20
PAGES_ENV = "HYBRID_WEIGHT_PAGES"  # huge (default: 2 MiB if the pod has them, else shmem), shmem


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass
class Region:
    fd: int
    map: mmap.mmap
    nbytes: int
    page_size: int  # bytes per page backing the region (2 MiB on hugetlb)
    kind: str       # hugetlb | shmem

    def describe(self) -> str:
        size = f"{self.nbytes / 1e9:.2f} GB" if self.nbytes >= 1e9 else f"{self.nbytes / 1e6:.1f} MB"
        return f"{size} on {self.page_size >> 10} KiB pages ({self.kind})"

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


HUGETLB_LIMITS = ("/sys/fs/cgroup/hugetlb.2MB.max", "/sys/fs/cgroup/hugetlb/hugetlb.2MB.limit_in_bytes")


def pod_huge_page_limit(paths: tuple[str, ...] | None = None) -> int | None:
    """Bytes of 2 MiB pages this container may use (Kubernetes' hugepages-2Mi limit); None if unbounded."""
    for path in paths or HUGETLB_LIMITS:
        try:
            value = open(path).read().strip()
        except OSError:
            continue
        return None if value == "max" or int(value) >= 1 << 62 else int(value)
    return None


def _hugetlb(name: str, nbytes: int) -> Region | None:
    try:
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_HUGE_2MB)
    except OSError:
        return None
    size = round_up(nbytes, HUGE_PAGE)
    try:
        os.ftruncate(fd, size)
        # a shared hugetlb mapping reserves its pages here: too few free (or over the pod's
        # hugepages-2Mi limit) fails now, not with SIGBUS at first touch
        m = mmap.mmap(fd, size)
    except OSError:
        os.close(fd)
        return None
    return Region(fd, m, size, HUGE_PAGE, "hugetlb")


def _shmem(name: str, nbytes: int) -> Region:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    size = max(round_up(nbytes, mmap.PAGESIZE), mmap.PAGESIZE)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)  # honoured where shmem_enabled allows huge pages (advise/always)
    except (AttributeError, OSError):
        pass
    return Region(fd, m, size, mmap.PAGESIZE, "shmem")


def allocate(name: str, nbytes: int, pages: str | None = None) -> Region:
    """A region of at least `nbytes`, on 2 MiB pages if it can have them (unless pages == 'shmem')."""
    pages = pages or os.environ.get(PAGES_ENV, "huge")
    if pages not in ("huge", "shmem"):
        raise ValueError(f"{PAGES_ENV}={pages!r}: use huge or shmem")
    region = _hugetlb(name, nbytes) if pages == "huge" else None
    if region is None and pages == "huge" and (limit := pod_huge_page_limit()):
        # the pod was given huge pages (and less memory for them): shmem now would overrun its memory limit
        raise RuntimeError(f"weights need {round_up(nbytes, HUGE_PAGE) >> 20} MiB of 2 MiB pages, but the "
                           f"pod's hugepages-2Mi limit is {limit >> 20} MiB or the node has too few free: "
                           "raise the stage's hugepages-2Mi, or drop it and give the stage the memory instead")
    region = region or _shmem(name, nbytes)
    # allocate every page now, from this process: the pod that asks for the region is charged for it
    # (not the GPU pod whose page-locking or loading would touch it first), and too little memory fails here
    os.posix_fallocate(region.fd, 0, region.nbytes)
    if region.kind == "shmem":
        region.page_size = backing_page_size(region)
    return region


def backing_page_size(region: Region) -> int:
    """Touch the first page and ask the kernel what backs it (THP may have made it 2 MiB)."""
    region.map[0:1] = region.map[0:1]
    addr = _address(region.map)
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            if "-" in line.split(" ", 1)[0] and not line[0].isupper():
                lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("ShmemPmdMapped:") and int(line.split()[1]) > 0:
                return HUGE_PAGE
    return mmap.PAGESIZE


def _address(m: mmap.mmap) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(m))


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def reserved_huge_pages(count: int):
    """Reserve `count` more 2 MiB pages on this host for the block, as a node does for Kubernetes'
    hugepages-2Mi, then give them back (root; bench and tests). Yields how many the kernel granted."""
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())
    with open(NR_HUGEPAGES, "w") as f:
        f.write(str(before + count))
    try:
        with open(NR_HUGEPAGES) as f:
            yield int(f.read()) - before
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


MADV_REMOVE = 9  # linux/mman.h: free the range's pages of a shared mapping (a hole punched in the file)


def release(t: torch.Tensor) -> int:
    """Give back the whole pages of a region that `t` (a view of it) covers: a server that made its own copy of them
    frees the region's memory for the pod. Page-aligned inward, 4 KiB or (hugetlb) 2 MiB. Returns the bytes freed
    (0 where the kernel refuses)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    for page in (mmap.PAGESIZE, HUGE_PAGE):
        lo, hi = round_up(start, page), end // page * page
        if hi <= lo:
            return 0
        if libc.madvise(lo, hi - lo, MADV_REMOVE) == 0:
            return hi - lo
    return 0


def open_fd(fd: int) -> tuple[mmap.mmap, int]:
    """Map a region another process allocated (its fd came over the socket); returns the map and its size."""
    size = os.fstat(fd).st_size
    return mmap.mmap(fd, size), size

"""The direct paths: one small interface (:class:`~sfstore.paths.base.StoragePath`), one backend per path.

Every path moves bytes through one seam, :meth:`StoragePath.submit` (a batch of :class:`Range` reads and
writes, answered by one :class:`PathFuture`):

* :class:`~sfstore.paths.file.FilePath` — a directory on a mount: NFS over RDMA on a cluster, any POSIX
  filesystem elsewhere (host memory);
* :class:`~sfstore.paths.block.BlockPath` — an NVMe-oF namespace, a block device or an image file (host memory);
* :class:`~sfstore.paths.device.DevicePath` — GPU memory (and host memory) to open files, GPU-direct with cuFile
  where the target allows, kvikio's compat mode or sfstore's pinned staging otherwise.
"""

from sfstore.paths.base import PathCounters, PathFuture, Range, StoragePath
from sfstore.paths.file import FilePath, MountFacts

__all__ = ["FilePath", "MountFacts", "PathCounters", "PathFuture", "Range", "StoragePath"]

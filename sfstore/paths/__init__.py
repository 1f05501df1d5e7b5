"""The direct paths: one small interface (:class:`~sfstore.paths.base.StoragePath`), one backend per path.

* :class:`~sfstore.paths.file.FilePath` — a directory on a mount: NFS over RDMA on a cluster, any POSIX
  filesystem elsewhere.
"""

from sfstore.paths.base import PathCounters, StoragePath
from sfstore.paths.file import FilePath, MountFacts

__all__ = ["FilePath", "MountFacts", "PathCounters", "StoragePath"]

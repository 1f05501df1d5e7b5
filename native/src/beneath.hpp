// Opening names beneath a directory descriptor without leaving it: openat2(RESOLVE_BENEATH |
// RESOLVE_NO_MAGICLINKS), one name or a batch of them (a KV tier's block files, one release of the GIL for all).
// Called without the GIL; nothing here raises.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

namespace sfstore {

// The descriptor of `path` opened beneath `dirfd` with `flags` (O_CLOEXEC added), or -errno: EXDEV for any
// resolution that would leave dirfd (symlinks and ".." included), ENOSYS on a kernel without openat2 (before 5.6).
int openat2_beneath(int dirfd, const char* path, int flags, unsigned mode) noexcept;

// What opening one name of a batch found: fd -1 when it was not kept (err: the open's or fstat's errno, or 0 with
// the status of what is there when it is not a regular file of the size asked for).
struct OpenedFile {
    int fd = -1;
    int err = 0;
    struct stat st {};
};

// Each name opened beneath `dirfd` with `flags` (O_NONBLOCK: a FIFO does not wait), fstat'ed, and kept only as a
// regular file of exactly `size` bytes, then made blocking (O_DIRECT where `direct` and the file takes it).
std::vector<OpenedFile> open_files_beneath(int dirfd, const std::vector<std::string>& names, int flags,
                                           int64_t size, bool direct) noexcept;

// Each name's st_mode beneath `dirfd` (opened with `flags`, O_PATH: nothing read, fstat'ed, closed), or -errno;
// with `leading` the list stops after the first name that is not a regular file.
std::vector<int64_t> stat_files_beneath(int dirfd, const std::vector<std::string>& names, int flags,
                                        bool leading) noexcept;

}  // namespace sfstore

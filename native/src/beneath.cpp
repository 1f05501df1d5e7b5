#include "beneath.hpp"

#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace sfstore {

int openat2_beneath(int dirfd, const char* path, int flags, unsigned mode) noexcept {
    struct {
        uint64_t flags, mode, resolve;
    } how{static_cast<uint64_t>(flags | O_CLOEXEC), flags & O_CREAT ? mode : 0, 0x08 | 0x02};
    int fd;
    do {
        fd = static_cast<int>(syscall(437 /* SYS_openat2 */, dirfd, path, &how, sizeof how));
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : fd;
}

std::vector<OpenedFile> open_files_beneath(int dirfd, const std::vector<std::string>& names, int flags,
                                           int64_t size, bool direct) noexcept {
    std::vector<OpenedFile> got(names.size());
    for (size_t i = 0; i < names.size(); ++i) {
        OpenedFile& g = got[i];
        int fd = openat2_beneath(dirfd, names[i].c_str(), flags, 0);
        if (fd < 0) {
            g.err = -fd;
            continue;
        }
        if (fstat(fd, &g.st) != 0) {
            g.err = errno;
            close(fd);
            continue;
        }
        if (!S_ISREG(g.st.st_mode) || g.st.st_size != size) {
            close(fd);
            continue;
        }
        int fl = direct ? O_DIRECT : 0;
        if (fcntl(fd, F_SETFL, fl) != 0 && (!direct || fcntl(fd, F_SETFL, 0) != 0)) {
            g.err = errno;
            close(fd);
            continue;
        }
        g.fd = fd;
    }
    return got;
}

std::vector<int64_t> stat_files_beneath(int dirfd, const std::vector<std::string>& names, int flags,
                                        bool leading) noexcept {
    std::vector<int64_t> modes;
    modes.reserve(names.size());
    for (const std::string& name : names) {
        int fd = openat2_beneath(dirfd, name.c_str(), flags, 0);
        struct stat st {};
        int64_t got;
        if (fd < 0) {
            got = fd;
        } else {
            got = fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_mode) : -static_cast<int64_t>(errno);
            close(fd);
        }
        modes.push_back(got);
        if (leading && (got < 0 || !S_ISREG(static_cast<mode_t>(got)))) break;
    }
    return modes;
}

}  // namespace sfstore

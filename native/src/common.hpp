// Shared definitions of sfstore._native. The core (pool, engine, backends) does not touch Python;
// module.cpp and pyerrors.cpp translate at the boundary.
#pragma once

#include <cerrno>
#include <cstring>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace sfstore {

// An error with a kind the Python side maps to a typed class (sfstore.errors.native_error):
// "os" (err is an errno), "invalid", "too_small", "read_only", "alignment", "in_use", "exhausted",
// "registration", "resources" (memory or threads ran out: err is ENOMEM or EAGAIN).
struct SfError : std::runtime_error {
    std::string kind;
    int err;
    std::string path;
    SfError(std::string kind_, int err_, const std::string& msg, std::string path_ = {})
        : std::runtime_error(msg), kind(std::move(kind_)), err(err_), path(std::move(path_)) {}
};

inline std::string errno_text(int e) {
    char buf[256];
    // GNU strerror_r returns a char* that may not be buf.
    const char* s = strerror_r(e, buf, sizeof buf);
    return std::string(s);
}

// Waits longer than this (seconds, about 30 years) are waits without end: adding more to a clock overflows it.
constexpr double kForever = 1e9;

inline bool is_aligned(uint64_t v, uint64_t a) { return a <= 1 || (v % a) == 0; }
inline uint64_t round_down(uint64_t v, uint64_t a) { return a <= 1 ? v : v - (v % a); }
inline uint64_t round_up(uint64_t v, uint64_t a) { return a <= 1 ? v : round_down(v + a - 1, a); }

}  // namespace sfstore

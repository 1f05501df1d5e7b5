// A pool of page-aligned, optionally huge-page backed, mlock'ed and CUDA-registered host buffers,
// reused LIFO (the most recently returned buffer is the warmest in cache and TLB).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace sfstore {

enum class Mode { Off = 0, Auto = 1, On = 2 };

// The largest buffer a pool hands out (the settings table, sfstore/defaults.py, allows at most 16 GiB).
constexpr size_t kMaxBufferSize = size_t(1) << 40;

struct Region {
    char* ptr = nullptr;
    size_t size = 0;      // usable bytes (the pool's buffer size)
    size_t mapped = 0;    // bytes mapped (size rounded to the page or huge page)
    bool hugetlb = false; // backed by reserved hugetlbfs pages
    bool thp = false;     // transparent huge pages advised
    bool locked = false;  // mlock succeeded
    bool cuda = false;    // cuMemHostRegister succeeded
};

struct PoolStats {
    size_t buffer_size, allocated, in_use, free, max_buffers, locked_bytes, mlock_failures, hugetlb_buffers,
        thp_buffers, cuda_registered;
    std::string mlock_error, hugetlb_error, cuda_error;
};

class BufferPool {
public:
    BufferPool(size_t buffer_size, size_t max_buffers, Mode huge, Mode lock, Mode cuda);
    ~BufferPool();
    BufferPool(const BufferPool&) = delete;
    BufferPool& operator=(const BufferPool&) = delete;

    // Takes a buffer (LIFO), allocating while under max_buffers (0 = unlimited); waits up to
    // timeout_s (< 0: forever) when the pool is at its limit. Throws SfError("exhausted").
    Region acquire(double timeout_s);
    void release(const Region& r);
    void close();  // frees the idle buffers; buffers still out are freed when they come back
    // Keeps at most `n` idle buffers from now on (SIZE_MAX: all, the default): frees the oldest idle ones
    // beyond it now, and a buffer that comes back to a pool already holding `n` idle ones is freed.
    // Returns the bytes freed now.
    size_t keep_idle(size_t n);
    PoolStats stats();
    size_t buffer_size() const { return buffer_size_; }

private:
    Region allocate();  // called with mu_ held
    void finish_allocation(Region& r);  // fault in, lock, register; throws with r still mapped
    void free_region(const Region& r);
    void drop_region(const Region& r);  // free_region and the counts; called with mu_ held

    size_t buffer_size_, max_buffers_, max_idle_ = SIZE_MAX;
    Mode huge_, lock_, cuda_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<Region> free_;
    size_t allocated_ = 0, in_use_ = 0, locked_bytes_ = 0, mlock_failures_ = 0, hugetlb_ = 0, thp_ = 0, cuda_n_ = 0;
    std::string mlock_error_, hugetlb_error_, cuda_error_;
    bool closed_ = false;
};

}  // namespace sfstore

#include "buffer_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <thread>
#include <vector>

#include "common.hpp"
#include "cuda_host.hpp"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace sfstore {

namespace {
constexpr size_t kHuge = size_t(2) << 20;
constexpr size_t kPopulateShare = size_t(64) << 20;  // bytes per populating thread, at least
size_t page_size() {
    static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return p;
}

void populate_range(char* p, size_t n) {
    if (madvise(p, n, MADV_POPULATE_WRITE) == 0) return;
    const size_t step = page_size();  // an older kernel: touch every page (fresh memory is zeros already)
    for (size_t off = 0; off < n; off += step) reinterpret_cast<volatile char*>(p)[off] = 0;
}

// Faults a large buffer in from several threads. Where the first touch of memory is slow (a VM whose host took
// freed memory back: free page reporting) a single thread, mlock's or the first reader's, pays all of it.
void populate(char* p, size_t n) {
    size_t threads = std::min<size_t>({std::max(1u, std::thread::hardware_concurrency()), 8, n / kPopulateShare});
    if (threads < 2) return;
    size_t part = round_up((n + threads - 1) / threads, kHuge);
    std::vector<std::thread> workers;
    try {
        workers.reserve(threads);
        for (size_t off = part; off < n; off += part) workers.emplace_back(populate_range, p + off, std::min(part, n - off));
    } catch (...) {  // no threads (or no memory for their list) to be had: this one does the rest below
    }
    populate_range(p, std::min(part, n));
    for (size_t off = part * (workers.size() + 1); off < n; off += part) populate_range(p + off, std::min(part, n - off));
    for (auto& w : workers) w.join();
}
}  // namespace

BufferPool::BufferPool(size_t buffer_size, size_t max_buffers, Mode huge, Mode lock, Mode cuda)
    : buffer_size_(buffer_size), max_buffers_(max_buffers), huge_(huge), lock_(lock), cuda_(cuda) {
    if (buffer_size == 0) throw SfError("invalid", EINVAL, "buffer_size must be positive");
    if (buffer_size > kMaxBufferSize)
        throw SfError("invalid", EINVAL, "buffer_size must be at most " + std::to_string(kMaxBufferSize) + " bytes, not " +
                                             std::to_string(buffer_size));
}

BufferPool::~BufferPool() {
    for (auto& r : free_) free_region(r);
}

Region BufferPool::allocate() {
    // Room to keep every buffer idle later: release() (on an engine thread too) then never allocates.
    free_.reserve(allocated_ + 1);
    Region r;
    r.size = buffer_size_;
    // Huge pages only for whole multiples of 2 MiB: a smaller buffer would waste the rest of the page.
    bool want_huge = huge_ != Mode::Off && buffer_size_ % kHuge == 0;
    if (want_huge) {
        void* p = mmap(nullptr, buffer_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
        if (p != MAP_FAILED) {
            r.ptr = static_cast<char*>(p);
            r.mapped = buffer_size_;
            r.hugetlb = true;
        } else {
            int e = errno;
            hugetlb_error_ = "mmap(MAP_HUGETLB): " + errno_text(e) + " (no hugetlbfs pages reserved: vm.nr_hugepages)";
            if (huge_ == Mode::On) throw SfError("os", e, "huge pages required (huge_pages=on) but " + hugetlb_error_);
        }
    }
    if (!r.ptr) {
        r.mapped = round_up(buffer_size_, page_size());
        void* p = mmap(nullptr, r.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            throw SfError(e == ENOMEM ? "resources" : "os", e,
                          "mmap of a " + std::to_string(r.mapped) + "-byte buffer failed");
        }
        r.ptr = static_cast<char*>(p);
        if (want_huge && madvise(p, r.mapped, MADV_HUGEPAGE) == 0) r.thp = true;
    }
    try {
        finish_allocation(r);
    } catch (...) {
        free_region(r);
        throw;
    }
    if (r.hugetlb) ++hugetlb_;
    if (r.thp) ++thp_;
    if (r.locked) locked_bytes_ += r.mapped;
    if (r.cuda) ++cuda_n_;
    ++allocated_;
    return r;
}

void BufferPool::finish_allocation(Region& r) {
    populate(r.ptr, r.mapped);
    if (lock_ != Mode::Off) {
        if (mlock(r.ptr, r.mapped) == 0) {
            r.locked = true;
        } else {
            int e = errno;
            ++mlock_failures_;
            mlock_error_ = "mlock: " + errno_text(e) + " (RLIMIT_MEMLOCK too small? see `ulimit -l`)";
            if (lock_ == Mode::On) throw SfError("os", e, "mlock required (mlock=on) but refused: " + mlock_error_);
        }
    }
    if (cuda_ != Mode::Off) {
        std::string why;
        if (cuda::host_register(r.ptr, r.mapped, &why)) {
            r.cuda = true;
        } else {
            cuda_error_ = why;
            if (cuda_ == Mode::On)
                throw SfError("registration", EIO, "CUDA registration required (cuda_register=on) but " + why);
        }
    }
}

void BufferPool::free_region(const Region& r) {
    if (r.cuda) cuda::host_unregister(r.ptr);
    munmap(r.ptr, r.mapped);  // also drops the mlock
}

Region BufferPool::acquire(double timeout_s) {
    if (std::isnan(timeout_s)) throw SfError("invalid", EINVAL, "timeout must be a number of seconds, not NaN");
    if (timeout_s > kForever) timeout_s = -1;  // beyond what a clock can add without overflowing: forever
    std::unique_lock<std::mutex> lk(mu_);
    if (closed_) throw SfError("invalid", EINVAL, "the buffer pool is closed");
    auto ready = [&] { return !free_.empty() || max_buffers_ == 0 || allocated_ < max_buffers_ || closed_; };
    if (!ready()) {
        if (timeout_s < 0) {
            cv_.wait(lk, ready);
        } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready)) {
            throw SfError("exhausted", 0,
                          "all " + std::to_string(max_buffers_) + " buffers of the pool are in use (waited " +
                              std::to_string(timeout_s) + " s)");
        }
        if (closed_) throw SfError("invalid", EINVAL, "the buffer pool was closed while waiting");
    }
    Region r;
    if (!free_.empty()) {
        r = free_.back();
        free_.pop_back();
    } else {
        r = allocate();
    }
    ++in_use_;
    return r;
}

void BufferPool::drop_region(const Region& r) {
    if (r.locked) locked_bytes_ -= r.mapped;
    --allocated_;
    free_region(r);
}

void BufferPool::release(const Region& r) {
    std::lock_guard<std::mutex> lk(mu_);
    --in_use_;
    if (closed_ || free_.size() >= max_idle_) {
        drop_region(r);
    } else {
        free_.push_back(r);
    }
    cv_.notify_one();
}

void BufferPool::close() {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
    for (auto& r : free_) drop_region(r);
    free_.clear();
    cv_.notify_all();
}

size_t BufferPool::keep_idle(size_t n) {
    std::lock_guard<std::mutex> lk(mu_);
    max_idle_ = n;
    size_t freed = 0;
    if (free_.size() > n) {
        // free_ is LIFO: the oldest idle buffers are at the front
        size_t extra = free_.size() - n;
        for (size_t i = 0; i < extra; ++i) {
            freed += free_[i].mapped;
            drop_region(free_[i]);
        }
        free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(extra));
    }
    cv_.notify_all();
    return freed;
}

PoolStats BufferPool::stats() {
    std::lock_guard<std::mutex> lk(mu_);
    return PoolStats{buffer_size_, allocated_, in_use_, free_.size(), max_buffers_, locked_bytes_, mlock_failures_,
                     hugetlb_, thp_, cuda_n_, mlock_error_, hugetlb_error_, cuda_error_};
}

}  // namespace sfstore

// The batched I/O engine: plans each request into operations (direct, or through bounce buffers where an
// O_DIRECT request is misaligned), hands them to a backend (io_uring or a thread pool), and collects
// per-request results. Nothing here holds or needs the GIL.
#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "buffer_pool.hpp"

namespace sfstore {

class Engine;

// The largest values Engine::create accepts (the settings table, sfstore/defaults.py, has the same bounds): the
// ring of depth + 2 entries stays within io_uring's 32768; more threads or a longer spin is a mistake, not a
// tuning.
constexpr unsigned kMaxQueueDepth = 16384;
constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxSpinUs = 100000;
constexpr size_t kMaxBounce = size_t(1) << 30;

// One request as the caller gave it, already validated.
struct RequestSpec {
    bool write;
    int fd;
    uint64_t offset;
    uint64_t length;
    char* mem;  // caller memory for byte 0 of the request
    bool verify = false;  // a read whose bytes must have xxh3-64 `sum`; a mismatch ends it with EBADMSG
    uint64_t sum = 0;
    bool deferred = false;  // its check is queued for whichever thread is free (see Engine::run_verify_job)
};

enum class OpMode : uint8_t {
    Plain,        // I/O on caller memory through a buffered descriptor (no alignment rules)
    Direct,       // O_DIRECT I/O on caller memory
    BounceRead,   // O_DIRECT read of an aligned cover into a bounce buffer, then copy the wanted part out
    BounceWrite,  // copy caller bytes into a bounce buffer, then O_DIRECT write
    Reopened,     // misaligned write head/tail through a buffered descriptor of the same file
};

struct Batch;

struct Op {
    Batch* batch;
    uint32_t req;
    OpMode mode;
    bool write;
    int fd;
    uint64_t off;   // file offset of the I/O
    uint64_t len;   // bytes of the I/O
    char* mem;      // caller memory for file offset `uoff`
    uint64_t uoff;  // file range the caller wants from this op: [uoff, uoff + ulen)
    uint64_t ulen;
    uint64_t done = 0;        // bytes already moved (short buffered I/O is resubmitted)
    int64_t again_since = 0;  // steady-clock ns of the first EAGAIN in a row (uring: O_NONBLOCK descriptors)
    Region bounce{};          // bounce buffer while the op is in flight
    bool prepared = false;

    char* io_ptr() const { return (bounce.ptr ? bounce.ptr : mem + (off - uoff)) + done; }
    uint64_t io_off() const { return off + done; }
    uint64_t io_len() const { return len - done; }
};

struct Batch {
    std::shared_ptr<Engine> engine;  // keeps the backend alive until every op finished
    std::vector<RequestSpec> reqs;
    std::vector<Op> ops;
    std::unique_ptr<std::atomic<int64_t>[]> bytes;
    std::unique_ptr<std::atomic<int>[]> errs;
    std::atomic<size_t> remaining{0};
    std::unique_ptr<std::atomic<uint32_t>[]> ops_left;  // per request, only when some request is verified
    std::atomic<uint64_t> moved_direct{0}, moved_bounced{0};
    std::vector<int> reopened_fds;
    std::atomic<bool> done{false};  // set once, under the engine's wait_mu (read it under that lock too)

    std::vector<int64_t> results() const;  // bytes (>= 0) or -errno per request
    bool wait(double timeout_s);           // < 0: forever; meanwhile the waiter helps check read checksums
    void finish_one() noexcept;            // one op or one deferred check is done
};

struct EngineStats {
    std::atomic<uint64_t> batches{0}, requests{0}, bytes_read{0}, bytes_written{0}, bytes_direct{0},
        bytes_bounced{0}, errors{0}, bytes_verified{0}, verify_failed{0};
};

// The backend runs ops; it calls Engine::complete for each result. Its threads never let an exception out
// (an exception leaving a std::thread's function aborts the process): what fails on them ends the op it was
// for with an errno, or stops the backend, which then refuses batches (broken()).
class Backend {
public:
    virtual ~Backend() = default;
    // Takes every op or none: throws SfError("unavailable") once shut down or broken, std::bad_alloc when the
    // hand-over itself cannot get memory.
    virtual void submit(const std::vector<Op*>& ops) = 0;
    virtual void shutdown() = 0;
    virtual bool broken() const { return false; }
    virtual const char* name() const = 0;
    virtual unsigned depth() const = 0;
};

struct FdInfo {
    int flags;
    bool direct;
    uint32_t mem_align;
    uint32_t off_align;
    // Whether the descriptor has positions (lseek works). Requests on a pipe, FIFO, socket or eventfd end
    // with ESPIPE, as pread/pwrite end there, in every backend: io_uring would read such a stream instead,
    // and wait forever on an empty one.
    bool seekable = true;
};

class Engine : public std::enable_shared_from_this<Engine> {
public:
    // backend: "uring" or "threads". queue_depth: ops in flight (uring) or worker threads (threads).
    // Throws SfError: "invalid" for arguments out of range, "resources" (ENOMEM, EAGAIN) when memory or threads
    // ran out, "os" when the kernel refused the ring.
    static std::shared_ptr<Engine> create(const std::string& backend, unsigned queue_depth, unsigned threads,
                                          size_t bounce_size, unsigned spin_us);
    ~Engine();

    // Plans and starts a validated batch. `infos` holds the descriptor facts gathered at validation.
    std::shared_ptr<Batch> start(std::vector<RequestSpec> reqs, const std::unordered_map<int, FdInfo>& infos);
    // Called by backends: returns true when the op must be issued again for its remaining bytes.
    bool complete(Op* op, int64_t res) noexcept;
    // Called by backends before issuing an op: takes its bounce buffer and copies write data in. Returns 0, or
    // the errno to end the op with (ENOMEM: no bounce buffer could be had).
    int prepare(Op* op) noexcept;
    // Checksums of large reads are not computed on the backend's completion path but queued, so that the
    // threads waiting for batches (idle otherwise) share the hashing with the service thread, which hashes only
    // when it has no completion to handle. Backends with a single completion thread (uring) turn this on.
    void set_defer_verify(bool on) { defer_verify_ = on; }
    // Runs one queued check, if any; returns whether it ran one.
    bool run_verify_job() noexcept;
    bool verify_jobs_pending() const { return verify_queued_.load() > 0; }
    // Every waiter sleeps on one condition of the engine, woken when any batch ends or a check is queued, so
    // that all of them can help with any batch's checks.
    std::mutex& wait_mu() { return wait_mu_; }
    std::condition_variable& wait_cv() { return wait_cv_; }
    void notify_waiters() noexcept {
        { std::lock_guard<std::mutex> lk(wait_mu_); }
        wait_cv_.notify_all();
    }

    void close();
    const char* backend_name() const { return backend_->name(); }
    unsigned depth() const { return backend_->depth(); }
    EngineStats& stats() { return stats_; }
    size_t bounce_size() const { return bounce_size_; }
    // In a forked child: the engine's threads (and its batches' progress) stayed in the parent.
    bool forked() const { return getpid() != owner_pid_; }

private:
    // Bounce buffers: huge pages where their size allows (pinning a 4 KiB-page buffer for each O_DIRECT request
    // costs more than the copy on a virtual machine), mlocked where allowed.
    Engine(size_t bounce_size)
        : bounce_size_(bounce_size), bounce_pool_(bounce_size, 0, Mode::Auto, Mode::Auto, Mode::Off) {}
    void finish_op(Op* op) noexcept;
    // Checks a finished read's bytes against its checksum (on the backend's thread, off the caller's).
    void verify(Batch& b, uint32_t req) noexcept;

    size_t bounce_size_;
    BufferPool bounce_pool_;
    std::unique_ptr<Backend> backend_;
    EngineStats stats_;
    pid_t owner_pid_ = 0;
    std::atomic<bool> closed_{false};
    bool defer_verify_ = false;
    std::mutex verify_mu_;
    std::deque<std::pair<Batch*, uint32_t>> verify_queue_;
    std::atomic<size_t> verify_queued_{0};
    std::mutex wait_mu_;
    std::condition_variable wait_cv_;
};

// O_DIRECT alignment (memory, file offset/length) of an open descriptor: statx STATX_DIOALIGN where the
// kernel reports it, else the block device's logical block size, else 4096.
FdInfo describe_fd(int fd);  // throws SfError("os", EBADF) for a closed descriptor

// Whether io_uring can run here; `reason` says why or why not. Probes once per process, on a thread of its own.
bool uring_available(std::string* reason);

std::unique_ptr<Backend> make_thread_backend(Engine* engine, unsigned threads);
// spin_us: how long the service thread polls for completions before it sleeps. Throws SfError when unavailable.
std::unique_ptr<Backend> make_uring_backend(Engine* engine, unsigned depth, unsigned spin_us);

}  // namespace sfstore

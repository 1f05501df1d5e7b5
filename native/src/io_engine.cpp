#include "io_engine.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "checksum.hpp"
#include "common.hpp"

namespace sfstore {

namespace {

// The kernel's struct statx (uapi/linux/stat.h, 6.1+), declared here so the build does not depend on
// whether the C library's headers already know the dio fields.
struct KStatxTimestamp {
    int64_t tv_sec;
    uint32_t tv_nsec;
    int32_t reserved;
};
struct KStatx {
    uint32_t stx_mask, stx_blksize;
    uint64_t stx_attributes;
    uint32_t stx_nlink, stx_uid, stx_gid;
    uint16_t stx_mode, spare0;
    uint64_t stx_ino, stx_size, stx_blocks, stx_attributes_mask;
    KStatxTimestamp stx_atime, stx_btime, stx_ctime, stx_mtime;
    uint32_t stx_rdev_major, stx_rdev_minor, stx_dev_major, stx_dev_minor;
    uint64_t stx_mnt_id;
    uint32_t stx_dio_mem_align, stx_dio_offset_align;
    uint64_t spare3[12];
};
static_assert(sizeof(KStatx) == 256, "struct statx layout");
constexpr unsigned kStatxDioAlign = 0x2000;

// Largest single op: keeps one request from monopolising a queue slot and stays under the kernel's
// 0x7ffff000-byte cap per read/write call.
constexpr uint64_t kMaxOp = uint64_t(64) << 20;

// Reads at least this large have their checksum queued rather than computed on the completion path.
constexpr uint64_t kDeferVerifyMin = uint64_t(64) << 10;

}  // namespace

FdInfo describe_fd(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) {
        int e = errno;
        throw SfError("os", e, "file descriptor " + std::to_string(fd) + " is not open");
    }
    FdInfo info{flags, (flags & O_DIRECT) != 0, 4096, 4096};
    // What pread/pwrite answer: a zero-byte pread (it moves nothing) where the descriptor reads, else lseek.
    char none;
    bool refused = (flags & O_ACCMODE) != O_WRONLY ? pread(fd, &none, 0, 0) < 0 : lseek(fd, 0, SEEK_CUR) < 0;
    info.seekable = !(refused && errno == ESPIPE);
    KStatx sx;
    std::memset(&sx, 0, sizeof sx);
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, kStatxDioAlign, &sx) == 0 && (sx.stx_mask & kStatxDioAlign) &&
        sx.stx_dio_offset_align > 0) {
        info.mem_align = sx.stx_dio_mem_align ? sx.stx_dio_mem_align : sx.stx_dio_offset_align;
        info.off_align = sx.stx_dio_offset_align;
        return info;
    }
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISBLK(st.st_mode)) {
        int lbs = 0;
        if (ioctl(fd, BLKSSZGET, &lbs) == 0 && lbs > 0) {
            info.mem_align = static_cast<uint32_t>(lbs);
            info.off_align = static_cast<uint32_t>(lbs);
        }
    }
    return info;
}

std::vector<int64_t> Batch::results() const {
    std::vector<int64_t> out(reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) {
        int e = errs[i].load();
        out[i] = e ? -static_cast<int64_t>(e) : bytes[i].load();
    }
    return out;
}

bool Batch::wait(double timeout_s) {
    if (std::isnan(timeout_s)) timeout_s = 0;  // callers refuse NaN; here it only looks
    else if (timeout_s > kForever) timeout_s = -1;
    auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s < 0 ? 0 : timeout_s);
    std::unique_lock<std::mutex> lk(engine->wait_mu());
    for (;;) {
        if (done.load()) return true;
        if (timeout_s >= 0 && std::chrono::steady_clock::now() >= until) return false;  // no helping past it
        if (engine->verify_jobs_pending()) {
            lk.unlock();
            engine->run_verify_job();  // any batch's: the engine's checks go faster, ours among them
            lk.lock();
            continue;
        }
        // Whoever ends a batch or queues a check takes wait_mu before notifying: nothing is missed here.
        auto woken = [&] { return done.load() || engine->verify_jobs_pending(); };
        if (timeout_s < 0) {
            engine->wait_cv().wait(lk, woken);
        } else if (!engine->wait_cv().wait_until(lk, until, woken)) {
            return false;
        }
    }
}

void Batch::finish_one() noexcept {
    if (remaining.fetch_sub(1) == 1) {
        for (int fd : reopened_fds) ::close(fd);
        reopened_fds.clear();
        // done is set and announced under the engine's wait lock, which every reader of done takes: nobody sees
        // it (and frees the batch, perhaps the engine with it) before this is finished. No reference to the
        // engine is taken here: dropping the last one on the service thread would make it join itself.
        Engine& eng = *engine;
        std::lock_guard<std::mutex> lk(eng.wait_mu());
        done.store(true);
        eng.wait_cv().notify_all();
    }
}

std::shared_ptr<Engine> Engine::create(const std::string& backend, unsigned queue_depth, unsigned threads,
                                       size_t bounce_size, unsigned spin_us) {
    if (queue_depth < 1 || queue_depth > kMaxQueueDepth)
        throw SfError("invalid", EINVAL, "queue_depth must be 1 to " + std::to_string(kMaxQueueDepth) + ", not " +
                                             std::to_string(queue_depth));
    if (threads < 1 || threads > kMaxThreads)
        throw SfError("invalid", EINVAL,
                      "threads must be 1 to " + std::to_string(kMaxThreads) + ", not " + std::to_string(threads));
    if (spin_us > kMaxSpinUs)
        throw SfError("invalid", EINVAL,
                      "spin_us must be 0 to " + std::to_string(kMaxSpinUs) + ", not " + std::to_string(spin_us));
    if (bounce_size < 4096 || bounce_size > kMaxBounce)
        throw SfError("invalid", EINVAL, "bounce_buffer_size must be 4096 to " + std::to_string(kMaxBounce) +
                                             " bytes, not " + std::to_string(bounce_size));
    std::shared_ptr<Engine> e(new Engine(round_up(bounce_size, 4096)));
    e->owner_pid_ = getpid();
    if (backend == "uring") {
        e->backend_ = make_uring_backend(e.get(), queue_depth, spin_us);
    } else if (backend == "threads") {
        e->backend_ = make_thread_backend(e.get(), threads);
    } else {
        throw SfError("invalid", EINVAL, "unknown engine backend '" + backend + "' (expected uring or threads)");
    }
    return e;
}

Engine::~Engine() { close(); }

void Engine::close() {
    if (closed_.exchange(true)) return;
    // In a forked child the backend's threads do not exist: joining them would hang, so leak instead.
    if (backend_ && getpid() == owner_pid_) backend_->shutdown();
    else backend_.release();
}

namespace {

void add_op(Batch& b, uint32_t req, OpMode mode, bool write, int fd, uint64_t off, uint64_t len, char* mem,
            uint64_t uoff, uint64_t ulen) {
    Op op{};
    op.batch = &b;
    op.req = req;
    op.mode = mode;
    op.write = write;
    op.fd = fd;
    op.off = off;
    op.len = len;
    op.mem = mem;
    op.uoff = uoff;
    op.ulen = ulen;
    b.ops.push_back(op);
}

// Ops that act on caller memory for [off, off+len), cut into pieces of at most kMaxOp.
void add_span(Batch& b, uint32_t req, OpMode mode, bool write, int fd, uint64_t off, uint64_t len, char* mem) {
    for (uint64_t pos = 0; pos < len; pos += kMaxOp) {
        uint64_t n = std::min(kMaxOp, len - pos);
        add_op(b, req, mode, write, fd, off + pos, n, mem + pos, off + pos, n);
    }
}

// Bounce ops covering the aligned range [cover_s, cover_e) in pieces of `piece`; each moves the
// intersection with the caller's [uoff, uend) from or to caller memory `base` (for file offset uoff).
void add_bounced(Batch& b, uint32_t req, bool write, int fd, uint64_t cover_s, uint64_t cover_e, uint64_t uoff,
                 uint64_t uend, char* base, uint64_t piece) {
    for (uint64_t s = cover_s; s < cover_e; s += piece) {
        uint64_t e = std::min(cover_e, s + piece);
        uint64_t is = std::max(s, uoff), ie = std::min(e, uend);
        add_op(b, req, write ? OpMode::BounceWrite : OpMode::BounceRead, write, fd, s, e - s, base + (is - uoff), is,
               ie - is);
    }
}

}  // namespace

std::shared_ptr<Batch> Engine::start(std::vector<RequestSpec> reqs, const std::unordered_map<int, FdInfo>& infos) {
    if (closed_) throw SfError("unavailable", EIO, "the I/O engine is closed");
    if (backend_->broken()) throw SfError("unavailable", EIO, "the I/O engine stopped after an internal failure");
    auto b = std::make_shared<Batch>();
    b->engine = shared_from_this();
    b->reqs = std::move(reqs);
    size_t n = b->reqs.size();
    b->bytes.reset(new std::atomic<int64_t>[n]);
    b->errs.reset(new std::atomic<int>[n]);
    std::unordered_map<int, int> reopened;
    for (size_t i = 0; i < n; ++i) {
        b->bytes[i] = 0;
        b->errs[i] = 0;
        const RequestSpec& r = b->reqs[i];
        if (r.length == 0) continue;
        const FdInfo& fi = infos.at(r.fd);
        if (!fi.seekable) {
            b->errs[i] = ESPIPE;
            stats_.errors += 1;
            continue;
        }
        uint32_t idx = static_cast<uint32_t>(i);
        uint64_t end = r.offset + r.length;
        if (!fi.direct) {
            add_span(*b, idx, OpMode::Plain, r.write, r.fd, r.offset, r.length, r.mem);
            continue;
        }
        const uint64_t A = fi.off_align, M = fi.mem_align;
        auto mem_at = [&](uint64_t off) { return reinterpret_cast<uintptr_t>(r.mem + (off - r.offset)); };
        if (is_aligned(r.offset, A) && is_aligned(r.length, A) && is_aligned(mem_at(r.offset), M)) {
            add_span(*b, idx, OpMode::Direct, r.write, r.fd, r.offset, r.length, r.mem);
            continue;
        }
        // Validation rejected misaligned requests when bouncing is off, so bounce here.
        const uint64_t piece = round_down(bounce_size_, A) ? round_down(bounce_size_, A) : A;
        uint64_t mid_s = round_up(r.offset, A), mid_e = round_down(end, A);
        bool mid_direct = mid_s < mid_e && is_aligned(mem_at(mid_s), M);
        if (!r.write) {
            if (!mid_direct) {
                add_bounced(*b, idx, false, r.fd, round_down(r.offset, A), round_up(end, A), r.offset, end, r.mem, piece);
                continue;
            }
            if (r.offset < mid_s) add_bounced(*b, idx, false, r.fd, round_down(r.offset, A), mid_s, r.offset, mid_s, r.mem, piece);
            add_span(*b, idx, OpMode::Direct, false, r.fd, mid_s, mid_e - mid_s, r.mem + (mid_s - r.offset));
            if (mid_e < end) add_bounced(*b, idx, false, r.fd, mid_e, round_up(end, A), mid_e, end, r.mem + (mid_e - r.offset), piece);
            continue;
        }
        // Writes: partial blocks go through a buffered descriptor of the same file (no read-modify-write
        // races, and the file size comes out right at EOF); whole blocks go direct, bounced when the
        // caller's memory is misaligned.
        int bfd;
        if (auto it = reopened.find(r.fd); it != reopened.end()) {
            bfd = it->second;
        } else {
            std::string proc = "/proc/self/fd/" + std::to_string(r.fd);
            // Same access mode and synchronous-write flags, minus O_DIRECT.
            bfd = ::open(proc.c_str(), (fi.flags & (O_ACCMODE | O_SYNC | O_DSYNC)) | O_CLOEXEC);
            if (bfd < 0) {
                int e = errno;
                for (int fd : b->reopened_fds) ::close(fd);
                throw SfError("os", e, "cannot reopen fd " + std::to_string(r.fd) + " without O_DIRECT for a misaligned write");
            }
            reopened[r.fd] = bfd;
            b->reopened_fds.push_back(bfd);
        }
        if (mid_s >= mid_e) {
            add_span(*b, idx, OpMode::Reopened, true, bfd, r.offset, r.length, r.mem);
            continue;
        }
        if (r.offset < mid_s) add_span(*b, idx, OpMode::Reopened, true, bfd, r.offset, mid_s - r.offset, r.mem);
        char* mid_mem = r.mem + (mid_s - r.offset);
        if (mid_direct) add_span(*b, idx, OpMode::Direct, true, r.fd, mid_s, mid_e - mid_s, mid_mem);
        else add_bounced(*b, idx, true, r.fd, mid_s, mid_e, mid_s, mid_e, mid_mem, piece);
        if (mid_e < end) add_span(*b, idx, OpMode::Reopened, true, bfd, mid_e, end - mid_e, r.mem + (mid_e - r.offset));
    }
    bool any_verify = false;
    for (const auto& r : b->reqs) any_verify = any_verify || r.verify;
    if (any_verify) {
        b->ops_left.reset(new std::atomic<uint32_t>[n]);
        for (size_t i = 0; i < n; ++i) b->ops_left[i] = 0;
        for (const auto& op : b->ops) b->ops_left[op.req] += 1;
        for (size_t i = 0; i < n; ++i)
            if (b->reqs[i].verify && b->reqs[i].length == 0) verify(*b, static_cast<uint32_t>(i));
    }
    size_t deferred = 0;
    for (auto& r : b->reqs) {
        // Small reads are checked in line: queueing one costs more than hashing it. A request that failed
        // while planned has no op to queue its check.
        r.deferred = defer_verify_ && r.verify && r.length >= kDeferVerifyMin && b->errs[&r - &b->reqs[0]] == 0;
        deferred += r.deferred;
    }
    stats_.batches += 1;
    stats_.requests += n;
    b->remaining = b->ops.size() + deferred;
    if (b->ops.empty()) {
        for (int fd : b->reopened_fds) ::close(fd);
        b->reopened_fds.clear();
        b->done.store(true);
        return b;
    }
    std::vector<Op*> ptrs;
    ptrs.reserve(b->ops.size());
    for (auto& op : b->ops) ptrs.push_back(&op);
    try {
        backend_->submit(ptrs);  // every op or none: on a throw the batch never reached the backend
    } catch (...) {
        for (int fd : b->reopened_fds) ::close(fd);
        b->reopened_fds.clear();
        throw;
    }
    return b;
}

int Engine::prepare(Op* op) noexcept {
    if (op->prepared) return 0;
    if (op->mode != OpMode::BounceRead && op->mode != OpMode::BounceWrite) {
        op->prepared = true;
        return 0;
    }
    // On a backend's thread: a failure must end this op, never leave the thread.
    try {
        op->bounce = bounce_pool_.acquire(-1);
    } catch (const SfError& e) {
        return e.err ? e.err : ENOMEM;
    } catch (...) {
        return ENOMEM;
    }
    op->prepared = true;
    if (op->mode == OpMode::BounceWrite) std::memcpy(op->bounce.ptr, op->mem, op->len);
    return 0;
}

bool Engine::complete(Op* op, int64_t res) noexcept {
    Batch& b = *op->batch;
    if (res < 0) {
        int expected = 0;
        if (b.errs[op->req].compare_exchange_strong(expected, static_cast<int>(-res))) stats_.errors += 1;
        finish_op(op);
        return false;
    }
    uint64_t moved = 0;
    bool again = false;
    if (op->mode == OpMode::BounceRead) {
        // The aligned cover landed in the bounce buffer; hand over the part the caller asked for.
        uint64_t skip = op->uoff - op->off;
        uint64_t got = static_cast<uint64_t>(res) > skip ? static_cast<uint64_t>(res) - skip : 0;
        moved = std::min(got, op->ulen);
        if (moved) std::memcpy(op->mem, op->bounce.ptr + skip, moved);
    } else {
        op->done += static_cast<uint64_t>(res);
        moved = static_cast<uint64_t>(res);
        if (op->done < op->len) {
            if (op->write) {
                if (res == 0) {  // a write that moves nothing would loop forever
                    int expected = 0;
                    if (b.errs[op->req].compare_exchange_strong(expected, EIO)) stats_.errors += 1;
                } else {
                    again = true;
                }
            } else if (res > 0 && op->mode != OpMode::Direct) {
                again = true;  // a short buffered read before EOF: read the rest
            }
            // res == 0 on a read, or a short direct read: end of file.
        }
    }
    b.bytes[op->req] += static_cast<int64_t>(moved);
    (op->write ? stats_.bytes_written : stats_.bytes_read) += moved;
    if (op->mode == OpMode::Direct) {
        stats_.bytes_direct += moved;
        b.moved_direct += moved;
    } else if (op->mode != OpMode::Plain) {
        stats_.bytes_bounced += moved;
        b.moved_bounced += moved;
    }
    if (again) return true;
    finish_op(op);
    return false;
}

void Engine::finish_op(Op* op) noexcept {
    if (op->bounce.ptr) {
        bounce_pool_.release(op->bounce);
        op->bounce = Region{};
    }
    Batch& b = *op->batch;
    if (b.ops_left && b.ops_left[op->req].fetch_sub(1) == 1) {
        bool queued = false;
        if (b.reqs[op->req].deferred) {
            try {
                std::lock_guard<std::mutex> lk(verify_mu_);
                verify_queue_.emplace_back(&b, op->req);  // the batch stays alive: it is not done until checked
                verify_queued_ += 1;
                queued = true;
            } catch (...) {  // no memory for the queue: check it here and now instead
            }
            if (queued) notify_waiters();
        }
        if (!queued) {
            verify(b, op->req);
            if (b.reqs[op->req].deferred) b.finish_one();  // the check it was counted for is done
        }
    }
    b.finish_one();
}

bool Engine::run_verify_job() noexcept {
    std::pair<Batch*, uint32_t> job;
    {
        std::lock_guard<std::mutex> lk(verify_mu_);
        if (verify_queue_.empty()) return false;
        job = verify_queue_.front();
        verify_queue_.pop_front();
        verify_queued_ -= 1;
    }
    verify(*job.first, job.second);
    job.first->finish_one();
    return true;
}

void Engine::verify(Batch& b, uint32_t req) noexcept {
    const RequestSpec& r = b.reqs[req];
    if (!r.verify || b.errs[req].load() != 0) return;
    uint64_t n = static_cast<uint64_t>(b.bytes[req].load());
    stats_.bytes_verified += n;
    if (n != r.length || xxh3_64(r.mem, n) != r.sum) {
        int expected = 0;
        if (b.errs[req].compare_exchange_strong(expected, EBADMSG)) {
            stats_.verify_failed += 1;
            stats_.errors += 1;
        }
    }
}

}  // namespace sfstore

// io_uring backend. One service thread owns the ring: it alone creates it, fills the submission queue, submits,
// reaps and tears it down, so the ring needs no lock and each loop turn is a single io_uring_enter (submit +
// wait). Callers hand ops over through a locked inbox and wake the service thread: through a condition variable
// when it is idle, through an eventfd it keeps a poll request on when it is waiting in the kernel.
//
// No caller's thread ever makes an io_uring system call (setup, enter, register, or the close of a ring): a
// thread that has is on the ring's task list, and the kernel's deferred teardown of the ring queues work to
// each such thread with TWA_SIGNAL, which interrupts that thread's next blocking system call once (a large
// write to a slow pipe then comes back short). The availability probe runs on a short-lived thread of its own
// for the same reason.
#include "common.hpp"
#include "io_engine.hpp"

#ifdef SFSTORE_HAVE_LIBURING
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace sfstore {
namespace {

// user_data of the eventfd poll; ops use their address, which is never this value.
constexpr uint64_t kWakeTag = 1;
constexpr int64_t kAgainLimitNs = int64_t(10) * 1000 * 1000 * 1000;

class UringBackend final : public Backend {
public:
    UringBackend(Engine* engine, unsigned depth, unsigned spin_us)
        : engine_(engine), depth_(depth), spin_ns_(int64_t(spin_us) * 1000) {
        // One thread reaps every completion: checksums of large reads go to a queue it shares with the waiters.
        engine_->set_defer_verify(true);
        // Room for every op that can come back for another round (at most depth_ are in flight), taken now so
        // that the service thread never allocates to keep an op.
        retry_.reserve(depth_);
        efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (efd_ < 0) {
            int e = errno;
            throw SfError(e == ENOMEM || e == EMFILE || e == ENFILE ? "resources" : "os", e,
                          "eventfd for the io_uring service thread");
        }
        try {
            thread_ = std::thread([this] { service(); });
        } catch (const std::system_error& e) {
            close(efd_);
            int err = e.code().value() ? e.code().value() : EAGAIN;
            throw SfError("resources", err, "cannot start the io_uring service thread");
        }
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return init_done_; });
        if (init_result_ < 0) {
            lk.unlock();
            thread_.join();
            close(efd_);
            int err = -init_result_;
            throw SfError(err == ENOMEM ? "resources" : "os", err,
                          "io_uring_queue_init(" + std::to_string(depth + 2) + ") failed");
        }
    }
    ~UringBackend() override { shutdown(); }

    void submit(const std::vector<Op*>& ops) override {
        bool in_kernel;
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (broken_ || stop_) throw SfError("unavailable", EIO, broken_why());
            inbox_.insert(inbox_.end(), ops.begin(), ops.end());  // all or nothing (bad_alloc to the caller)
            in_kernel = in_kernel_;
        }
        if (in_kernel) {
            uint64_t one = 1;
            ssize_t ignored = write(efd_, &one, sizeof one);
            (void)ignored;  // EAGAIN means a wake-up is already pending
        } else {
            cv_.notify_one();
        }
    }

    void shutdown() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
            stop_ = true;
        }
        cv_.notify_one();
        uint64_t one = 1;
        ssize_t ignored = write(efd_, &one, sizeof one);
        (void)ignored;
        thread_.join();  // the service thread tears the ring down before it ends
        close(efd_);
    }

    bool broken() const override {
        std::lock_guard<std::mutex> lk(mu_);
        return broken_;
    }
    const char* name() const override { return "uring"; }
    unsigned depth() const override { return depth_; }

private:
    std::string broken_why() const {
        return broken_ ? "the io_uring engine stopped after an internal failure (" + broken_reason_ +
                             "); close it and get another with get_engine()"
                       : "the io_uring engine is closed";
    }

    // The service thread's whole life: make the ring, run it, tear it down. Nothing may escape a thread.
    void service() noexcept {
        int r = init_ring();
        {
            std::lock_guard<std::mutex> lk(mu_);
            init_result_ = r;
            init_done_ = true;
        }
        cv_.notify_all();
        if (r < 0) return;
        try {
            run();
        } catch (const std::exception& e) {
            fail_and_drain(e.what());
        } catch (...) {
            fail_and_drain("unknown exception");
        }
        io_uring_queue_exit(&ring_);
    }

    int init_ring() noexcept {
        // Two spare entries: the wake-up poll and its re-arm never compete with I/O for a slot.
        unsigned entries = depth_ + 2;
        // The service thread is the only submitter and reaper, so the kernel may skip the locking and the
        // interrupting wake-ups a shared ring needs (SINGLE_ISSUER 6.0+, COOP_TASKRUN 5.19+). DEFER_TASKRUN was
        // measured slower for O_DIRECT reads here (completions then wait for the next io_uring_enter).
        // Older kernels reject the flags and get the plain ring.
        io_uring_params p{};
        p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_COOP_TASKRUN;
        int r = io_uring_queue_init_params(entries, &ring_, &p);
        if (r < 0) {
            io_uring_params plain{};
            r = io_uring_queue_init_params(entries, &ring_, &plain);
        }
        return r;
    }

    void arm_wake() {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        if (!sqe) return;  // the queue is full of I/O: armed on a later turn (the spares keep this rare)
        io_uring_prep_poll_add(sqe, efd_, POLLIN);
        io_uring_sqe_set_data64(sqe, kWakeTag);
        wake_armed_ = true;
    }

    // The next op to issue: one coming back for more first, then the inbox in order. Takes the inbox over by
    // swapping vectors, so that this thread never allocates.
    Op* next_op() {
        if (!retry_.empty()) {
            Op* op = retry_.back();
            retry_.pop_back();
            return op;
        }
        if (pending_pos_ == pending_.size()) {
            pending_.clear();
            pending_pos_ = 0;
            std::lock_guard<std::mutex> lk(mu_);
            pending_.swap(inbox_);
        }
        return pending_pos_ < pending_.size() ? pending_[pending_pos_++] : nullptr;
    }

    bool has_work() {
        if (!retry_.empty() || pending_pos_ < pending_.size()) return true;
        std::lock_guard<std::mutex> lk(mu_);
        return !inbox_.empty();
    }

    // Moves ops onto the submission queue, up to the queue depth.
    void fill() {
        while (inflight_ < depth_ && io_uring_sq_space_left(&ring_) > 0) {
            Op* op = next_op();
            if (!op) break;
            // A bounce buffer that cannot be had (memory ran out) ends this op with ENOMEM; the engine goes on.
            int err = engine_->prepare(op);
            if (err) {
                engine_->complete(op, -static_cast<int64_t>(err));
                continue;
            }
            io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
            if (op->write) {
                io_uring_prep_write(sqe, op->fd, op->io_ptr(), static_cast<unsigned>(op->io_len()), op->io_off());
            } else {
                io_uring_prep_read(sqe, op->fd, op->io_ptr(), static_cast<unsigned>(op->io_len()), op->io_off());
            }
            io_uring_sqe_set_data(sqe, op);
            ++inflight_;
            // One io_uring_enter per request, as fio does: submitted together, requests are plugged and reach
            // the device in bursts; one by one they keep its queue steadily full (4 KiB random reads at QD32:
            // 0.75x -> 1.0x fio here; 1 MiB requests measured no worse). The call costs little next to the I/O.
            io_uring_submit(&ring_);
        }
    }

    void run() {
        for (;;) {
            if (inflight_ == 0 && !has_work()) {
                while (engine_->run_verify_job()) {
                }
                // Idle: sleep in user space until work or shutdown arrives.
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stop_ || !inbox_.empty(); });
                if (stop_ && inbox_.empty()) return;
            }
            fill();
            if (!wake_armed_) arm_wake();
            // Submit and collect what has completed without sleeping; then poll briefly before sleeping. A
            // thread that sleeps per completion pays a wake-up each time (costly in a VM, where an idle vCPU
            // halts), and completions pile up meanwhile while the device's queue runs low.
            int r = io_uring_submit_and_get_events(&ring_);
            if (io_uring_cq_ready(&ring_) == 0 && spin_ns_ > 0) {
                auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns_);
                do {
                    r = io_uring_get_events(&ring_);
                } while (io_uring_cq_ready(&ring_) == 0 && std::chrono::steady_clock::now() < until);
            }
            // Nothing completed yet: check queued read checksums until something does (each check is tens of
            // microseconds; the ring is looked at between them).
            while (io_uring_cq_ready(&ring_) == 0 && engine_->run_verify_job()) r = io_uring_get_events(&ring_);
            if (io_uring_cq_ready(&ring_) == 0) {
                {
                    std::lock_guard<std::mutex> lk(mu_);
                    // Arrived meanwhile, and there is room to issue it: no wake-up would come for it. With the
                    // ring full, new work waits for a completion like the rest (looping here would spin a core
                    // on io_uring_enter for as long as the device takes).
                    if (!inbox_.empty() && inflight_ < depth_) continue;
                    in_kernel_ = true;  // from here on callers wake us through the eventfd (armed above)
                }
                r = io_uring_submit_and_wait(&ring_, 1);
                std::lock_guard<std::mutex> lk(mu_);
                in_kernel_ = false;
            }
            if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
                // The ring itself failed: fail what is queued rather than hang the callers.
                fail_queued(-r);
                continue;
            }
            reap();
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_ && inflight_ == 0 && retry_.empty() && pending_pos_ == pending_.size() && inbox_.empty()) {
                while (engine_->run_verify_job()) {
                }
                return;
            }
        }
    }

    void reap() {
        unsigned head, reaped = 0;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(&ring_, head, cqe) {
            ++reaped;
            if (io_uring_cqe_get_data64(cqe) == kWakeTag) {
                uint64_t v;
                ssize_t ignored = read(efd_, &v, sizeof v);
                (void)ignored;
                wake_armed_ = false;
                continue;
            }
            Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
            --inflight_;
            int64_t res = cqe->res;
            if (res == -EINTR || (res == -EAGAIN && again_in_time(op))) {
                retry_.push_back(op);  // reserved: never allocates
                continue;
            }
            op->again_since = 0;
            if (engine_->complete(op, res)) retry_.push_back(op);
        }
        io_uring_cq_advance(&ring_, reaped);
    }

    // An O_NONBLOCK descriptor makes io_uring answer EAGAIN where a read or write would wait (pread would
    // wait): issue it again, for at most kAgainLimitNs in a row, then end it with EAGAIN.
    static bool again_in_time(Op* op) {
        int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now().time_since_epoch())
                          .count();
        if (op->again_since == 0) op->again_since = now;
        return now - op->again_since < kAgainLimitNs;
    }

    // Finishes every op not yet handed to the kernel with err.
    void fail_queued(int err) {
        for (;;) {
            Op* op = next_op();
            if (!op) return;
            engine_->complete(op, -static_cast<int64_t>(err));
        }
    }

    // After an unexpected failure of the loop: refuse new batches, fail what is queued, and wait for what the
    // kernel still holds (it may be writing into callers' buffers) before the ring goes.
    void fail_and_drain(const char* what) noexcept {
        try {
            std::lock_guard<std::mutex> lk(mu_);
            broken_ = true;
            broken_reason_ = what;
        } catch (...) {
        }
        fail_queued(EIO);
        while (inflight_ > 0) {
            io_uring_cqe* cqe = nullptr;
            int r = io_uring_wait_cqe(&ring_, &cqe);
            if (r == -EINTR) continue;
            if (r < 0) break;  // the ring is unusable: nothing more will complete
            uint64_t tag = io_uring_cqe_get_data64(cqe);
            int64_t res = cqe->res;
            io_uring_cqe_seen(&ring_, cqe);
            if (tag == kWakeTag) continue;
            --inflight_;
            Op* op = reinterpret_cast<Op*>(tag);
            if (engine_->complete(op, res)) engine_->complete(op, -EIO);  // no second round now
        }
        fail_queued(EIO);  // whatever came in meanwhile
    }

    Engine* engine_;
    unsigned depth_;
    int64_t spin_ns_;
    io_uring ring_{};
    int efd_ = -1;
    int init_result_ = 0;
    bool init_done_ = false;
    // Service-thread state (no lock: only that thread touches it).
    std::vector<Op*> pending_;
    size_t pending_pos_ = 0;
    std::vector<Op*> retry_;
    unsigned inflight_ = 0;
    bool wake_armed_ = false;
    // Shared with callers, under mu_.
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::vector<Op*> inbox_;
    bool in_kernel_ = false;
    bool stop_ = false;
    bool broken_ = false;
    std::string broken_reason_;
    std::thread thread_;
};

// The probe's outcome: 0 not known yet, 1 available, else -errno of io_uring_setup. Kept in an atomic (no lock
// a fork could leave held); a probe that could not run at all is not kept.
std::atomic<int> probe_state{0};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Engine* engine, unsigned depth, unsigned spin_us) {
    return std::make_unique<UringBackend>(engine, depth, spin_us);
}

bool uring_available(std::string* reason) {
    int state = probe_state.load();
    if (state == 0) {
        int r = 0;
        try {
            // On a thread of its own, never the caller's (see the top of this file).
            std::thread probe([&r] {
                io_uring ring;
                r = io_uring_queue_init(2, &ring, 0);
                if (r == 0) io_uring_queue_exit(&ring);
            });
            probe.join();
        } catch (const std::system_error& e) {
            int err = e.code().value() ? e.code().value() : EAGAIN;
            if (reason) *reason = "cannot start a thread to probe io_uring: " + errno_text(err);
            return false;
        }
        state = r == 0 ? 1 : r;
        probe_state.store(state);
    }
    if (state == 1) {
        if (reason) *reason = "io_uring available";
        return true;
    }
    if (reason) {
        *reason = "io_uring_setup refused: " + errno_text(-state);
        if (-state == EPERM) *reason += " (kernel.io_uring_disabled, or a seccomp filter)";
    }
    return false;
}

}  // namespace sfstore

#else  // no liburing at build time

namespace sfstore {
std::unique_ptr<Backend> make_uring_backend(Engine*, unsigned, unsigned) {
    throw SfError("os", ENOSYS, "sfstore was built without liburing (apt-get install liburing-dev, then reinstall)");
}
bool uring_available(std::string* reason) {
    if (reason) *reason = "built without liburing (install liburing-dev and rebuild sfstore)";
    return false;
}
}  // namespace sfstore

#endif

// io_uring backend. One service thread owns the ring: it alone fills the submission queue, submits and reaps,
// so the ring needs no lock and each loop turn is a single io_uring_enter (submit + wait). Callers hand ops
// over through a locked inbox and wake the service thread: through a condition variable when it is idle,
// through an eventfd it keeps a poll request on when it is waiting in the kernel.
#include "common.hpp"
#include "io_engine.hpp"

#ifdef SFSTORE_HAVE_LIBURING
#include <liburing.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

namespace sfstore {
namespace {

// user_data of the eventfd poll; ops use their address, which is never this value.
constexpr uint64_t kWakeTag = 1;

class UringBackend final : public Backend {
public:
    UringBackend(Engine* engine, unsigned depth, unsigned spin_us)
        : engine_(engine), depth_(depth), spin_ns_(int64_t(spin_us) * 1000) {
        // One thread reaps every completion: checksums of large reads go to a queue it shares with the waiters.
        engine_->set_defer_verify(true);
        efd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (efd_ < 0) throw SfError("os", errno, "eventfd for the io_uring service thread");
        // The ring is made by the service thread: with SINGLE_ISSUER the kernel binds it to its creator.
        thread_ = std::thread([this] {
            int r = init_ring();
            {
                std::lock_guard<std::mutex> lk(mu_);
                init_result_ = r;
                init_done_ = true;
            }
            cv_.notify_all();
            if (r == 0) run();
        });
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return init_done_; });
        if (init_result_ < 0) {
            lk.unlock();
            thread_.join();
            close(efd_);
            throw SfError("os", -init_result_, "io_uring_queue_init(" + std::to_string(depth + 2) + ") failed");
        }
    }
    ~UringBackend() override { shutdown(); }

    void submit(const std::vector<Op*>& ops) override {
        bool in_kernel;
        {
            std::lock_guard<std::mutex> lk(mu_);
            inbox_.insert(inbox_.end(), ops.begin(), ops.end());
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
        thread_.join();
        io_uring_queue_exit(&ring_);
        close(efd_);
    }

    const char* name() const override { return "uring"; }
    unsigned depth() const override { return depth_; }

private:
    int init_ring() {
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
        io_uring_prep_poll_add(sqe, efd_, POLLIN);
        io_uring_sqe_set_data64(sqe, kWakeTag);
        wake_armed_ = true;
    }

    // Moves ops from the inbox (and the retry list) onto the submission queue, up to the queue depth.
    void fill() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            pending_.insert(pending_.end(), inbox_.begin(), inbox_.end());
            inbox_.clear();
        }
        while (inflight_ < depth_ && !pending_.empty()) {
            io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
            if (!sqe) break;
            Op* op = pending_.front();
            pending_.pop_front();
            engine_->prepare(op);
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
            if (inflight_ == 0 && pending_.empty()) {
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
                    if (!inbox_.empty()) continue;  // arrived meanwhile: no wake-up would come for it
                    in_kernel_ = true;  // from here on callers wake us through the eventfd (armed above)
                }
                r = io_uring_submit_and_wait(&ring_, 1);
                std::lock_guard<std::mutex> lk(mu_);
                in_kernel_ = false;
            }
            if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY && r != -ETIME) {
                // The ring itself failed: fail what is queued rather than hang the callers.
                fail_all(-r);
                continue;
            }
            unsigned head, reaped = 0;
            io_uring_cqe* cqe;
            std::vector<Op*> again;
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
                if (res == -EINTR || res == -EAGAIN || engine_->complete(op, res)) again.push_back(op);
            }
            io_uring_cq_advance(&ring_, reaped);
            pending_.insert(pending_.begin(), again.begin(), again.end());
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_ && inflight_ == 0 && pending_.empty() && inbox_.empty()) {
                while (engine_->run_verify_job()) {
                }
                return;
            }
        }
    }

    void fail_all(int err) {
        // Only reached if io_uring_enter itself fails (not an I/O error): finish every queued op with err.
        {
            std::lock_guard<std::mutex> lk(mu_);
            pending_.insert(pending_.end(), inbox_.begin(), inbox_.end());
            inbox_.clear();
        }
        while (!pending_.empty()) {
            Op* op = pending_.front();
            pending_.pop_front();
            engine_->complete(op, -static_cast<int64_t>(err));
        }
    }

    Engine* engine_;
    unsigned depth_;
    int64_t spin_ns_;
    io_uring ring_{};
    int efd_ = -1;
    int init_result_ = 0;
    bool init_done_ = false;
    // Service-thread state (no lock: only that thread touches it).
    std::deque<Op*> pending_;
    unsigned inflight_ = 0;
    bool wake_armed_ = false;
    // Shared with callers, under mu_.
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<Op*> inbox_;
    bool in_kernel_ = false;
    bool stop_ = false;
    std::thread thread_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Engine* engine, unsigned depth, unsigned spin_us) {
    return std::make_unique<UringBackend>(engine, depth, spin_us);
}

bool uring_available(std::string* reason) {
    io_uring ring;
    int r = io_uring_queue_init(2, &ring, 0);
    if (r < 0) {
        if (reason) {
            *reason = "io_uring_setup refused: " + errno_text(-r);
            if (-r == EPERM) *reason += " (kernel.io_uring_disabled, or a seccomp filter)";
        }
        return false;
    }
    io_uring_queue_exit(&ring);
    if (reason) *reason = "io_uring available";
    return true;
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

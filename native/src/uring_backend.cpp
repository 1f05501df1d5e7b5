// io_uring backend: callers put ops on the submission queue (under a lock) up to the queue depth; one
// service thread reaps completions, finishes ops and refills the queue from the pending list.
#include "common.hpp"
#include "io_engine.hpp"

#ifdef SFSTORE_HAVE_LIBURING
#include <liburing.h>

#include <deque>
#include <mutex>
#include <thread>

namespace sfstore {
namespace {

class UringBackend final : public Backend {
public:
    UringBackend(Engine* engine, unsigned depth) : engine_(engine), depth_(depth) {
        // One spare entry so shutdown can always post its wake-up even with the queue full.
        int r = io_uring_queue_init(depth + 1, &ring_, 0);
        if (r < 0) throw SfError("os", -r, "io_uring_queue_init(" + std::to_string(depth + 1) + ") failed");
        thread_ = std::thread([this] { run(); });
    }
    ~UringBackend() override { shutdown(); }

    void submit(const std::vector<Op*>& ops) override {
        std::lock_guard<std::mutex> lk(mu_);
        pending_.insert(pending_.end(), ops.begin(), ops.end());
        fill_locked();
    }

    void shutdown() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
            stop_ = true;
            io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
            if (sqe) {
                io_uring_prep_nop(sqe);
                io_uring_sqe_set_data(sqe, nullptr);
                io_uring_submit(&ring_);
            }
        }
        thread_.join();
        io_uring_queue_exit(&ring_);
    }

    const char* name() const override { return "uring"; }
    unsigned depth() const override { return depth_; }

private:
    void fill_locked() {
        unsigned queued = 0;
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
            ++queued;
        }
        if (!queued) return;
        int r;
        do {
            r = io_uring_submit(&ring_);
        } while (r == -EINTR || r == -EAGAIN);
        // A failed submit leaves the SQEs queued; the kernel takes them at the next io_uring_enter.
    }

    void run() {
        for (;;) {
            io_uring_cqe* cqe = nullptr;
            int r = io_uring_wait_cqe(&ring_, &cqe);
            if (r == -EINTR) continue;
            if (r < 0) {
                std::lock_guard<std::mutex> lk(mu_);
                if (stop_ && inflight_ == 0) return;
                continue;
            }
            std::vector<Op*> again;
            unsigned reaped = 0, completed = 0, head;
            io_uring_for_each_cqe(&ring_, head, cqe) {
                ++reaped;
                Op* op = static_cast<Op*>(io_uring_cqe_get_data(cqe));
                if (!op) continue;  // shutdown wake-up
                ++completed;
                int64_t res = cqe->res;
                if (res == -EINTR || res == -EAGAIN) again.push_back(op);
                else if (engine_->complete(op, res)) again.push_back(op);
            }
            io_uring_cq_advance(&ring_, reaped);
            std::lock_guard<std::mutex> lk(mu_);
            inflight_ -= completed;
            pending_.insert(pending_.begin(), again.begin(), again.end());
            fill_locked();
            if (stop_ && inflight_ == 0 && pending_.empty()) return;
        }
    }

    Engine* engine_;
    unsigned depth_;
    io_uring ring_{};
    std::mutex mu_;
    std::deque<Op*> pending_;
    unsigned inflight_ = 0;
    std::thread thread_;
    bool stop_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Engine* engine, unsigned depth) {
    return std::make_unique<UringBackend>(engine, depth);
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
std::unique_ptr<Backend> make_uring_backend(Engine*, unsigned) {
    throw SfError("os", ENOSYS, "sfstore was built without liburing (apt-get install liburing-dev, then reinstall)");
}
bool uring_available(std::string* reason) {
    if (reason) *reason = "built without liburing (install liburing-dev and rebuild sfstore)";
    return false;
}
}  // namespace sfstore

#endif

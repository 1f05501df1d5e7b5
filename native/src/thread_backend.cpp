// Thread-pool backend: each worker runs one op at a time with pread/pwrite.
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "io_engine.hpp"

namespace sfstore {
namespace {

class ThreadBackend final : public Backend {
public:
    ThreadBackend(Engine* engine, unsigned threads) : engine_(engine), n_(threads) {
        for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
    }
    ~ThreadBackend() override { shutdown(); }

    void submit(const std::vector<Op*>& ops) override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            queue_.insert(queue_.end(), ops.begin(), ops.end());
        }
        if (ops.size() == 1) cv_.notify_one();
        else cv_.notify_all();
    }

    void shutdown() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) return;
            stop_ = true;  // workers drain the queue before they leave
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }

    const char* name() const override { return "threads"; }
    unsigned depth() const override { return n_; }

private:
    void run() {
        for (;;) {
            Op* op;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
                if (queue_.empty()) return;
                op = queue_.front();
                queue_.pop_front();
            }
            engine_->prepare(op);
            for (;;) {
                ssize_t r = op->write ? pwrite(op->fd, op->io_ptr(), op->io_len(), static_cast<off_t>(op->io_off()))
                                      : pread(op->fd, op->io_ptr(), op->io_len(), static_cast<off_t>(op->io_off()));
                if (r < 0 && errno == EINTR) continue;
                if (!engine_->complete(op, r < 0 ? -static_cast<int64_t>(errno) : r)) break;
            }
        }
    }

    Engine* engine_;
    unsigned n_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Op*> queue_;
    std::vector<std::thread> workers_;
    bool stop_ = false;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(Engine* engine, unsigned threads) {
    return std::make_unique<ThreadBackend>(engine, threads);
}

}  // namespace sfstore

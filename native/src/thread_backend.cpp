// Thread-pool backend: each worker runs one op at a time with pread/pwrite.
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>

#include "common.hpp"
#include "io_engine.hpp"

namespace sfstore {
namespace {

class ThreadBackend final : public Backend {
public:
    ThreadBackend(Engine* engine, unsigned threads) : engine_(engine), n_(threads) {
        // Every worker or none: a pool that could start only some of them (threads or memory ran out) stops
        // those and says so, rather than run on with fewer than asked for or leave a thread joinable.
        try {
            workers_.reserve(threads);
            for (unsigned i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
        } catch (const std::system_error& e) {
            size_t started = workers_.size();
            shutdown();
            int err = e.code().value() ? e.code().value() : EAGAIN;
            throw SfError("resources", err,
                          "cannot start thread " + std::to_string(started + 1) + " of " + std::to_string(threads) +
                              " of the threads engine (thread or memory limits: ulimit -u / -v; fewer io_threads may fit)");
        } catch (const std::bad_alloc&) {
            shutdown();
            throw SfError("resources", ENOMEM, "out of memory starting the threads engine's workers");
        }
    }
    ~ThreadBackend() override { shutdown(); }

    void submit(const std::vector<Op*>& ops) override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_) throw SfError("unavailable", EIO, "the threads engine is closed");
            queue_.insert(queue_.end(), ops.begin(), ops.end());  // all or nothing (bad_alloc to the caller)
        }
        if (ops.size() == 1) cv_.notify_one();
        else cv_.notify_all();
    }

    void shutdown() override {
        {
            std::lock_guard<std::mutex> lk(mu_);
            if (stop_ && workers_.empty()) return;
            stop_ = true;  // workers drain the queue before they leave
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

    const char* name() const override { return "threads"; }
    unsigned depth() const override { return n_; }

private:
    // A worker's whole life; nothing here throws (engine calls are noexcept), so nothing escapes the thread.
    void run() noexcept {
        for (;;) {
            Op* op;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
                if (queue_.empty()) return;
                op = queue_.front();
                queue_.pop_front();
            }
            // A bounce buffer that cannot be had (memory ran out) ends this op with ENOMEM; the engine goes on.
            if (int err = engine_->prepare(op)) {
                engine_->complete(op, -static_cast<int64_t>(err));
                continue;
            }
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

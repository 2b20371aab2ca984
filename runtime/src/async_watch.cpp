// async_watch.cpp: see zp/runtime/async_watch.hpp.
#include "zp/runtime/async_watch.hpp"

#include <chrono>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "zp/error.hpp"

namespace zp::runtime {

AsyncWatch::AsyncWatch(int rank, std::string library, std::function<std::string()> probe,
                       std::function<void()> abort)
    : rank_(rank), library_(std::move(library)), probe_(std::move(probe)), abort_(std::move(abort)) {}

void AsyncWatch::check() {
  if (failure_.empty()) {
    ++polls_;
    std::string what = probe_();
    if (what.empty()) return;
    failure_ = std::move(what);
    if (abort_) std::exchange(abort_, nullptr)();
  }
  throw Error(fmt::format("rank {}: {} failed asynchronously: {}", rank_, library_, failure_),
              "a peer rank or the network failed while this rank waited for it: the first rank to "
              "report names the cause (NCCL_DEBUG=INFO shows what NCCL saw)");
}

void wait_until(const std::function<bool()>& ready, AsyncWatch* watch, int poll_interval_us) {
  using clock = std::chrono::steady_clock;
  const auto interval = std::chrono::microseconds(poll_interval_us);
  auto next = clock::now();  // the first not-ready answer asks the watch at once
  while (!ready()) {
    if (watch != nullptr && clock::now() >= next) {
      watch->check();
      next = clock::now() + interval;
    }
    std::this_thread::yield();
  }
}

}  // namespace zp::runtime

// The host waits of the CUDA device poll a watch on the communicator (async_watch.hpp): a fake
// communicator whose peer "dies" while this rank waits proves, without a GPU, that the wait ends
// in a zp::Error naming the rank and the library's words, after aborting the communicator
// exactly once, instead of blocking forever; a healthy one changes nothing.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "zp/error.hpp"
#include "zp/runtime/async_watch.hpp"

using namespace zp;
using namespace zp::runtime;

namespace {

// A communicator as NCCL's async-error query sees it: healthy until `fail_after` polls, then
// "remote process exited" for good; abort() counted.
struct FakeComm {
  int fail_after = -1;  // -1: never
  int probes = 0;
  int aborts = 0;
  std::string probe() {
    ++probes;
    return fail_after >= 0 && probes > fail_after
               ? "remote process exited or there was a network error (ncclRemoteError)"
               : "";
  }
};

}  // namespace

TEST_CASE("a wait behind a dead peer ends in an error naming the rank, after one abort") {
  FakeComm c;
  c.fail_after = 3;
  AsyncWatch watch(5, "NCCL", [&] { return c.probe(); }, [&] { ++c.aborts; });
  // The stream never completes: its kernel spins on the dead peer.
  std::string what;
  try {
    wait_until([] { return false; }, &watch, 0);
  } catch (const Error& e) {
    what = e.what();
  }
  CHECK(what.find("rank 5") != std::string::npos);
  CHECK(what.find("NCCL failed asynchronously") != std::string::npos);
  CHECK(what.find("ncclRemoteError") != std::string::npos);
  CHECK(c.aborts == 1);
  CHECK(c.probes == 4);
  CHECK(watch.failed());
  // Any later wait reports the same failure without aborting again or asking NCCL.
  CHECK_THROWS_AS(wait_until([] { return false; }, &watch, 0), Error);
  CHECK(c.aborts == 1);
  CHECK(c.probes == 4);
}

TEST_CASE("a healthy communicator: the wait returns when the work is done, nothing aborted") {
  FakeComm c;  // never fails
  AsyncWatch watch(0, "NCCL", [&] { return c.probe(); }, [&] { ++c.aborts; });
  std::atomic<bool> done{false};
  std::thread worker([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    done = true;
  });
  wait_until([&] { return done.load(); }, &watch, 100);
  worker.join();
  CHECK(c.aborts == 0);
  CHECK(c.probes >= 1);  // asked while the work was still running
  CHECK_FALSE(watch.failed());
  // Work already done: returns at once without asking.
  const int before = c.probes;
  wait_until([] { return true; }, &watch, 0);
  CHECK(c.probes == before);
}

TEST_CASE("without a watch the wait only polls the work") {
  int polls = 0;
  wait_until([&] { return ++polls == 5; }, nullptr);
  CHECK(polls == 5);
}

// The MPI communicator's sub-groups and all-to-all (what expert parallelism exchanges tokens
// and reduces expert gradients over), on however many ranks mpirun starts: CTest runs it on 1
// and on 4. Every expected value is computed here from the ranks' numbers, independently of
// the communicator: rank r's block for rank d holds (r, d, i) encoded as 1000 r + 100 d + i.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "engine_fixture.hpp"
#include "zp/error.hpp"
#include "zp/runtime/comm.hpp"

using namespace zp;
using zp::test::comm;

namespace {

// Rank r sends rank d (r + 2 d) % 3 elements: zero-length blocks included, and the counts
// differ by direction.
uint64_t count(int r, int d) {
  return static_cast<uint64_t>((r + 2 * d) % 3);
}
float value(int r, int d, uint64_t i) {
  return static_cast<float>(1000 * r + 100 * d) + static_cast<float>(i);
}

// One all-to-all over `c`, in its own rank numbering, checked.
void check_all_to_all(runtime::Comm& c) {
  const int n = c.size(), me = c.rank();
  std::vector<uint64_t> sc(static_cast<std::size_t>(n)), rc(static_cast<std::size_t>(n));
  std::vector<float> send;
  for (int d = 0; d < n; ++d) {
    sc[static_cast<std::size_t>(d)] = count(me, d);
    rc[static_cast<std::size_t>(d)] = count(d, me);
    for (uint64_t i = 0; i < count(me, d); ++i) send.push_back(value(me, d, i));
  }
  std::vector<float> want;
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < count(r, me); ++i) want.push_back(value(r, me, i));
  std::vector<float> recv(want.size() + 1, -1.0f);  // one more: nothing may land past the end
  c.all_to_all_v(send.data(), sc, recv.data(), rc, runtime::DType::fp32);
  CHECK(recv.back() == -1.0f);
  recv.pop_back();
  CHECK(recv == want);
}

}  // namespace

TEST_CASE("all_to_all_v delivers every rank's blocks in rank order, empty blocks included") {
  check_all_to_all(comm());
  // The counts themselves, as expert parallelism first exchanges them.
  const int n = comm().size(), me = comm().rank();
  std::vector<uint64_t> send(static_cast<std::size_t>(2 * n)), recv(send.size(), 0);
  for (int d = 0; d < n; ++d) {
    send[static_cast<std::size_t>(2 * d)] = count(me, d);
    send[static_cast<std::size_t>(2 * d + 1)] = static_cast<uint64_t>(me);
  }
  comm().all_to_all_u64(send.data(), recv.data(), 2);
  for (int r = 0; r < n; ++r) {
    CHECK(recv[static_cast<std::size_t>(2 * r)] == count(r, me));
    CHECK(recv[static_cast<std::size_t>(2 * r + 1)] == static_cast<uint64_t>(r));
  }
  // Counts for another number of ranks are refused before anything is sent.
  std::vector<uint64_t> wrong(static_cast<std::size_t>(n + 1), 0);
  float x = 0;
  CHECK_THROWS_AS(comm().all_to_all_v(&x, wrong, &x, wrong, runtime::DType::fp32), zp::Error);
}

TEST_CASE("split: the expert-parallel groups and the expert-data-parallel groups") {
  const int n = comm().size(), me = comm().rank();
  const int ep = n % 2 == 0 ? 2 : 1;  // 4 ranks: ep groups {0,1} {2,3}, edp groups {0,2} {1,3}
  auto ep_group = comm().split(me / ep, me);
  auto edp_group = comm().split(me % ep, me);
  CHECK(ep_group->size() == ep);
  CHECK(ep_group->rank() == me % ep);
  CHECK(edp_group->size() == n / ep);
  CHECK(edp_group->rank() == me / ep);
  // A sum in each group is the sum of its members' world ranks.
  double ep_sum = 0, edp_sum = 0;
  for (int r = 0; r < n; ++r) {
    if (r / ep == me / ep) ep_sum += r;
    if (r % ep == me % ep) edp_sum += r;
  }
  CHECK(ep_group->all_reduce_sum(static_cast<double>(me)) == ep_sum);
  CHECK(edp_group->all_reduce_sum(static_cast<double>(me)) == edp_sum);
  // Array reductions to a root of the group (the group's rank numbering), as the expert
  // gradients' buckets reduce to their owners.
  std::vector<float> g = {static_cast<float>(me), 1.0f};
  edp_group->reduce_sum(g.data(), 2, runtime::DType::fp32, 0);
  if (edp_group->rank() == 0) {
    CHECK(g[0] == static_cast<float>(edp_sum));
    CHECK(g[1] == static_cast<float>(n / ep));
  }
  // All-to-all inside a group: its own ranks, its own numbering.
  check_all_to_all(*ep_group);
  // Splitting needs a color >= 0.
  CHECK_THROWS_AS((void)comm().split(-1, me), zp::Error);
}

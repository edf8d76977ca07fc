// The nccl plugin, where a GPU is: one rank (NCCL allows one rank per GPU in a communicator),
// every collective on device buffers and on host buffers (staged), against the values they
// must produce. Skipped, saying so, where there is no CUDA device.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/comm/store.h"
#include "spmdx/core/registry.h"

namespace spmdx {
namespace {

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::unique_ptr<CommBackend> make_nccl() {
  static PluginRegistry registry;
  static bool discovered = false;
  // SPMDX_PLUGIN_PATH, then the folder beside libspmdx_core: a bundle made by
  // scripts/device_check runs on a GPU machine from another path.
  if (!discovered) registry.discover(plugin_search_path({})), discovered = true;
  return registry.make_comm_backend("nccl");
}

TEST(Nccl, OneRankEveryCollectiveOnDeviceAndHostBuffers) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device here: the nccl plugin's tests need a GPU";
  comm::TcpStoreServer server("127.0.0.1", 0, "t");
  comm::TcpStore store("127.0.0.1", server.port(), "t", 30);
  auto b = make_nccl();
  b->init({0, 1, 0, &store, 30});
  // Host buffer, staged: a sum over one rank is the identity.
  std::vector<float> host = {1, 2, 3, 4, 5, 6, 7};
  ASSERT_TRUE(b->all_reduce(0, {host.data(), host.size()}, ReduceOp::sum)->wait(30));
  EXPECT_EQ(host, (std::vector<float>{1, 2, 3, 4, 5, 6, 7}));
  // Device buffers.
  float* d = nullptr;
  float* e = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 7 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&e, 7 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d, host.data(), 7 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  CommBuffer in{d, 7, CommDType::f32, MemoryType::cuda}, out{e, 7, CommDType::f32, MemoryType::cuda};
  ASSERT_TRUE(b->all_reduce(0, in, ReduceOp::max)->wait(30));
  ASSERT_TRUE(b->all_gather(0, in, out, {7})->wait(30));
  ASSERT_TRUE(b->reduce_scatter(0, in, out, {7}, ReduceOp::sum)->wait(30));
  ASSERT_TRUE(b->all_to_all(0, in, out, {7}, {7})->wait(30));
  // all_to_all_v: the count learnt from the exchange, into a buffer of 7 with 2 to spare.
  std::size_t learnt = 0;
  std::vector<float> vin = {9, 8, 7, 6, 5}, vout(7, -1);
  ASSERT_TRUE(comm::all_to_all_v(*b, 0, {vin.data(), 5}, {vout.data(), 7}, {5}, &learnt)->wait(30));
  EXPECT_EQ(learnt, 5u);
  EXPECT_EQ(vout, (std::vector<float>{9, 8, 7, 6, 5, -1, -1}));
  ASSERT_TRUE(comm::all_to_all_v(*b, 0, in, {e, 7, CommDType::f32, MemoryType::cuda}, {7}, &learnt)->wait(30));
  EXPECT_EQ(learnt, 7u);
  std::vector<float> small(3);
  EXPECT_THAT([&] { comm::all_to_all_v(*b, 0, {vin.data(), 5}, {small.data(), 3}, {5}, &learnt); },
              ::testing::ThrowsMessage<std::invalid_argument>(::testing::HasSubstr("the members sent rank 0 5 elements (5, in member order) but out.count is 3")));
  std::vector<float> empty_in, empty_out(2, 4);
  ASSERT_TRUE(comm::all_to_all_v(*b, 0, {empty_in.data(), 0}, {empty_out.data(), 2}, {0}, &learnt)->wait(30));
  EXPECT_EQ(learnt, 0u);
  EXPECT_EQ(empty_out, (std::vector<float>{4, 4}));
  ASSERT_TRUE(b->broadcast(0, out, 0)->wait(30));
  ASSERT_TRUE(b->barrier(0)->wait(30));
  std::vector<float> back(7);
  ASSERT_EQ(cudaMemcpy(back.data(), e, 7 * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(back, host);
  const int g = b->new_group({0});
  ASSERT_TRUE(b->all_reduce(g, {host.data(), host.size()}, ReduceOp::avg)->wait(30));
  EXPECT_EQ(host[6], 7.0f);
  cudaFree(d);
  cudaFree(e);
  b->finalize();
}

// Without a device the plugin refuses to be made at all (so that spmdx run refuses it before
// any rank starts), saying why.
// CommBackend::abort (what fault tolerance calls when a replica group is lost, from its watcher
// thread): it returns at once, and every later call fails with a CommError saying so (the error
// a rank recovers from by joining a new backend), not with a crash or a missing group; finalize
// after it is safe.
TEST(Nccl, AbortFailsLaterWorkWithACommError) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device here: the nccl plugin's tests need a GPU";
  comm::TcpStoreServer server("127.0.0.1", 0, "t");
  comm::TcpStore store("127.0.0.1", server.port(), "t", 30);
  auto b = make_nccl();
  b->init({0, 1, 0, &store, 30});
  std::vector<float> host = {1, 2, 3};
  ASSERT_TRUE(b->all_reduce(0, {host.data(), host.size()}, ReduceOp::sum)->wait(30));
  b->abort();
  EXPECT_THAT([&] { b->all_reduce(0, {host.data(), host.size()}, ReduceOp::sum); },
              ::testing::ThrowsMessage<CommError>(::testing::HasSubstr("nccl: all_reduce on rank 0: the backend was aborted")));
  EXPECT_THAT([&] { b->barrier(0); }, ::testing::Throws<CommError>());
  EXPECT_THAT([&] { b->new_group({0}); }, ::testing::ThrowsMessage<CommError>(::testing::HasSubstr("the backend was aborted")));
  b->finalize();
}

TEST(Nccl, WithoutADeviceItRefusesToBeMadeSayingWhy) {
  if (have_gpu()) GTEST_SKIP() << "a GPU is present: this checks the message where there is none";
  try {
    make_nccl();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), ::testing::HasSubstr("nccl: no usable CUDA device on this machine"));
    EXPECT_THAT(e.what(), ::testing::HasSubstr("use ucx for host memory"));
  }
}

}  // namespace
}  // namespace spmdx

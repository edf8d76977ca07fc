// A mesh of CUDA and CPU ranks (issue 49, item 3), with fake devices: which device "auto" and
// training.devices give each rank, which memory the job's backend must move, and the staging
// of a CUDA rank's collectives through host memory (comm/staging.h) over real ranks (threads
// over the local backend), where a "CUDA" buffer is host memory labelled cuda and the fake
// staging copies host to host, counting every byte.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/comm/staging.h"
#include "spmdx/comm/store.h"
#include "spmdx/core/registry.h"
#include "spmdx/job/devices.h"

namespace spmdx {
namespace {

constexpr std::size_t kAny = static_cast<std::size_t>(-1);
using comm::StagingBackend;

TEST(MixedDevices, AutoGivesCudaToLocalRanksThatHaveAGpu) {
  // A host with 2 GPUs and 3 local ranks: ranks 0 and 1 on their GPUs, rank 2 on the CPU.
  EXPECT_EQ(job::resolve_device("auto", 0, 2), "cuda");
  EXPECT_EQ(job::resolve_device("auto", 1, 2), "cuda");
  EXPECT_EQ(job::resolve_device("auto", 2, 2), "cpu");
  EXPECT_EQ(job::resolve_device("auto", 0, 0), "cpu") << "no GPU here: the CPU";
  EXPECT_EQ(job::resolve_device("cuda", 5, 0), "cuda") << "a named device is taken as named (the launcher checks the GPUs)";
  EXPECT_EQ(job::resolve_device("cpu", 0, 8), "cpu");
  EXPECT_THROW(job::resolve_device("gpu", 0, 1), std::invalid_argument);

  const std::vector<std::string> mixed{"cuda", "cuda", "cpu"};
  EXPECT_TRUE(job::mixed_devices(mixed));
  EXPECT_FALSE(job::mixed_devices({"cuda", "cuda"}));
  EXPECT_EQ(job::rank_memory(mixed), (std::vector<MemoryType>{MemoryType::cuda, MemoryType::cuda, MemoryType::host}));
  EXPECT_EQ(job::job_comm_memory({"cuda", "cuda"}), (std::vector<MemoryType>{MemoryType::cuda, MemoryType::host}));
  EXPECT_EQ(job::job_comm_memory(mixed), std::vector<MemoryType>{MemoryType::host}) << "a mixed mesh moves host memory: nccl cannot join a CPU rank";
  EXPECT_EQ(job::job_comm_memory({"cpu"}), std::vector<MemoryType>{MemoryType::host});
  EXPECT_EQ(job::comm_device(mixed), "cpu");
  EXPECT_EQ(job::devices_text(mixed), "ranks 0-1 cuda, rank 2 cpu");
  EXPECT_EQ(job::devices_text({"cpu", "cuda", "cpu", "cpu"}), "rank 0 cpu, rank 1 cuda, ranks 2-3 cpu");
  EXPECT_EQ(job::devices_text({"cpu", "cpu"}), "cpu");
}

TEST(MixedDevices, RanksTellEachOtherTheirDevicesThroughTheStore) {
  comm::TcpStoreServer server("127.0.0.1", 0, "tok");
  constexpr int n = 3;
  const std::vector<std::string> mine{"cuda", "cpu", "cuda"};
  std::vector<std::vector<std::string>> seen(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      comm::TcpStore store("127.0.0.1", server.port(), "tok", 10);
      seen[static_cast<std::size_t>(r)] = job::exchange_devices(store, r, n, mine[static_cast<std::size_t>(r)], 10);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], mine) << "rank " << r;
}

TEST(MixedDevices, StagedWhenTheCudaPickIsMissingOrIsNotTheHostPick) {
  const std::vector<CommCapability> ucx_host{{"*", MemoryType::host, 0, kAny, 10}};
  const std::vector<CommCapability> ucx_cuda{{"*", MemoryType::host, 0, kAny, 10}, {"*", MemoryType::cuda, 0, kAny, 10}};
  const std::vector<CommCapability> nccl{{"*", MemoryType::cuda, 0, kAny, 100}, {"*", MemoryType::host, 0, kAny, 1}};
  // UCX without CUDA: every CUDA buffer is staged, in a mixed group or not.
  EXPECT_TRUE(comm::stages_through_host({ucx_host}, "all_reduce", 64, true));
  EXPECT_TRUE(comm::stages_through_host({ucx_host}, "all_reduce", 64, false));
  // UCX built with CUDA moves both memories: nothing is staged.
  EXPECT_FALSE(comm::stages_through_host({ucx_cuda}, "all_reduce", 64, true));
  // nccl beside ucx: an all-CUDA group goes to nccl; a group with a host rank stages, so that
  // every rank calls ucx, the host pick.
  EXPECT_FALSE(comm::stages_through_host({nccl, ucx_host}, "all_gather", 1 << 20, false));
  EXPECT_TRUE(comm::stages_through_host({nccl, ucx_host}, "all_gather", 1 << 20, true));
  // A CUDA-aware backend that wins CUDA buffers only above 1 MiB: small calls in a mixed
  // group stage (their CUDA pick is another backend than the host's), large ones do not.
  const std::vector<CommCapability> big_cuda{{"*", MemoryType::cuda, 1 << 20, kAny, 50}, {"*", MemoryType::host, 1 << 20, kAny, 50}};
  EXPECT_TRUE(comm::stages_through_host({nccl, big_cuda, ucx_host}, "all_reduce", 4096, true));
  EXPECT_FALSE(comm::stages_through_host({ucx_host, big_cuda}, "all_reduce", 4 << 20, true));
}

// Host copies, counted: the fake device's "CUDA" memory is host memory.
class FakeStaging final : public comm::HostStaging {
 public:
  void* allocate(std::size_t bytes) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    auto buf = std::make_unique<char[]>(bytes);
    void* p = buf.get();
    held_[p] = std::move(buf);
    ++allocations;
    return p;
  }
  void release(void* host) noexcept override {
    const std::lock_guard<std::mutex> lock(mutex_);
    held_.erase(host);
  }
  void to_host(void* host, const void* device, std::size_t bytes) override { std::memcpy(host, device, bytes), to_host_calls++; }
  void to_device(void* device, const void* host, std::size_t bytes) override { std::memcpy(device, host, bytes), to_device_calls++; }
  std::size_t outstanding() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return held_.size();
  }
  int allocations = 0, to_host_calls = 0, to_device_calls = 0;

 private:
  std::mutex mutex_;
  std::map<void*, std::unique_ptr<char[]>> held_;
};

// The local backend under the capabilities a test gives, recording the memory of every buffer
// it is handed (the local engine moves bytes whatever their label, as a CUDA-aware UCX would).
class Seen final : public CommBackend, public StreamOrdered, public VariableAllToAll {
 public:
  Seen(std::unique_ptr<CommBackend> inner, std::vector<CommCapability> caps) : inner_(std::move(inner)), caps_(std::move(caps)) {}
  void init(const CommInit& init) override { inner_->init(init); }
  void finalize() override { inner_->finalize(); }
  void abort() noexcept override { inner_->abort(); }
  std::string describe() const override { return "seen"; }
  std::vector<CommCapability> capabilities() const override { return caps_; }
  int new_group(const std::vector<int>& ranks) override { return inner_->new_group(ranks); }
  std::unique_ptr<Work> all_reduce(int g, CommBuffer b, ReduceOp op) override { return saw(b), inner_->all_reduce(g, b, op); }
  std::unique_ptr<Work> all_gather(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> c) override {
    return saw(in), saw(out), inner_->all_gather(g, in, out, std::move(c));
  }
  std::unique_ptr<Work> reduce_scatter(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> c, ReduceOp op) override {
    return saw(in), saw(out), inner_->reduce_scatter(g, in, out, std::move(c), op);
  }
  std::unique_ptr<Work> all_to_all(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> s, std::vector<std::size_t> r) override {
    return saw(in), saw(out), inner_->all_to_all(g, in, out, std::move(s), std::move(r));
  }
  std::unique_ptr<Work> all_to_all_v(int g, CommBuffer in, CommBuffer out, std::vector<std::size_t> s, std::size_t* r) override {
    return saw(in), saw(out), comm::all_to_all_v(*inner_, g, in, out, std::move(s), r);
  }
  std::unique_ptr<Work> broadcast(int g, CommBuffer b, int root) override { return saw(b), inner_->broadcast(g, b, root); }
  std::unique_ptr<Work> send(CommBuffer b, int peer, int tag) override { return saw(b), inner_->send(b, peer, tag); }
  std::unique_ptr<Work> recv(CommBuffer b, int peer, int tag) override { return saw(b), inner_->recv(b, peer, tag); }
  std::unique_ptr<Work> barrier(int g) override { return inner_->barrier(g); }
  void issue_after(void*) override {}
  bool stream_wait(Work&, void*) override { return false; }
  int host_buffers = 0, cuda_buffers = 0;

 private:
  void saw(const CommBuffer& b) { ++(b.memory == MemoryType::cuda ? cuda_buffers : host_buffers); }
  std::unique_ptr<CommBackend> inner_;
  std::vector<CommCapability> caps_;
};

constexpr int kRanks = 3;
const std::vector<MemoryType> kMemory{MemoryType::cuda, MemoryType::cuda, MemoryType::host};

// On three ranks (0 and 1 "CUDA", 2 host) over `make(rank)`: the collectives a step may issue,
// each checked for its values; ranks 0 and 1 call through a StagingBackend. Returns each
// rank's staging stats (rank 2's: zeros) and checks every staged host buffer was released.
std::vector<comm::StagingStats> run_mixed(const std::function<std::unique_ptr<CommBackend>(int)>& make) {
  std::vector<std::unique_ptr<CommBackend>> inner;
  for (int r = 0; r < kRanks; ++r) inner.push_back(make(r));
  std::vector<FakeStaging> staging(kRanks);
  std::vector<comm::StagingStats> stats(kRanks);
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        const auto i = static_cast<std::size_t>(r);
        const MemoryType mem = kMemory[i];
        std::unique_ptr<StagingBackend> staged;
        if (mem == MemoryType::cuda) staged = std::make_unique<StagingBackend>(*inner[i], kMemory, staging[i]);
        CommBackend& b = staged ? static_cast<CommBackend&>(*staged) : *inner[i];
        b.init({r, kRanks, 0, nullptr, 30});
        auto check = [&](bool ok, const std::string& what) {
          if (!ok && errors[i].empty()) errors[i] = what;
        };
        // all_reduce over every rank: 1 + 2 + 3.
        std::vector<float> x(16, static_cast<float>(r + 1));
        check(b.all_reduce(0, {x.data(), x.size(), CommDType::f32, mem}, ReduceOp::sum)->wait(30) && x[0] == 6 && x[15] == 6, "all_reduce");
        // all_gather, uneven: rank q gives q + 1 copies of 10 q.
        std::vector<double> mine(i + 1, 10.0 * r), all(6, -1);
        check(b.all_gather(0, {mine.data(), mine.size(), CommDType::f64, mem}, {all.data(), all.size(), CommDType::f64, mem}, {1, 2, 3})->wait(30) &&
                  all == std::vector<double>{0, 10, 10, 20, 20, 20},
              "all_gather");
        // reduce_scatter of 1..6 from each: rank q gets its slice times 3.
        std::vector<double> in{1, 2, 3, 4, 5, 6}, out(i + 1, -1);
        check(b.reduce_scatter(0, {in.data(), 6, CommDType::f64, mem}, {out.data(), out.size(), CommDType::f64, mem}, {1, 2, 3}, ReduceOp::sum)->wait(30),
              "reduce_scatter");
        const std::vector<std::vector<double>> slices{{3}, {6, 9}, {12, 15, 18}};
        check(out == slices[i], "reduce_scatter's slice");
        // broadcast from the host rank (member 2).
        std::vector<std::int64_t> y(4, r == 2 ? 42 : 0);
        check(b.broadcast(0, {y.data(), y.size(), CommDType::i64, mem}, 2)->wait(30) && y == std::vector<std::int64_t>(4, 42), "broadcast");
        // all_to_all_v: rank q sends rank j (q + 1) elements of value 100 q + j; out has room
        // for 9 and keeps its -1 past what arrives.
        std::vector<std::int64_t> send, got(9, -1);
        for (int j = 0; j < kRanks; ++j) send.insert(send.end(), i + 1, 100 * r + j);
        std::vector<std::size_t> counts(kRanks, i + 1), recv(kRanks, 0);
        check(comm::all_to_all_v(b, 0, {send.data(), send.size(), CommDType::i64, mem}, {got.data(), got.size(), CommDType::i64, mem}, counts, recv.data())
                  ->wait(30),
              "all_to_all_v");
        std::vector<std::int64_t> want;
        for (int q = 0; q < kRanks; ++q) want.insert(want.end(), static_cast<std::size_t>(q + 1), 100 * q + r);
        want.resize(9, -1);
        check(got == want && recv == std::vector<std::size_t>{1, 2, 3}, "all_to_all_v's blocks");
        // send and recv: the host rank 2 to CUDA rank 0, and CUDA rank 1 to the host rank 2.
        std::vector<float> p(8, r == 2 ? 7.0f : (r == 1 ? 9.0f : 0.0f)), q(8, 0);
        if (r == 2) {
          auto s = b.send({p.data(), p.size(), CommDType::f32, mem}, 0, 5);
          check(b.recv({q.data(), q.size(), CommDType::f32, mem}, 1, 6)->wait(30) && q[7] == 9.0f && s->wait(30), "recv from rank 1");
        } else if (r == 0) {
          check(b.recv({q.data(), q.size(), CommDType::f32, mem}, 2, 5)->wait(30) && q[7] == 7.0f, "recv from rank 2");
        } else {
          check(b.send({p.data(), p.size(), CommDType::f32, mem}, 2, 6)->wait(30), "send to rank 2");
        }
        // A group of the two CUDA ranks alone.
        if (r < 2) {
          const int pair = b.new_group({0, 1});
          std::vector<float> z(4, static_cast<float>(r + 1));
          check(b.all_reduce(pair, {z.data(), z.size(), CommDType::f32, mem}, ReduceOp::sum)->wait(30) && z[3] == 3, "the CUDA pair's all_reduce");
        } else {
          b.new_group({2});
        }
        check(b.barrier(0)->wait(30), "barrier");
        if (staged) stats[i] = staged->stats();
        b.finalize();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_EQ(staging[static_cast<std::size_t>(r)].outstanding(), 0u) << "rank " << r << ": a staged host buffer was never released";
  }
  return stats;
}

TEST(MixedDevices, HostOnlyBackendGetsEveryCudaBufferStagedAndTheNumbersAreRight) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<Seen*> seen;
  const auto stats = run_mixed([&](int) {
    auto s = std::make_unique<Seen>(registry.make_comm_backend("local", {{"job", "mixed_host"}}), std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 10}});
    seen.push_back(s.get());
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    const auto& s = stats[static_cast<std::size_t>(r)];
    EXPECT_EQ(s.direct_calls, 0) << "rank " << r;
    // all_reduce, all_gather, reduce_scatter, broadcast, all_to_all_v, one send or recv, the pair's all_reduce.
    EXPECT_EQ(s.staged_calls, 7) << "rank " << r;
    EXPECT_EQ(seen[static_cast<std::size_t>(r)]->cuda_buffers, 0) << "rank " << r << ": the host-only backend was handed CUDA memory";
  }
  // Bytes each way, rank 0: all_reduce 64 + 64; all_gather in 8, out 48 back; reduce_scatter
  // in 48, out 8 back; broadcast 32 + 32; all_to_all_v in 24, out 72 in and back; recv 32 back.
  EXPECT_EQ(stats[0].to_host_bytes, 64 + 8 + 48 + 32 + 24 + 72 + 16);
  EXPECT_EQ(stats[0].to_device_bytes, 64 + 48 + 8 + 32 + 72 + 32 + 16);
  // Rank 1 sends: 32 bytes in, none back.
  EXPECT_EQ(stats[1].to_host_bytes, 64 + 16 + 48 + 32 + 48 + 72 + 32 + 16);
  EXPECT_EQ(stats[1].to_device_bytes, 64 + 48 + 16 + 32 + 72 + 16);
  EXPECT_EQ(seen[2]->cuda_buffers, 0);
}

TEST(MixedDevices, CudaAwareBackendTakesCudaBuffersAsTheyAre) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<Seen*> seen;
  const auto stats = run_mixed([&](int) {
    auto s = std::make_unique<Seen>(registry.make_comm_backend("local", {{"job", "mixed_aware"}}),
                                    std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 10}, {"*", MemoryType::cuda, 0, kAny, 10}});
    seen.push_back(s.get());
    return s;
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(stats[static_cast<std::size_t>(r)].staged_calls, 0) << "rank " << r;
    EXPECT_EQ(stats[static_cast<std::size_t>(r)].direct_calls, 7) << "rank " << r;
    EXPECT_EQ(stats[static_cast<std::size_t>(r)].to_host_bytes, 0) << "rank " << r;
    EXPECT_GT(seen[static_cast<std::size_t>(r)]->cuda_buffers, 0) << "rank " << r;
    EXPECT_EQ(seen[static_cast<std::size_t>(r)]->host_buffers, 0) << "rank " << r;
  }
}

TEST(MixedDevices, BesideAnNcclLikeBackendOnlyTheGroupsWithAHostRankStage) {
  PluginRegistry registry;
  registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
  std::vector<Seen*> gpu, host;
  const auto stats = run_mixed([&](int) {
    auto nccl = std::make_unique<Seen>(registry.make_comm_backend("local", {{"job", "mixed_nccl"}}),
                                       std::vector<CommCapability>{{"*", MemoryType::cuda, 0, kAny, 100}, {"*", MemoryType::host, 0, kAny, 1}});
    auto ucx = std::make_unique<Seen>(registry.make_comm_backend("local", {{"job", "mixed_ucx"}}), std::vector<CommCapability>{{"*", MemoryType::host, 0, kAny, 10}});
    gpu.push_back(nccl.get());
    host.push_back(ucx.get());
    std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members;
    members.emplace_back("nccl-like", std::move(nccl));
    members.emplace_back("ucx-like", std::move(ucx));
    return comm::make_scored_backend(std::move(members));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(stats[static_cast<std::size_t>(r)].staged_calls, 6) << "rank " << r << ": every call of a group with the host rank";
    EXPECT_EQ(stats[static_cast<std::size_t>(r)].direct_calls, 1) << "rank " << r << ": the CUDA pair's all_reduce";
    EXPECT_EQ(gpu[static_cast<std::size_t>(r)]->cuda_buffers, 1) << "rank " << r << ": the pair's all_reduce went to the nccl-like member";
  }
  EXPECT_EQ(gpu[2]->cuda_buffers + gpu[2]->host_buffers, 0) << "the host rank called the ucx-like member only";
  EXPECT_GT(host[2]->host_buffers, 0);
}

}  // namespace
}  // namespace spmdx

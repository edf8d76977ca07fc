// nccl: collectives over NCCL (NVIDIA Collective Communications Library) for buffers in GPU
// memory. rank 0's ncclUniqueId goes through the job's store; one communicator for all ranks
// (ncclCommInitRank), and one per group made with ncclCommSplit (every rank calls new_group at
// the same point, so the split is collective). Each rank uses GPU LOCAL_RANK % device count.
// Every operation runs on the backend's CUDA stream; its Work records a CUDA event, and wait()
// polls it and the communicator's asynchronous error until the timeout, then aborts the
// communicators (ncclCommAbort), as PyTorch's ProcessGroupNCCL watchdog does. StreamOrdered
// (comm.h) ties the comm stream to the host's compute stream with events, both ways, as
// ProcessGroupNCCL does with the current stream. Host buffers are staged through device memory
// (copy in, run, copy out on the same stream), so a CPU job can use NCCL too, if slowly.
// Uneven all_gather and reduce_scatter are NCCL broadcasts / reduces in one ncclGroupStart/End
// (the allgatherv/reducescatterv idiom); all_to_all is grouped ncclSend/ncclRecv. all_to_all_v
// (VariableAllToAll) first sends each member its count (grouped ncclSend/ncclRecv of one
// int64), waits for them on the host, since ncclRecv takes a host count, then moves the data
// as all_to_all does (torchtitan's dispatch syncs its split sizes to the host the same way).
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>

#include "spmdx/core/log.h"
#include "spmdx/plugin.h"

namespace {

using spmdx::CommBuffer;
using spmdx::CommError;
using spmdx::MemoryType;

void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw CommError("nccl: CUDA " + what + ": " + cudaGetErrorString(e), -1);
}
void nccl_check(ncclResult_t r, const std::string& what) {
  if (r != ncclSuccess) throw CommError("nccl: " + what + ": " + ncclGetErrorString(r), -1);
}

ncclDataType_t nccl_type(spmdx::CommDType t) {
  switch (t) {
    case spmdx::CommDType::f32: return ncclFloat32;
    case spmdx::CommDType::f64: return ncclFloat64;
    case spmdx::CommDType::f16: return ncclFloat16;
    case spmdx::CommDType::bf16: return ncclBfloat16;
    case spmdx::CommDType::i32: return ncclInt32;
    case spmdx::CommDType::i64: return ncclInt64;
    case spmdx::CommDType::u8: return ncclUint8;
  }
  throw std::invalid_argument("nccl: unknown dtype");
}

ncclRedOp_t nccl_op(spmdx::ReduceOp op) {
  switch (op) {
    case spmdx::ReduceOp::sum: return ncclSum;
    case spmdx::ReduceOp::avg: return ncclAvg;
    case spmdx::ReduceOp::max: return ncclMax;
    case spmdx::ReduceOp::min: return ncclMin;
    case spmdx::ReduceOp::prod: return ncclProd;
  }
  throw std::invalid_argument("nccl: unknown reduce op");
}

class NcclWork final : public spmdx::Work {
 public:
  // `failed`: the communicator's asynchronous error ("" while there is none); `abort`: what a
  // timeout or an error does to every communicator.
  NcclWork(cudaEvent_t event, std::function<std::string()> failed, std::function<void()> abort, std::string what)
      : event_(event), failed_(std::move(failed)), abort_(std::move(abort)), what_(std::move(what)) {}
  ~NcclWork() override {
    if (!done_) {
      try {
        wait(1e9);
      } catch (...) {  // the error was or will be reported by the wait that saw it
      }
    }
    cudaEventDestroy(event_);
  }
  bool wait(double timeout_seconds) override {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds);
    while (!test()) {
      if (const std::string error = failed_(); !error.empty()) {
        abort_();
        throw CommError("nccl: " + what_ + " failed: " + error + " (communicators aborted)", -1);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        abort_();
        throw CommError("nccl: " + what_ + " did not complete within " + std::to_string(timeout_seconds) + " s (communicators aborted)", -1);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    return true;
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    cuda_check(e, what_);
    done_ = true;
    return true;
  }
  cudaEvent_t event() const noexcept { return event_; }

 private:
  cudaEvent_t event_;
  std::function<std::string()> failed_;
  std::function<void()> abort_;
  std::string what_;
  bool done_ = false;
};

class NcclBackend final : public spmdx::CommBackend, public spmdx::StreamOrdered, public spmdx::VariableAllToAll {
 public:
  /// Checks, without joining a job, that this machine has a CUDA device: NCCL moves data
  /// between GPUs (host buffers are staged through one). Throws std::invalid_argument.
  explicit NcclBackend(const spmdx::Options& options) {
    for (const auto& [k, v] : options) throw std::invalid_argument("nccl: unknown option '" + k + "' (it has none)");
    int devices = 0;
    const cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
      // A driver too old for the runtime, or none at all, reads as an error, not as 0 devices.
      throw std::invalid_argument(std::string("nccl: no usable CUDA device on this machine (") +
                                  (e != cudaSuccess ? std::string("CUDA: ") + cudaGetErrorString(e) : std::string("0 devices")) +
                                  "); nccl needs one per rank: use ucx for host memory");
    }
  }
  ~NcclBackend() override { finalize(); }

  void init(const spmdx::CommInit& init) override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      throw CommError("nccl: rank " + std::to_string(init.rank) + " sees no CUDA device; use ucx for host memory", init.rank);
    }
    if (init.store == nullptr && init.world_size > 1) throw std::invalid_argument("nccl: init needs a store");
    const char* local = std::getenv("LOCAL_RANK");
    device_ = local ? std::atoi(local) : init.rank;
    if (device_ < 0 || device_ >= devices) {
      throw CommError("nccl: rank " + std::to_string(init.rank) + " (LOCAL_RANK " + std::to_string(device_) + ") has no GPU of its own: this machine has " +
                      std::to_string(devices) + " and NCCL takes one per rank", init.rank);
    }
    cuda_check(cudaSetDevice(device_), "set device " + std::to_string(device_));
    cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "create stream");
    ncclUniqueId id;
    const std::string key = "spmdx/nccl/g" + std::to_string(init.generation) + "/id";
    if (init.rank == 0) {
      nccl_check(ncclGetUniqueId(&id), "get unique id");
      if (init.store != nullptr) init.store->set(key, std::string(reinterpret_cast<const char*>(&id), sizeof id));
    } else {
      const std::string bytes = init.store->get(key, init.timeout_seconds);
      if (bytes.size() != sizeof id) throw CommError("nccl: bad unique id in the store", 0);
      std::memcpy(&id, bytes.data(), sizeof id);
    }
    rank_ = init.rank;
    world_size_ = init.world_size;
    timeout_ = init.timeout_seconds;
    ncclComm_t world = nullptr;
    nccl_check(ncclCommInitRank(&world, init.world_size, id, init.rank), "init rank " + std::to_string(init.rank));
    comms_ = {world};
    members_ = {{}};
    for (int r = 0; r < init.world_size; ++r) members_[0].push_back(r);
  }

  void finalize() override {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (ncclComm_t c : comms_) ncclCommDestroy(c);
    comms_.clear();
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    stream_ = nullptr;
  }

  void abort() noexcept override {
    aborted_->store(true);
    for (ncclComm_t c : comms_) ncclCommAbort(c);
    comms_.clear();
  }

  std::string describe() const override {
    int version = 0;
    ncclGetVersion(&version);
    return "nccl " + std::to_string(version) + " (GPU " + std::to_string(device_) + ") rank " + std::to_string(rank_) + "/" + std::to_string(world_size_);
  }

  void issue_after(void* stream) override {
    cudaEvent_t ready = nullptr;
    cuda_check(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "create event");
    cuda_check(cudaEventRecord(ready, static_cast<cudaStream_t>(stream)), "record the compute stream's event");
    cuda_check(cudaStreamWaitEvent(stream_, ready, 0), "order the comm stream after the compute stream");
    cudaEventDestroy(ready);  // released once the wait has seen it
  }

  bool stream_wait(spmdx::Work& work, void* stream) override {
    auto* mine = dynamic_cast<NcclWork*>(&work);
    if (mine == nullptr) return false;
    cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), mine->event(), 0), "order the compute stream after a collective");
    return true;
  }

  std::vector<spmdx::CommCapability> capabilities() const override {
    return {{"*", MemoryType::cuda, 0, static_cast<std::size_t>(-1), 100}, {"*", MemoryType::host, 0, static_cast<std::size_t>(-1), 1}};
  }

  int new_group(const std::vector<int>& ranks) override {
    if (std::find(ranks.begin(), ranks.end(), rank_) == ranks.end()) throw std::invalid_argument("nccl: new_group: rank " + std::to_string(rank_) + " is not a member");
    if (aborted_->load()) throw CommError("nccl: new_group on rank " + std::to_string(rank_) + ": the backend was aborted", -1);
    ncclComm_t comm = nullptr;
    nccl_check(ncclCommSplit(comms_.at(0), ranks.front(), rank_, &comm, nullptr), "split a group");
    comms_.push_back(comm);
    members_.push_back(ranks);
    return static_cast<int>(comms_.size() - 1);
  }

  std::unique_ptr<spmdx::Work> all_reduce(int group, CommBuffer buf, spmdx::ReduceOp op) override {
    return run("all_reduce", {buf}, {buf}, [&](ncclComm_t c, void** in, void** out) {
      nccl_check(ncclAllReduce(in[0], out[0], buf.count, nccl_type(buf.dtype), nccl_op(op), c, stream_), "all_reduce");
    }, group);
  }

  std::unique_ptr<spmdx::Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override {
    return run("all_gather", {in}, {out}, [&](ncclComm_t c, void** i, void** o) {
      const std::size_t es = in.bytes() / std::max<std::size_t>(in.count, 1);
      std::size_t offset = 0;
      nccl_check(ncclGroupStart(), "group start");
      for (std::size_t j = 0; j < counts.size(); ++j) {
        nccl_check(ncclBroadcast(i[0], static_cast<char*>(o[0]) + offset * es, counts[j], nccl_type(in.dtype), static_cast<int>(j), c, stream_), "all_gather");
        offset += counts[j];
      }
      nccl_check(ncclGroupEnd(), "group end");
    }, group);
  }

  std::unique_ptr<spmdx::Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, spmdx::ReduceOp op) override {
    return run("reduce_scatter", {in}, {out}, [&](ncclComm_t c, void** i, void** o) {
      const std::size_t es = spmdx::comm_dtype_size(in.dtype);
      std::size_t offset = 0;
      nccl_check(ncclGroupStart(), "group start");
      for (std::size_t j = 0; j < counts.size(); ++j) {
        nccl_check(ncclReduce(static_cast<char*>(i[0]) + offset * es, o[0], counts[j], nccl_type(in.dtype), nccl_op(op), static_cast<int>(j), c, stream_), "reduce_scatter");
        offset += counts[j];
      }
      nccl_check(ncclGroupEnd(), "group end");
    }, group);
  }

  std::unique_ptr<spmdx::Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                          std::vector<std::size_t> recv_counts) override {
    return run("all_to_all", {in}, {out}, [&](ncclComm_t c, void** i, void** o) {
      const std::size_t es = spmdx::comm_dtype_size(in.dtype);
      std::size_t so = 0, ro = 0;
      nccl_check(ncclGroupStart(), "group start");
      for (std::size_t j = 0; j < send_counts.size(); ++j) {
        nccl_check(ncclSend(static_cast<char*>(i[0]) + so * es, send_counts[j], nccl_type(in.dtype), static_cast<int>(j), c, stream_), "send");
        nccl_check(ncclRecv(static_cast<char*>(o[0]) + ro * es, recv_counts[j], nccl_type(in.dtype), static_cast<int>(j), c, stream_), "recv");
        so += send_counts[j];
        ro += recv_counts[j];
      }
      nccl_check(ncclGroupEnd(), "group end");
    }, group);
  }

  std::unique_ptr<spmdx::Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                            std::size_t* recv_counts) override {
    if (group < 0 || group >= static_cast<int>(comms_.size())) throw std::invalid_argument("nccl: all_to_all_v: no group " + std::to_string(group));
    if (recv_counts == nullptr) throw std::invalid_argument("nccl: all_to_all_v: recv_counts is null; pass one std::size_t per group member");
    if (in.dtype != out.dtype) throw std::invalid_argument("nccl: all_to_all_v: in and out have different dtypes");
    const std::size_t k = members_.at(static_cast<std::size_t>(group)).size();
    std::size_t sent = 0;
    for (std::size_t c : send_counts) sent += c;
    if (send_counts.size() != k || sent != in.count) {
      throw std::invalid_argument("nccl: all_to_all_v: send_counts (" + std::to_string(send_counts.size()) + " entries, " + std::to_string(sent) +
                                  " elements) do not match the group's " + std::to_string(k) + " members or in.count " + std::to_string(in.count));
    }
    // The counts, staged through the GPU and waited for here (with the timeout and the abort of
    // every other call).
    std::vector<std::int64_t> mine(send_counts.begin(), send_counts.end()), theirs(k, 0);
    run("all_to_all_v counts", {{mine.data(), k, spmdx::CommDType::i64, MemoryType::host}}, {{theirs.data(), k, spmdx::CommDType::i64, MemoryType::host}},
        [&](ncclComm_t c, void** i, void** o) {
          nccl_check(ncclGroupStart(), "group start");
          for (std::size_t j = 0; j < k; ++j) {
            nccl_check(ncclSend(static_cast<std::int64_t*>(i[0]) + j, 1, ncclInt64, static_cast<int>(j), c, stream_), "send a count");
            nccl_check(ncclRecv(static_cast<std::int64_t*>(o[0]) + j, 1, ncclInt64, static_cast<int>(j), c, stream_), "receive a count");
          }
          nccl_check(ncclGroupEnd(), "group end");
        }, group)->wait(timeout_);
    std::vector<std::size_t> counts(theirs.begin(), theirs.end());
    std::size_t total = 0;
    for (std::size_t j = 0; j < k; ++j) total += recv_counts[j] = counts[j];
    const std::size_t es = spmdx::comm_dtype_size(in.dtype);
    auto exchange = [&](CommBuffer into) {
      return run("all_to_all_v", {in}, {into}, [&](ncclComm_t c, void** i, void** o) {
        std::size_t so = 0, ro = 0;
        nccl_check(ncclGroupStart(), "group start");
        for (std::size_t j = 0; j < k; ++j) {
          nccl_check(ncclSend(static_cast<char*>(i[0]) + so * es, send_counts[j], nccl_type(in.dtype), static_cast<int>(j), c, stream_), "send");
          nccl_check(ncclRecv(static_cast<char*>(o[0]) + ro * es, counts[j], nccl_type(in.dtype), static_cast<int>(j), c, stream_), "recv");
          so += send_counts[j];
          ro += counts[j];
        }
        nccl_check(ncclGroupEnd(), "group end");
      }, group);
    };
    // Only the received elements are staged and copied out: the rest of `out` stays as it was.
    if (total <= out.count) return exchange({out.data, total, out.dtype, out.memory});
    // Too much for `out`: drained into a buffer of ours, so that the senders complete, then failed.
    std::vector<unsigned char> drain(total * es);
    exchange({drain.data(), total, out.dtype, MemoryType::host})->wait(timeout_);
    std::string from;
    for (std::size_t j = 0; j < k; ++j) from += (j ? ", " : "") + std::to_string(counts[j]);
    throw std::invalid_argument("nccl: all_to_all_v: the members sent rank " + std::to_string(rank_) + " " + std::to_string(total) + " elements (" + from +
                                ", in member order) but out.count is " + std::to_string(out.count) +
                                "; size the receive buffer for the most this rank may receive");
  }

  std::unique_ptr<spmdx::Work> broadcast(int group, CommBuffer buf, int root_member) override {
    return run("broadcast", {buf}, {buf}, [&](ncclComm_t c, void** i, void** o) {
      nccl_check(ncclBroadcast(i[0], o[0], buf.count, nccl_type(buf.dtype), root_member, c, stream_), "broadcast");
    }, group);
  }

  std::unique_ptr<spmdx::Work> send(CommBuffer buf, int peer_rank, int) override {
    return run("send", {buf}, {}, [&](ncclComm_t c, void** i, void**) {
      nccl_check(ncclSend(i[0], buf.count, nccl_type(buf.dtype), peer_rank, c, stream_), "send");
    }, 0);
  }

  std::unique_ptr<spmdx::Work> recv(CommBuffer buf, int peer_rank, int) override {
    return run("recv", {}, {buf}, [&](ncclComm_t c, void**, void** o) {
      nccl_check(ncclRecv(o[0], buf.count, nccl_type(buf.dtype), peer_rank, c, stream_), "recv");
    }, 0);
  }

  std::unique_ptr<spmdx::Work> barrier(int group) override {
    if (aborted_->load()) throw CommError("nccl: barrier on rank " + std::to_string(rank_) + ": the backend was aborted", -1);
    void* one = nullptr;
    cuda_check(cudaMallocAsync(&one, sizeof(int), stream_), "allocate");
    cuda_check(cudaMemsetAsync(one, 0, sizeof(int), stream_), "memset");
    CommBuffer b{one, 1, spmdx::CommDType::i32, MemoryType::cuda};
    auto work = run("barrier", {b}, {b}, [&](ncclComm_t c, void** i, void** o) {
      nccl_check(ncclAllReduce(i[0], o[0], 1, ncclInt32, ncclSum, c, stream_), "barrier");
    }, group);
    cuda_check(cudaFreeAsync(one, stream_), "free");
    return work;
  }

 private:
  // Stages host buffers through device memory, enqueues `body` on the stream, records an event.
  std::unique_ptr<spmdx::Work> run(const char* name, std::vector<CommBuffer> ins, std::vector<CommBuffer> outs,
                                   const std::function<void(ncclComm_t, void**, void**)>& body, int group) {
    // After abort() every communicator is gone: future work fails as the ABI says, with the
    // CommError a caller recovers from (fault tolerance's rejoin), not as a missing group.
    if (aborted_->load()) throw CommError(std::string("nccl: ") + name + " on rank " + std::to_string(rank_) + ": the backend was aborted", -1);
    if (group < 0 || group >= static_cast<int>(comms_.size())) throw std::invalid_argument(std::string("nccl: ") + name + ": no group " + std::to_string(group));
    void* in[1] = {nullptr};
    void* out[1] = {nullptr};
    std::vector<void*> staged;
    auto device = [&](const CommBuffer& b, bool copy_in) -> void* {
      if (b.memory == MemoryType::cuda) return b.data;
      void* d = nullptr;
      cuda_check(cudaMallocAsync(&d, std::max<std::size_t>(b.bytes(), 1), stream_), "allocate a staging buffer");
      if (copy_in && b.bytes() > 0) cuda_check(cudaMemcpyAsync(d, b.data, b.bytes(), cudaMemcpyHostToDevice, stream_), "copy in");
      staged.push_back(d);
      return d;
    };
    if (!ins.empty()) in[0] = device(ins[0], true);
    if (!outs.empty()) out[0] = (!ins.empty() && outs[0].data == ins[0].data) ? in[0] : device(outs[0], false);
    body(comms_[static_cast<std::size_t>(group)], in, out);
    if (!outs.empty() && outs[0].memory == MemoryType::host && outs[0].bytes() > 0) {
      cuda_check(cudaMemcpyAsync(outs[0].data, out[0], outs[0].bytes(), cudaMemcpyDeviceToHost, stream_), "copy out");
    }
    for (void* d : staged) cuda_check(cudaFreeAsync(d, stream_), "free a staging buffer");
    cudaEvent_t event = nullptr;
    cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "create event");
    cuda_check(cudaEventRecord(event, stream_), "record event");
    const ncclComm_t comm = comms_[static_cast<std::size_t>(group)];
    auto failed = [comm, aborted = aborted_]() -> std::string {
      if (aborted->load()) return "the backend was aborted";  // comm is gone
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) != ncclSuccess || async == ncclSuccess || async == ncclInProgress) return "";
      return ncclGetErrorString(async);
    };
    return std::make_unique<NcclWork>(event, failed, [this] { abort(); },
                                      std::string(name) + " on rank " + std::to_string(rank_) + " (group " + std::to_string(group) + ": ranks " + ranks_text(group) + ")");
  }

  std::string ranks_text(int group) const {
    std::string out;
    for (int r : members_.at(static_cast<std::size_t>(group))) out += (out.empty() ? "" : ",") + std::to_string(r);
    return out;
  }

  std::shared_ptr<std::atomic<bool>> aborted_ = std::make_shared<std::atomic<bool>>(false);  // read by Works that outlive a call
  int rank_ = 0, world_size_ = 1, device_ = 0;
  double timeout_ = 300;
  cudaStream_t stream_ = nullptr;
  std::vector<ncclComm_t> comms_;
  std::vector<std::vector<int>> members_;
};

void register_nccl(spmdx::Registrar& r) {
  r.add_comm_backend("nccl", [](const spmdx::Options& options) { return std::make_unique<NcclBackend>(options); });
}

}  // namespace

SPMDX_PLUGIN("nccl", comm, "0.1.0", "NCCL on GPU memory (host buffers staged through the GPU); needs a CUDA device", register_nccl)

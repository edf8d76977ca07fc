// Starting ranks. A rank learns who it is from its environment, as torchrun, SLURM and Open
// MPI set it; `spmdx run --nproc N` starts N ranks on this machine itself (as
// `torchrun --standalone`), serving the rendezvous store, prefixing their output with their
// rank, and stopping all of them when one fails or the user presses Ctrl-C.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace spmdx::launch {

struct RankEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string token;          ///< SPMDX_JOB_TOKEN ("" when none was set)
  bool store_hosted = false;  ///< the launcher serves the store (else rank 0 does)
  std::string source;         ///< "spmdx" (spmdx run's launcher), "torchrun", "RANK" (set by hand), "slurm", "openmpi" or "single"
  std::string world_size_from = "WORLD_SIZE";  ///< the variable world_size came from (for messages)
  /// torchrun's agent serves a c10d TCPStore at master_addr:master_port
  /// (TORCHELASTIC_USE_AGENT_STORE=True): join it rather than serve one.
  bool c10d_store = false;
  std::string run_id;         ///< TORCHELASTIC_RUN_ID (and -TORCHELASTIC_RESTART_COUNT), to prefix keys in a shared store
};

/// Reads RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun and
/// spmdx's launcher), else SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID, else
/// OMPI_COMM_WORLD_RANK/_SIZE/_LOCAL_RANK; a single rank when none is set. Throws
/// std::invalid_argument naming a variable that is set but not a valid number.
RankEnv rank_env();

/// This process's CPUs: its affinity mask (taskset, a cgroup cpuset, a SLURM binding), else the
/// machine's. What a host's ranks share for intra-op threads, and what the cost model
/// (plan/estimate.h) divides among them.
std::int64_t usable_cpus();

/// The CPUs of a list in taskset's (and cpuset's) form: numbers, ranges and ranges with a
/// stride, comma separated ("0", "2-3", "0,4-7", "0-7:2" for 0, 2, 4, 6), sorted, each once. Throws std::invalid_argument naming the list and
/// what is wrong with it (not a number, a range backwards, empty).
std::vector<int> parse_cpu_list(const std::string& list);

/// --cpu-affinity's value checked for `nproc` local ranks: `spec` is one CPU list a rank, ';'
/// separated ("0;1;1": rank 0 alone on CPU 0, ranks 1 and 2 sharing CPU 1), every CPU among
/// this process's own (its affinity mask). Returns each rank's list as given; throws
/// std::invalid_argument naming the flag, the rank and the CPU at fault.
std::vector<std::string> cpu_affinity_lists(const std::string& spec, int nproc);

/// Each rank's share of the CPUs of `lists` (cpu_affinity_lists's), in cores: the sum over its
/// CPUs of 1 / the ranks given that CPU ("0;1;1" gives 1, 0.5, 0.5; "0-3;4-7" gives 4 and 4).
/// Its intra-op threads are the whole cores of it, at least 1; MFU's peak counts the share.
std::vector<double> cpu_shares(const std::vector<std::string>& lists);

/// This rank's share of cores from SPMDX_CPU_SHARE (set by --cpu-affinity), else 0: none
/// given, `env` not a rank spmdx run's launcher started (env.store_hosted), or not a number
/// from 0 to this process's CPUs.
double cpu_share(const RankEnv& env);

/// Pins this process to SPMDX_CPU_AFFINITY's CPUs (the launcher's --cpu-affinity, one list a
/// rank) before any thread starts; threads made after it inherit the set. Read only in a rank
/// spmdx run's launcher started (env.store_hosted), which sets it, empty without the flag: a
/// value left in a user's environment must not undo taskset's, srun's or mpirun's binding.
/// Returns the set the kernel holds after it, in taskset's form ("" when none is given).
/// Throws std::runtime_error naming the variable when the list is malformed or the kernel
/// refuses it.
std::string apply_cpu_affinity(const RankEnv& env);

/// The kernel's count of the processes its out-of-memory killer has killed, and the file it
/// was read from: this process's cgroup v2 `memory.events` (the kills in this container or job),
/// else /proc/vmstat (the machine's, since boot; Linux >= 4.13).
struct OomKillCount {
  std::int64_t kills = 0;
  std::string file;
};

/// The count now; nullopt when neither file has an `oom_kill` line (another OS, an old kernel).
std::optional<OomKillCount> oom_kill_count();

/// The value of the `oom_kill N` line of a file in memory.events' or /proc/vmstat's format;
/// nullopt when the file cannot be read or has no such line.
std::optional<std::int64_t> read_oom_kill(const std::string& file);

/// How the launcher says a rank died of `signal`: "was killed by signal Killed". For SIGKILL it
/// names the out-of-memory killer when the count rose from `before` (at launch) to `after` (when
/// the rank was reaped), and says it may have been when the count cannot be read; a count read
/// and unchanged says nothing more (a person or a scheduler killed the rank).
std::string killed_by(int signal, const std::optional<OomKillCount>& before, const std::optional<OomKillCount>& after);

/// torchrun's launch flags.
struct LaunchOptions {
  int nproc = 1;               ///< --nproc (--nproc-per-node): ranks on this node
  int nnodes = 1;              ///< --nnodes
  int node_rank = 0;           ///< --node-rank
  std::string master_addr;     ///< --master-addr: node 0's address ("" on one node: loopback)
  int master_port = 0;         ///< --master-port (0 on one node: any free port)
  std::string command = "spmdx run";  ///< the command its messages name
  /// The flight_recorder hook's folder when the job runs it ("" otherwise): when ranks fail
  /// alike (each exits with an error, none named by the others), the launcher reads their
  /// dumps and blames the rank that skipped or missed a collective rather than the lowest.
  std::string flight_recorder_dir;
  /// Fault tolerance ([fault_tolerance], one node): the replica groups, each of
  /// ft_ranks_per_group consecutive ranks (0 groups: off). Once every rank has joined the job
  /// (replica_groups.h's "started"), a rank that fails costs its group only: the launcher stops
  /// the group's other ranks, records the group lost (the others train on), and starts it again
  /// while restarts are left; below ft_min_replicas live groups the job stops.
  int ft_groups = 0;
  int ft_ranks_per_group = 1;
  int ft_min_replicas = 1;
  /// fault_tolerance.process_group_timeout_ms in seconds: a rank stopped (SIGSTOP) longer than
  /// twice this is killed as hung, even with no live peer to notice it.
  double ft_timeout_seconds = 10;
  /// --max-restarts (torchrun's flag): how many times lost replica groups are started again,
  /// over the whole job.
  int max_restarts = 0;
  /// --cpu-affinity: local rank r's CPUs (taskset's list form), one entry a rank, checked by
  /// cpu_affinity_lists; each rank gets SPMDX_CPU_AFFINITY (pinned by apply_cpu_affinity) and
  /// SPMDX_CPU_SHARE (its cpu_shares). Empty: the ranks inherit the launcher's CPUs.
  std::vector<std::string> cpu_affinity{};
};

/// Runs `nproc` copies of `argv` (argv[0]: the program) with the rank variables set (ranks
/// node_rank x nproc + i). On one node: a store on a free loopback port and a fresh job token.
/// On several: node 0 serves the store on master_addr:master_port and every node needs the same
/// SPMDX_JOB_TOKEN in its environment. Lines of each rank's output get a "[rank R] " prefix.
/// Returns 0 when every rank exits 0; otherwise stops the others (SIGTERM, then SIGKILL after
/// 5 s), prints which rank failed and how, and returns 1. SIGINT and SIGTERM are passed on to
/// every rank (then it returns 128 + the signal, 130 for Ctrl-C). No rank outlives the launcher. Throws std::invalid_argument for bad options.
int launch(const LaunchOptions& options, const std::vector<std::string>& argv);

}  // namespace spmdx::launch

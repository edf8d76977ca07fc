// Rendezvous: before the comm backend joins, every rank says who it is and what it will run,
// and rank 0 checks that they agree, so that ranks started by hand (as torchrun, srun and
// mpirun start them) with different settings fail at once with one message naming the setting
// and the ranks, instead of training on silently or timing out blaming each other. The checks
// are those of torchrun's rendezvous (world size) and of c10d's job identity (the job token)
// plus the effective config, key by key.
//
// Protocol over the job's store (keys under "spmdx/rdzv/"): each rank claims its rank number
// (add claim/R), publishes its settings (settings/R) and its identity (info/R: world size and
// the variable it came from, host, spmdx and plugin ABI version, hashes of the job token and
// of the settings), then counts itself in (joined). Rank 0 waits for world_size ranks (logging
// which ones it waits for every 5 s, and naming a rank the store refused for a wrong job
// token), compares, and publishes a verdict every rank waits for.
#pragma once

#include <map>
#include <string>

#include "spmdx/comm.h"

namespace spmdx::launch {

/// What a rank says of itself at rendezvous.
struct RankIdentity {
  int rank = 0;
  int world_size = 1;
  std::string world_size_from = "WORLD_SIZE";  ///< the variable world_size came from
  std::string host;                            ///< this machine's name
  int local_rank = 0;                          ///< LOCAL_RANK: this rank among its host's
  int local_world_size = 1;                    ///< LOCAL_WORLD_SIZE: the ranks on its host
  std::string version;                         ///< "spmdx 0.1.0, plugin ABI 2.1"
  std::string token;                           ///< SPMDX_JOB_TOKEN ("" when none): only its hash is published
  std::map<std::string, std::string> settings; ///< the effective config (Config::settings())
};

/// Checks with every other rank that the job is one job: the same world size, job token, spmdx
/// version and config. Every rank calls it once, after connecting to the store and before the
/// backend joins. `store_address` names the store in messages. Waits at most timeout_seconds
/// (other ranks: a little longer, for rank 0's verdict). Throws CommError, with the same
/// message on every rank, naming what differs and on which ranks ("rank 1 has optimizer.lr =
/// 0.003, rank 0 has 0.0008"), the ranks that never joined, a rank refused for its job token,
/// or another process that joined as the same rank. `linger_seconds` (> 0 when rank 0 serves
/// the store itself): after refusing, rank 0 keeps the store up that long for ranks that have
/// not joined yet, so that they learn why rather than time out on a missing store.
void rendezvous(Store& store, const RankIdentity& me, double timeout_seconds, const std::string& store_address, double linger_seconds = 0);

}  // namespace spmdx::launch

// Cleaning up after the shared-memory component of the collective engine (core/src/comm/p2p/
// shm.cpp), for the launcher.
#pragma once

namespace spmdx::comm {

/// Unlinks the shared-memory segments (/dev/shm/spmdx-<pid>-...) that rank process `pid` made
/// for a group and left behind because it died before every member had mapped them; the
/// launcher calls it for every rank it reaped. Returns how many it removed.
int remove_shared_memory_of(long pid);

}  // namespace spmdx::comm

// What a rank with debug hooks does on SIGTERM, SIGINT and SIGUSR1: the hooks dump first.
#pragma once

#include <csignal>
#include <thread>

#include "spmdx/hooks/hook_set.h"

namespace spmdx::job {

// With debug hooks on, SIGTERM, SIGINT and SIGUSR1 go to a thread of their own: SIGUSR1 asks
// the hooks to dump (the flight recorder) and goes on; SIGTERM and SIGINT (the launcher
// stopping the job, Ctrl-C) dump, then exit 128 + signal. Blocked before any other thread
// starts, so that every thread inherits the mask.
class SignalDumper {
 public:
  SignalDumper();
  void start(hooks::HookSet* hooks);
  ~SignalDumper();

 private:
  sigset_t set_, old_;
  std::thread thread_;
};

}  // namespace spmdx::job

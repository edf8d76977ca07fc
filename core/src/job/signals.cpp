#include "spmdx/job/signals.h"

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace spmdx::job {

SignalDumper::SignalDumper() {
  sigemptyset(&set_);
  for (int s : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaddset(&set_, s);
  pthread_sigmask(SIG_BLOCK, &set_, &old_);
}

void SignalDumper::start(hooks::HookSet* hooks) {
  thread_ = std::thread([this, hooks] {
    while (true) {
      int sig = 0;
      if (sigwait(&set_, &sig) != 0 || sig == SIGUSR2) return;  // SIGUSR2: the destructor's stop
      hooks->failure(std::string("signal ") + strsignal(sig) + (sig == SIGUSR1 ? " (dump requested)" : ""));
      if (sig != SIGUSR1) {
        std::fflush(nullptr);
        _exit(128 + sig);
      }
    }
  });
}

SignalDumper::~SignalDumper() {
  if (thread_.joinable()) {
    pthread_kill(thread_.native_handle(), SIGUSR2);
    thread_.join();
  }
  pthread_sigmask(SIG_SETMASK, &old_, nullptr);
}

}  // namespace spmdx::job

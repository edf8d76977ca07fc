// A Work that does something once its call completes: a staged call's outputs copied back to
// the device (comm/staging.h), a sum over fewer live ranks rescaled (fault tolerance's
// LiveBackend). Header only.
#pragma once

#include <functional>
#include <memory>
#include <utility>

#include "spmdx/comm.h"

namespace spmdx::comm {

/// `inner`, and then `then()`, once, on the thread that first sees `inner` complete (wait()
/// or test() true); an exception from `then` comes out of that wait() or test(). `keep` (the
/// buffers the call uses) goes after `inner`, when this Work goes.
class ThenWork final : public Work {
 public:
  ThenWork(std::unique_ptr<Work> inner, std::function<void()> then, std::shared_ptr<void> keep = nullptr)
      : inner_(std::move(inner)), then_(std::move(then)), keep_(std::move(keep)) {}
  ~ThenWork() override {
    inner_.reset();  // done or failed before the buffers it uses go
    keep_.reset();
  }
  ThenWork(const ThenWork&) = delete;
  ThenWork& operator=(const ThenWork&) = delete;
  bool wait(double timeout_seconds) override {
    if (!inner_->wait(timeout_seconds)) return false;
    once();
    return true;
  }
  bool test() override {
    if (!inner_->test()) return false;
    once();
    return true;
  }
  bool times(double& started_at, double& finished_at) const override { return inner_->times(started_at, finished_at); }

 private:
  void once() {
    if (done_) return;
    done_ = true;
    then_();
  }
  std::unique_ptr<Work> inner_;
  std::function<void()> then_;
  std::shared_ptr<void> keep_;
  bool done_ = false;
};

}  // namespace spmdx::comm

// OnDemandLoop: the loop of an object that has no thread of its own, such as a recv whose events
// come from a transport thread, the callback executor and a GPU copier's thread. Post runs the
// task on the calling thread when no other thread is running the loop's tasks, and otherwise
// queues it for the thread that is, which runs it before its own Post returns. Tasks run one at a
// time, in the order posted, so the state they touch needs no lock and no "who finishes" flags:
// the object's machine advances in its tasks only. A task may post more; they run after it.
// TensorPipe's on-demand deferred executor works the same way.
//
// Thread-safe. The loop must outlive every Post: an owner held by shared_ptr keeps a reference
// across each Post (the tasks of a loop may drop the others).
#ifndef TENSORVERBS_COMMON_ON_DEMAND_LOOP_H_
#define TENSORVERBS_COMMON_ON_DEMAND_LOOP_H_

#include <deque>

#include "absl/functional/any_invocable.h"
#include "src/common/mutex.h"

namespace tensorverbs {

class OnDemandLoop {
 public:
  using Task = absl::AnyInvocable<void() &&>;

  void Post(Task task) {
    {
      MutexLock lock(&mu_);
      pending_.push_back(std::move(task));
      if (running_) return;  // the thread running the loop runs it
      running_ = true;
    }
    for (;;) {
      Task next;
      {
        MutexLock lock(&mu_);
        if (pending_.empty()) {
          running_ = false;
          return;
        }
        next = std::move(pending_.front());
        pending_.pop_front();
      }
      std::move(next)();
    }
  }

 private:
  Mutex mu_;
  std::deque<Task> pending_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_ON_DEMAND_LOOP_H_

#include "src/fabric/wake_fd.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cstdint>

namespace tensorverbs::fabric {

WakeFd::WakeFd() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

WakeFd::~WakeFd() {
  if (fd_ >= 0) close(fd_);
}

void WakeFd::Signal() {
  if (fd_ < 0) return;
  uint64_t one = 1;
  // A full counter (EAGAIN) already means "wake up"; nothing else can fail here.
  [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
}

void WakeFd::Drain() {
  if (fd_ < 0) return;
  uint64_t value;
  [[maybe_unused]] ssize_t n = read(fd_, &value, sizeof(value));
}

}  // namespace tensorverbs::fabric

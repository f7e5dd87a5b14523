// WakeFd: an eventfd that lets any thread end a Domain::Wait blocked in poll(2). The ofi and
// ibverbs backends add fd() to the descriptors they wait on; Signal() is async-signal-safe
// and callable from any thread; Drain() runs on the waiting (progress) thread after poll.
#ifndef TENSORVERBS_FABRIC_WAKE_FD_H_
#define TENSORVERBS_FABRIC_WAKE_FD_H_

namespace tensorverbs::fabric {

class WakeFd {
 public:
  WakeFd();
  WakeFd(const WakeFd&) = delete;
  WakeFd& operator=(const WakeFd&) = delete;
  ~WakeFd();

  int fd() const { return fd_; }  // -1 if the kernel refused an eventfd; Wait then times out
  void Signal();
  void Drain();

 private:
  int fd_;
};

}  // namespace tensorverbs::fabric

#endif  // TENSORVERBS_FABRIC_WAKE_FD_H_

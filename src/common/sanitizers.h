// Annotations for ThreadSanitizer builds; they compile to nothing in every other build. And
// kUnderAddressSanitizer, for code that trades a check for speed only outside ASan builds.
// TsanRelease/TsanAcquire tell TSan of an order it cannot see.
//
// ScopedTsanIgnoreAccesses makes TSan skip the memory accesses of the calling thread while it
// lives. The loopback fabric uses it for one thing: its stand-in for a NIC's DMA write after a
// fault injection has broken the completion-after-write order on purpose (a duplicated
// immediate). A real NIC's writes are invisible to TSan, and the protocol is expected to read
// memory a peer may be writing at that point and reject what it finds; that read is the fault
// under test, not a race in the program. Any thread; not nestable across threads.
#ifndef TENSORVERBS_COMMON_SANITIZERS_H_
#define TENSORVERBS_COMMON_SANITIZERS_H_

#if defined(__SANITIZE_THREAD__)
#define TENSORVERBS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TENSORVERBS_TSAN 1
#endif
#endif

#if defined(__SANITIZE_ADDRESS__)
#define TENSORVERBS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TENSORVERBS_ASAN 1
#endif
#endif

#ifdef TENSORVERBS_TSAN
// From the TSan runtime (its dynamic-annotation interface).
extern "C" void AnnotateIgnoreWritesBegin(const char* file, int line);
extern "C" void AnnotateIgnoreWritesEnd(const char* file, int line);
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace tensorverbs {

#ifdef TENSORVERBS_ASAN
inline constexpr bool kUnderAddressSanitizer = true;
#else
inline constexpr bool kUnderAddressSanitizer = false;
#endif

// An order TSan cannot see, told to it: what a thread did before TsanRelease(key) happens
// before what a thread does after a later TsanAcquire(key). For synchronization through memory
// that two objects of one process map at different addresses (the shmem fabric's rings): TSan
// tracks atomics by address, so it sees no order between a store through one mapping and a load
// through the other. `key` is any address both sides derive alike.
inline void TsanRelease([[maybe_unused]] const void* key) {
#ifdef TENSORVERBS_TSAN
  __tsan_release(const_cast<void*>(key));
#endif
}
inline void TsanAcquire([[maybe_unused]] const void* key) {
#ifdef TENSORVERBS_TSAN
  __tsan_acquire(const_cast<void*>(key));
#endif
}

class ScopedTsanIgnoreAccesses {
 public:
  explicit ScopedTsanIgnoreAccesses(bool enabled) : enabled_(enabled) {
#ifdef TENSORVERBS_TSAN
    if (enabled_) AnnotateIgnoreWritesBegin(__FILE__, __LINE__);
#endif
  }
  ~ScopedTsanIgnoreAccesses() {
#ifdef TENSORVERBS_TSAN
    if (enabled_) AnnotateIgnoreWritesEnd(__FILE__, __LINE__);
#endif
  }
  ScopedTsanIgnoreAccesses(const ScopedTsanIgnoreAccesses&) = delete;
  ScopedTsanIgnoreAccesses& operator=(const ScopedTsanIgnoreAccesses&) = delete;

 private:
  [[maybe_unused]] const bool enabled_;
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_SANITIZERS_H_

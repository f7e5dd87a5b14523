// What tells two processes that they share a host: this boot of the kernel
// (/proc/sys/kernel/random/boot_id) and this process's network namespace (the inode of
// /proc/self/ns/net). Two network namespaces of one machine are two hosts: their tasks reach each
// other over the network only, as the netns tests require. The same-host fabric checks it at
// Connect; the torch backend's same-host groups compare it across their ranks. Read once; any
// thread.
#ifndef TENSORVERBS_COMMON_HOST_IDENTITY_H_
#define TENSORVERBS_COMMON_HOST_IDENTITY_H_

#include <string>

namespace tensorverbs {

const std::string& ThisHostIdentity();

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_HOST_IDENTITY_H_

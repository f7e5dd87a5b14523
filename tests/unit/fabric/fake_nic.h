// A software RDMA NIC behind libibverbs' API, for testing the ibverbs backend without hardware.
//
// The test binary links with -Wl,--wrap for the exported verbs functions (device list, open,
// query, PD, MR, CQ, QP, modify, async events); the data path (post_send, post_recv, poll_cq)
// goes through the fake context's ops table, as libibverbs dispatches it. Writes and reads are
// carried out at post time between QPs of this process, with the RC semantics the backend relies
// on: a write with immediate consumes a receive on the target and completes there as
// IBV_WC_RECV_RDMA_WITH_IMM; a bad rkey or range completes with IBV_WC_REM_ACCESS_ERR; a full send
// queue refuses with ENOMEM; a shared receive queue serves the queue pairs made with it; a CQ
// holds what it was sized for (an overrun is counted); type-2 memory windows are bound by a send
// work request and honoured only on their queue pair. Every modify_qp is recorded. Single-threaded,
// like the tests.
#ifndef TENSORVERBS_TESTS_UNIT_FABRIC_FAKE_NIC_H_
#define TENSORVERBS_TESTS_UNIT_FABRIC_FAKE_NIC_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace tensorverbs::testing {

struct FakeNic {
  // What the device reports.
  std::string name = "fake_0";
  // A second device, as a host with two NICs has (its port, GIDs and limits are the first's):
  // both carry writes between any of the process's queue pairs.
  bool second_device = false;
  std::string second_name = "fake_1";
  ibv_port_state port_state = IBV_PORT_ACTIVE;
  ibv_mtu active_mtu = IBV_MTU_1024;
  std::string gid = "::ffff:10.0.0.7";  // one RoCEv2 GID at index 1, a RoCEv1 one at 0
  int max_qp_wr = 4096;

  // Failures to inject.
  bool fail_alloc_pd = false;
  bool fail_create_cq = false;
  // A CQ of more entries than this fails with ENOMEM, as on a device short of memory for a large
  // one though its max_cqe allows it.
  int create_cq_limit = 1 << 30;
  bool fail_create_qp = false;
  int fail_modify_to = -1;  // an ibv_qp_state that modify_qp refuses (EINVAL)
  // The memlock limit (RLIMIT_MEMLOCK): a registration that would pin more fails with ENOMEM,
  // as the kernel refuses it.
  uint64_t memlock_bytes = UINT64_MAX;
  uint64_t pinned_bytes = 0;  // registered and not deregistered
  // Type-2 memory windows: reported in the device capabilities and allocatable. A window is
  // bound by a send work request (IBV_WR_BIND_MW) over a registration with IBV_ACCESS_MW_BIND
  // and takes remote access only through the queue pair it was bound on.
  bool memory_windows = true;
  int windows_bound = 0;
  int windows_live = 0;  // allocated and not deallocated

  // Shared receive queues: reported (max_srq) and creatable; a queue pair made with one takes
  // its receives from it. Off: the device reports none.
  bool srq = true;
  int srqs_created = 0;
  int srqs_live = 0;
  int srq_posted = 0;  // receives posted on shared receive queues and not yet consumed
  int cqs_created = 0;
  int qps_live = 0;
  // What the device reports as its largest CQ. A CQ holds at most the entries it was created
  // for: one more is an overrun (counted; the entry is lost, as a real CQ's would be).
  int max_cqe = 65536;
  int cq_overruns = 0;
  int sends_posted = 0;  // send work requests the device took (post_send returned 0)
  // Hand out the lowest queue pair number not in use, as a device may reuse a destroyed QP's.
  bool reuse_qp_numbers = false;
  // Destroying a queue pair removes its completions from its CQ, as mlx5 does; the shared
  // receives they consumed are not posted again.
  bool destroy_cleans_cq = false;
  // Queue pairs whose host stopped answering: a write or read to one is neither carried out nor
  // completed (an RC sender keeps retrying), and it holds its send queue entry until its own
  // queue pair is destroyed.
  std::set<uint32_t> unanswering;

  struct Modify {
    uint32_t qp_num;
    ibv_qp_attr attr;
    int mask;
  };
  std::vector<Modify> modifies;
  std::deque<ibv_async_event> async_events;
  int cq_events_raised = 0;  // by armed CQs on the completion channel
  int cq_events_acked = 0;

  static FakeNic& Get();
  void Reset();
};

}  // namespace tensorverbs::testing

#endif  // TENSORVERBS_TESTS_UNIT_FABRIC_FAKE_NIC_H_

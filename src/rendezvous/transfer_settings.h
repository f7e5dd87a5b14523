// TransferSettings: the settings every protocol honours (grpc, grpc+verbs and its modes,
// grpc+gdr): how long a recv and a peer may take, when a slow recv is reported, and how many
// of a peer's requests one task holds.
//
// The server owns one (ServerOptions::transfer) and hands it to whichever protocol it runs;
// each field starts from its variable's default (Config::Defaults()), declared once in
// common/config.h. A plain value, copied where it is needed and read on any thread.
#ifndef TENSORVERBS_RENDEZVOUS_TRANSFER_SETTINGS_H_
#define TENSORVERBS_RENDEZVOUS_TRANSFER_SETTINGS_H_

#include "absl/time/time.h"
#include "src/common/config.h"

namespace tensorverbs {

struct TransferSettings {
  // A remote recv waits this long for its tensor and its peer, then fails
  // (TENSORVERBS_RECV_TIMEOUT_MS).
  absl::Duration recv_timeout = Config::Defaults().recv_timeout;
  // A peer that does not answer the control plane for this long is dead
  // (TENSORVERBS_PEER_TIMEOUT_MS); grpc+verbs also keeps a failed channel's memory this long.
  absl::Duration peer_timeout = Config::Defaults().peer_timeout;
  // A recv still waiting after this long logs one warning (TENSORVERBS_SLOW_RECV_MS; zero:
  // never).
  absl::Duration slow_recv_warning = Config::Defaults().slow_recv_warning;
  // Start-up waits this long for every peer (TENSORVERBS_CONNECT_TIMEOUT_MS).
  absl::Duration connect_timeout = Config::Defaults().connect_timeout;
  // The most requests of one peer pending here at once (TENSORVERBS_MAX_RESPONSES).
  int max_responses = Config::Defaults().max_responses;

  static TransferSettings FromConfig(const Config& config) {
    TransferSettings s;
    s.recv_timeout = config.recv_timeout;
    s.peer_timeout = config.peer_timeout;
    s.slow_recv_warning = config.slow_recv_warning;
    s.connect_timeout = config.connect_timeout;
    s.max_responses = config.max_responses;
    return s;
  }
};

}  // namespace tensorverbs

#endif  // TENSORVERBS_RENDEZVOUS_TRANSFER_SETTINGS_H_

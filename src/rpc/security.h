// RpcSecurity: who may call a task, and how a task proves itself when it calls another. One per
// Server, built by Server::Start from SecurityOptions (files named by TENSORVERBS_TLS_* and
// TENSORVERBS_SECRET_FILE) and shared (const, any thread) by everything that makes gRPC
// channels or serves RPCs for that task.
//
// Two mechanisms, usable together:
//   - mutual TLS: every task presents a certificate signed by the cluster's CA and accepts
//     only callers that do; the connection is private;
//   - a cluster secret: every call carries the caller's task name and an HMAC-SHA256 of it
//     keyed with the secret, compared in constant time. Without TLS the proof travels in the
//     clear and could be replayed by someone who can read the network (the secret itself
//     cannot be recovered from it): it keeps out whoever can reach the port but not sniff.
// When either is configured, every handler of every service starts with Authenticate(): a call
// without a valid proof (a caller that is not a task of the cluster, a bad or missing proof, a
// certificate naming another task, or another host than the claimed task's) is refused with
// UNAUTHENTICATED before anything is acted on, and the authenticated task is what the handler
// authorizes (CheckCallerIs: PERMISSION_DENIED). (gRPC 1.51 offers no metadata processor on
// insecure server credentials, and a server interceptor cannot fail a call, so the check is the
// handlers' first statement.) Without either, calls carry nothing, the caller is empty and
// everything works as before.
#ifndef TENSORVERBS_RPC_SECURITY_H_
#define TENSORVERBS_RPC_SECURITY_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tensorverbs::rpc {

struct SecurityOptions {
  // Mutual TLS: PEM files of this task's certificate (chain), its private key and the CA that
  // signs every task's certificate (TENSORVERBS_TLS_CERT, TENSORVERBS_TLS_KEY,
  // TENSORVERBS_TLS_CA). All three or none.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  // A file holding the cluster secret (TENSORVERBS_SECRET_FILE): at least 16 bytes, readable
  // by its owner only; surrounding whitespace is ignored.
  std::string secret_file;

  bool tls() const;
  bool enabled() const { return tls() || !secret_file.empty(); }
};

class RpcSecurity {
 public:
  // Reads the files named in `options` for task `own_task` of a cluster whose tasks and their
  // addresses ("host:port") are `cluster_tasks`. Errors name the file, the setting and what to
  // do.
  static absl::StatusOr<std::shared_ptr<const RpcSecurity>> Create(
      const SecurityOptions& options, std::string own_task,
      absl::flat_hash_map<std::string, std::string> cluster_tasks);
  // Calls nothing and checks nothing (no security configured): for tools and tests.
  static std::shared_ptr<const RpcSecurity> Insecure();

  bool enabled() const { return tls_ || !secret_.empty(); }
  bool tls() const { return tls_; }
  // "mutual TLS and cluster secret", "mutual TLS", "cluster secret" or "none": for logs.
  std::string Describe() const;

  // The credentials a server of this task listens with (TLS when configured).
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // A channel to `address` that proves this task on every call.
  std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                            const grpc::ChannelArguments& args) const;

  // Checks a call's claim and proof. OK with `caller` set to the task it came from (empty when
  // security is off), or UNAUTHENTICATED saying why.
  grpc::Status Authenticate(const grpc::ServerContextBase& context, std::string* caller) const;
  // PERMISSION_DENIED naming the caller, unless security is off (no caller) or the caller is
  // `task`.
  static grpc::Status CheckCallerIs(absl::string_view caller, absl::string_view task,
                                    absl::string_view what);

  // The proof of `task` under `secret` (hex HMAC-SHA256).
  static std::string Proof(absl::string_view secret, absl::string_view task);

  // Metadata keys of the caller's claim and proof.
  static constexpr char kTaskKey[] = "tensorverbs-task";
  static constexpr char kProofKey[] = "tensorverbs-proof";

  RpcSecurity(std::string own_task, absl::flat_hash_map<std::string, std::string> task_hosts,
              std::string secret, bool tls, std::string cert, std::string key, std::string ca);

 private:
  const std::string own_task_;
  // Each task of the cluster and the host its address names.
  const absl::flat_hash_map<std::string, std::string> task_hosts_;
  const std::string secret_;
  const bool tls_;
  const std::string cert_pem_;
  const std::string key_pem_;
  const std::string ca_pem_;
  const std::string own_proof_;
};

}  // namespace tensorverbs::rpc

#endif  // TENSORVERBS_RPC_SECURITY_H_

#include "src/rpc/security.h"

#include <grpcpp/support/client_interceptor.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "src/common/logging.h"

namespace tensorverbs::rpc {
namespace {

constexpr size_t kMinSecretBytes = 16;
// Longer claims are not task names; they are refused without being echoed whole.
constexpr size_t kMaxClaimBytes = 512;

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view setting) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(setting, ": cannot read '", path, "': ", std::strerror(errno)));
  }
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

std::string Printable(absl::string_view claim) { return absl::CHexEscape(claim.substr(0, 128)); }

// The host of a "host:port" or "[v6 address]:port" address.
std::string HostOf(absl::string_view address) {
  if (absl::ConsumePrefix(&address, "[")) return std::string(address.substr(0, address.find(']')));
  const size_t colon = address.rfind(':');
  return std::string(colon == absl::string_view::npos ? address : address.substr(0, colon));
}

grpc::Status Unauthenticated(absl::string_view why) {
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(why));
}

// Adds this task's claim and proof to every call of a channel.
class ProofInterceptor final : public grpc::experimental::Interceptor {
 public:
  ProofInterceptor(const std::string* task, const std::string* proof)
      : task_(task), proof_(proof) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* metadata = methods->GetSendInitialMetadata();
      metadata->emplace(RpcSecurity::kTaskKey, *task_);
      if (!proof_->empty()) metadata->emplace(RpcSecurity::kProofKey, *proof_);
    }
    methods->Proceed();
  }

 private:
  const std::string* const task_;
  const std::string* const proof_;
};

class ProofInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  // Owned by the channel, which every call (and so every interceptor) holds alive.
  ProofInterceptorFactory(std::string task, std::string proof)
      : task_(std::move(task)), proof_(std::move(proof)) {}

  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo* /*info*/) override {
    return new ProofInterceptor(&task_, &proof_);
  }

 private:
  const std::string task_;
  const std::string proof_;
};

}  // namespace

bool SecurityOptions::tls() const {
  return !tls_cert_file.empty() || !tls_key_file.empty() || !tls_ca_file.empty();
}

RpcSecurity::RpcSecurity(std::string own_task,
                         absl::flat_hash_map<std::string, std::string> task_hosts,
                         std::string secret, bool tls, std::string cert, std::string key,
                         std::string ca)
    : own_task_(std::move(own_task)),
      task_hosts_(std::move(task_hosts)),
      secret_(std::move(secret)),
      tls_(tls),
      cert_pem_(std::move(cert)),
      key_pem_(std::move(key)),
      ca_pem_(std::move(ca)),
      own_proof_(secret_.empty() ? std::string() : Proof(secret_, own_task_)) {}

absl::StatusOr<std::shared_ptr<const RpcSecurity>> RpcSecurity::Create(
    const SecurityOptions& options, std::string own_task,
    absl::flat_hash_map<std::string, std::string> cluster_tasks) {
  absl::flat_hash_map<std::string, std::string> task_hosts;
  for (auto& [task, address] : cluster_tasks) task_hosts[task] = HostOf(address);
  std::string secret, cert, key, ca;
  if (!options.secret_file.empty()) {
    absl::StatusOr<std::string> contents = ReadFile(options.secret_file, "TENSORVERBS_SECRET_FILE");
    if (!contents.ok()) return contents.status();
    secret = std::string(absl::StripAsciiWhitespace(*contents));
    if (secret.size() < kMinSecretBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("TENSORVERBS_SECRET_FILE: '", options.secret_file, "' holds ", secret.size(),
                       " bytes; a cluster secret needs at least ", kMinSecretBytes,
                       " (for example: openssl rand -hex 32 > FILE)"));
    }
    struct stat st;
    if (::stat(options.secret_file.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
      LOG(WARNING) << "TENSORVERBS_SECRET_FILE '" << options.secret_file
                   << "' can be read by other users of this host; chmod 600 it";
    }
  }
  if (options.tls()) {
    if (options.tls_cert_file.empty() || options.tls_key_file.empty() ||
        options.tls_ca_file.empty()) {
      return absl::InvalidArgumentError(
          "mutual TLS needs all of TENSORVERBS_TLS_CERT (this task's certificate), "
          "TENSORVERBS_TLS_KEY (its private key) and TENSORVERBS_TLS_CA (the cluster's CA)");
    }
    absl::StatusOr<std::string> c = ReadFile(options.tls_cert_file, "TENSORVERBS_TLS_CERT");
    if (!c.ok()) return c.status();
    absl::StatusOr<std::string> k = ReadFile(options.tls_key_file, "TENSORVERBS_TLS_KEY");
    if (!k.ok()) return k.status();
    absl::StatusOr<std::string> a = ReadFile(options.tls_ca_file, "TENSORVERBS_TLS_CA");
    if (!a.ok()) return a.status();
    for (const auto& [setting, pem] :
         {std::pair{"TENSORVERBS_TLS_CERT", &*c}, std::pair{"TENSORVERBS_TLS_KEY", &*k},
          std::pair{"TENSORVERBS_TLS_CA", &*a}}) {
      if (pem->find("-----BEGIN ") == std::string::npos) {
        return absl::InvalidArgumentError(
            absl::StrCat(setting, ": the file is not in PEM format (no '-----BEGIN' line)"));
      }
    }
    cert = *std::move(c);
    key = *std::move(k);
    ca = *std::move(a);
  }
  return std::make_shared<const RpcSecurity>(std::move(own_task), std::move(task_hosts),
                                             std::move(secret), options.tls(), std::move(cert),
                                             std::move(key), std::move(ca));
}

std::shared_ptr<const RpcSecurity> RpcSecurity::Insecure() {
  static const auto* insecure =
      new std::shared_ptr<const RpcSecurity>(std::make_shared<const RpcSecurity>(
          "", absl::flat_hash_map<std::string, std::string>(), "", false, "", "", ""));
  return *insecure;
}

std::string RpcSecurity::Describe() const {
  if (tls_ && !secret_.empty()) return "mutual TLS and cluster secret";
  if (tls_) return "mutual TLS";
  if (!secret_.empty()) return "cluster secret";
  return "none";
}

std::shared_ptr<grpc::ServerCredentials> RpcSecurity::ServerCredentials() const {
  if (!tls_) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_pem_;
  options.pem_key_cert_pairs.push_back({key_pem_, cert_pem_});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::Channel> RpcSecurity::NewChannel(const std::string& address,
                                                       const grpc::ChannelArguments& args) const {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (tls_) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = ca_pem_;
    options.pem_private_key = key_pem_;
    options.pem_cert_chain = cert_pem_;
    credentials = grpc::SslCredentials(options);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  if (!enabled()) return grpc::CreateCustomChannel(address, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<ProofInterceptorFactory>(own_task_, own_proof_));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

grpc::Status RpcSecurity::Authenticate(const grpc::ServerContextBase& context,
                                       std::string* caller) const {
  caller->clear();
  if (!enabled()) return grpc::Status::OK;
  const std::multimap<grpc::string_ref, grpc::string_ref>& metadata = context.client_metadata();
  auto claim_it = metadata.find(kTaskKey);
  if (claim_it == metadata.end()) {
    return Unauthenticated(
        absl::StrCat("task ", own_task_,
                     " accepts calls only from tasks of its cluster, and this call names "
                     "none; configure the caller with the cluster's TENSORVERBS_SECRET_FILE / "
                     "TENSORVERBS_TLS_* settings"));
  }
  const absl::string_view claim(claim_it->second.data(), claim_it->second.size());
  auto host_it = claim.size() > kMaxClaimBytes ? task_hosts_.end() : task_hosts_.find(claim);
  if (host_it == task_hosts_.end()) {
    return Unauthenticated(absl::StrCat("task ", own_task_, ": '", Printable(claim),
                                        "' is not a task of this cluster"));
  }
  if (!secret_.empty()) {
    auto proof_it = metadata.find(kProofKey);
    const std::string expected = Proof(secret_, claim);
    if (proof_it == metadata.end() || proof_it->second.size() != expected.size() ||
        CRYPTO_memcmp(proof_it->second.data(), expected.data(), expected.size()) != 0) {
      return Unauthenticated(
          absl::StrCat("task ", own_task_, ": the call from ", claim,
                       " does not prove the cluster secret; check that both tasks read the same "
                       "TENSORVERBS_SECRET_FILE"));
    }
  }
  if (tls_) {
    // gRPC verified the certificate chain during the handshake; what is left is whom the
    // certificate speaks for. One that names a task (its common name) speaks for that task
    // only. Otherwise it is a host's, shared by the tasks that run there, and speaks for a task
    // whose address names a host the certificate names (common name or subject alternative
    // name): a host's key lets no one act as a task of another host.
    std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    if (auth == nullptr || !auth->IsPeerAuthenticated()) {
      return Unauthenticated(absl::StrCat("task ", own_task_, ": the call from ", claim,
                                          " presented no verified certificate"));
    }
    std::vector<std::string> names;
    for (const char* property : {"x509_common_name", "x509_subject_alternative_name"}) {
      for (const grpc::string_ref& name : auth->FindPropertyValues(property)) {
        names.emplace_back(name.data(), name.size());
      }
    }
    bool names_a_task = false;
    bool names_the_claim = false;
    bool names_its_host = false;
    for (const std::string& name : names) {
      names_a_task |= task_hosts_.contains(name);
      names_the_claim |= name == claim;
      names_its_host |= name == host_it->second;
    }
    const std::string named = names.empty() ? std::string("no name") : absl::StrJoin(names, ", ");
    if (names_a_task && !names_the_claim) {
      return Unauthenticated(absl::StrCat("task ", own_task_, ": a call claiming to be ", claim,
                                          " presented the certificate of ", named,
                                          ", which speaks only for the task it names"));
    }
    if (!names_a_task && !names_its_host) {
      return Unauthenticated(absl::StrCat(
          "task ", own_task_, ": a call claiming to be ", claim, " presented a certificate for ",
          named, ", which names neither that task nor its host ", host_it->second));
    }
  }
  *caller = std::string(claim);
  return grpc::Status::OK;
}

grpc::Status RpcSecurity::CheckCallerIs(absl::string_view caller, absl::string_view task,
                                        absl::string_view what) {
  if (caller.empty() || caller == task) return grpc::Status::OK;
  return grpc::Status(
      grpc::StatusCode::PERMISSION_DENIED,
      absl::StrCat("task ", caller, " may not ", what, ": that is for task ", Printable(task)));
}

std::string RpcSecurity::Proof(absl::string_view secret, absl::string_view task) {
  const std::string message = absl::StrCat("tensorverbs cluster proof v1\n", task);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), digest, &length);
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length));
}

}  // namespace tensorverbs::rpc

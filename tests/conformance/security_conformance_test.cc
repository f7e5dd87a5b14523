// Authentication and authorization of the calls between tasks (rpc/security.h), for every
// protocol: a cluster secured with a secret or mutual TLS works, and every RPC of every service
// from anyone else is refused before a handler acts on it; a member asking for what belongs to
// another task is refused too.
#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "proto/verbs.grpc.pb.h"
#include "proto/worker.grpc.pb.h"
#include "src/rpc/security.h"
#include "src/server/server.h"
#include "tensorverbs/placement.h"
#include "tests/support/inprocess_cluster.h"
#include "tests/support/temp_dir.h"

namespace tensorverbs {
namespace {

using rpc::RpcSecurity;
using ::testing::HasSubstr;

constexpr char kTask0[] = "/job:worker/replica:0/task:0";
constexpr char kTask1[] = "/job:worker/replica:0/task:1";

void WriteFile(const std::string& path, const std::string& contents, mode_t mode = 0600) {
  std::ofstream(path, std::ios::binary) << contents;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0) << path;
}

bool OnVerbs(const std::string& protocol) { return protocol != "grpc"; }

// How a hand-written client presents itself: nothing, or a task's claim with a proof made
// from some secret.
struct Claim {
  std::string task;
  std::string secret;
};

class Caller {
 public:
  Caller(const std::string& address, Claim claim,
         std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials())
      : claim_(std::move(claim)),
        channel_(grpc::CreateChannel(address, std::move(credentials))),
        worker_(proto::WorkerService::NewStub(channel_)),
        verbs_(proto::VerbsService::NewStub(channel_)) {}

  // Every RPC of every service, by name, with a request a real task would send as `task`.
  std::vector<std::pair<std::string, grpc::Status>> CallEverything(const std::string& recv_key) {
    std::vector<std::pair<std::string, grpc::Status>> out;
    {
      grpc::ClientContext c;
      Prepare(&c);
      proto::GetStatusResponse r;
      out.emplace_back("GetStatus", worker_->GetStatus(&c, proto::GetStatusRequest(), &r));
    }
    out.emplace_back("RecvTensor", RecvTensor(recv_key));
    {
      grpc::ClientContext c;
      Prepare(&c);
      proto::GetStatsResponse r;
      out.emplace_back("GetStats", worker_->GetStats(&c, proto::GetStatsRequest(), &r));
    }
    {
      grpc::ClientContext c;
      Prepare(&c);
      proto::CleanupStepRequest q;
      q.set_step_id(3);
      proto::CleanupStepResponse r;
      out.emplace_back("CleanupStep", worker_->CleanupStep(&c, q, &r));
    }
    out.emplace_back("Connect", Connect(claim_.task.empty() ? kTask1 : claim_.task));
    {
      grpc::ClientContext c;
      Prepare(&c);
      proto::CheckChannelRequest q;
      q.set_task_name(claim_.task.empty() ? kTask1 : claim_.task);
      proto::CheckChannelResponse r;
      out.emplace_back("CheckChannel", verbs_->CheckChannel(&c, q, &r));
    }
    return out;
  }

  grpc::Status RecvTensor(const std::string& key, bool dma_ok = false,
                          const std::string& requester = "") {
    grpc::ClientContext c;
    Prepare(&c);
    proto::RecvTensorRequest q;
    q.set_step_id(1);
    q.set_rendezvous_key(key);
    q.set_dma_ok(dma_ok);
    q.set_requester(requester);
    proto::RecvTensorResponse r;
    return worker_->RecvTensor(&c, q, &r);
  }

  grpc::Status Connect(const std::string& as_task) {
    grpc::ClientContext c;
    Prepare(&c);
    proto::ConnectRequest q;
    q.set_task_name(as_task);
    q.set_incarnation(1);
    proto::ConnectResponse r;
    return verbs_->Connect(&c, q, &r);
  }

 private:
  void Prepare(grpc::ClientContext* c) const {
    c->set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!claim_.task.empty()) c->AddMetadata(RpcSecurity::kTaskKey, claim_.task);
    if (!claim_.secret.empty()) {
      c->AddMetadata(RpcSecurity::kProofKey, RpcSecurity::Proof(claim_.secret, claim_.task));
    }
  }

  const Claim claim_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<proto::WorkerService::Stub> worker_;
  std::unique_ptr<proto::VerbsService::Stub> verbs_;
};

class SecurityTest : public testing::ClusterTest<std::string> {
 protected:
  const std::string& protocol() const { return GetParam(); }

  void StartSecured(int n, const rpc::SecurityOptions& security,
                    std::function<rpc::SecurityOptions(int)> per_task = nullptr) {
    testing::ClusterOptions o;
    o.protocol = protocol();
    o.fabric = "loopback";
    o.recv_timeout = absl::Seconds(20);
    o.security = security;
    o.security_for = std::move(per_task);
    StartWith(n, o);
  }

  std::string Address(int task) { return *server(task).cluster().TaskAddress("worker", task); }

  // Task 1 sends `name` to task 0 at `step`; it arrives whole.
  void ExpectTransfer(int64_t step, const std::string& name) {
    const Tensor t = PoolTensor(1, DataType::kFloat32, {4096}, 3);
    ASSERT_TRUE(Step(1, step)->Send(Key(1, name), t).ok());
    PendingRecv recv(*Step(0, step), Key(1, name));
    ASSERT_TRUE(recv.Wait());
    ASSERT_TRUE(recv.status().ok()) << recv.status();
    EXPECT_TRUE(recv.tensor().ContentEquals(t));
  }

  // Every RPC `caller` makes to task 1 is refused with `code`, and task 1 still serves.
  void ExpectEverythingRefused(Caller& caller, grpc::StatusCode code, const std::string& why) {
    for (const auto& [method, status] : caller.CallEverything(Key(1, "secret").full_key)) {
      if (!OnVerbs(protocol()) && (method == "Connect" || method == "CheckChannel")) {
        // Only the protocol in use is served.
        EXPECT_EQ(status.error_code(), grpc::StatusCode::UNIMPLEMENTED) << method;
        continue;
      }
      EXPECT_EQ(status.error_code(), code) << method << ": " << status.error_message();
      EXPECT_THAT(status.error_message(), HasSubstr(why)) << method;
    }
  }

  testing::ScopedTempDir dir_;
};

TEST_P(SecurityTest, ASecretKeepsOutEveryCallWithoutItsProof) {
  const std::string secret = "a cluster secret of some length";
  WriteFile(dir_.File("secret"), secret + "\n");
  rpc::SecurityOptions security;
  security.secret_file = dir_.File("secret");
  StartSecured(2, security);
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(1, "weights"));

  // No claim, a stranger's claim, a member's claim with the wrong proof or none.
  Caller anonymous(Address(1), {});
  ExpectEverythingRefused(anonymous, grpc::StatusCode::UNAUTHENTICATED, "names none");
  Caller stranger(Address(1), {"/job:intruder/replica:0/task:0", secret});
  ExpectEverythingRefused(stranger, grpc::StatusCode::UNAUTHENTICATED,
                          "is not a task of this cluster");
  Caller guesser(Address(1), {kTask0, "not the cluster secret"});
  ExpectEverythingRefused(guesser, grpc::StatusCode::UNAUTHENTICATED, "TENSORVERBS_SECRET_FILE");
  Caller unproven(Address(1), {kTask0, ""});
  ExpectEverythingRefused(unproven, grpc::StatusCode::UNAUTHENTICATED, "does not prove");

  // A member may ask only for what is its own.
  Caller member(Address(1), {kTask0, secret});
  proto::GetStatusResponse status;
  {
    grpc::ClientContext c;
    c.AddMetadata(RpcSecurity::kTaskKey, kTask0);
    c.AddMetadata(RpcSecurity::kProofKey, RpcSecurity::Proof(secret, kTask0));
    auto stub = proto::WorkerService::NewStub(
        grpc::CreateChannel(Address(1), grpc::InsecureChannelCredentials()));
    EXPECT_TRUE(stub->GetStatus(&c, proto::GetStatusRequest(), &status).ok());
  }
  if (!OnVerbs(protocol()) || protocol() == "grpc+gdr") {
    // A key sent from task 1 to task 1 (or to any task but the caller) is not the caller's.
    const std::string others = Key(1, "for-task-1", 1).full_key;
    grpc::Status s = member.RecvTensor(others);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(kTask0));
    if (protocol() == "grpc+gdr") {
      s = member.RecvTensor(Key(1, "lent", 0).full_key, /*dma_ok=*/true, kTask1);
      EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    }
  } else {
    // Only the protocol in use is served: these tasks receive over their channels.
    grpc::Status s = member.RecvTensor(Key(1, "any", 0).full_key);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();
  }
  if (OnVerbs(protocol())) {
    grpc::Status s = member.Connect(kTask1);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  // None of it disturbed the cluster.
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(2, "weights"));
}

TEST_P(SecurityTest, ATaskWithAnotherSecretCannotJoin) {
  WriteFile(dir_.File("secret-a"), "the first cluster's secret");
  WriteFile(dir_.File("secret-b"), "the second cluster's secret");
  StartSecured(2, {}, [this](int task) {
    rpc::SecurityOptions s;
    s.secret_file = dir_.File(task == 0 ? "secret-a" : "secret-b");
    return s;
  });
  absl::Status s = server(0).WaitForPeers(absl::Seconds(3));
  EXPECT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("secret")) << s;
}

TEST_P(SecurityTest, BadSecuritySettingsFailStartWithTheSettingNamed) {
  testing::ClusterOptions o;
  o.protocol = protocol();
  o.fabric = "loopback";
  WriteFile(dir_.File("short"), "short\n");
  o.security.secret_file = dir_.File("short");
  absl::Status s = cluster_.Start(1, o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("at least 16"));
  o.security.secret_file = dir_.File("missing");
  s = cluster_.Start(1, o);
  EXPECT_THAT(std::string(s.message()), HasSubstr("TENSORVERBS_SECRET_FILE")) << s;
  o.security = {};
  o.security.tls_cert_file = dir_.File("short");
  s = cluster_.Start(1, o);
  EXPECT_THAT(std::string(s.message()), HasSubstr("TENSORVERBS_TLS_KEY")) << s;
  o.security.tls_key_file = o.security.tls_ca_file = dir_.File("short");
  s = cluster_.Start(1, o);
  EXPECT_THAT(std::string(s.message()), HasSubstr("PEM")) << s;
}

// Mutual TLS with a CA and a certificate per task made by openssl: the cluster works, a client
// without a certificate or with another CA's cannot even connect, and a task's certificate
// cannot claim to be another task.
class TlsTest : public SecurityTest {
 protected:
  void SetUp() override {
    if (std::system("command -v openssl > /dev/null 2>&1") != 0) {
      GTEST_SKIP() << "the openssl tool is not installed (scripts/install-deps.sh installs it)";
    }
    ASSERT_NO_FATAL_FAILURE(MakeCa("ca"));
    ASSERT_NO_FATAL_FAILURE(MakeCa("other-ca"));
    ASSERT_NO_FATAL_FAILURE(MakeCert("ca", "task0", kTask0));
    ASSERT_NO_FATAL_FAILURE(MakeCert("ca", "task1", kTask1));
    ASSERT_NO_FATAL_FAILURE(MakeCert("other-ca", "rogue", kTask0));
  }

  void Run(const std::string& script) {
    const std::string command =
        absl::StrCat("cd '", dir_.path(), "' && { ", script, " ; } > openssl.log 2>&1");
    ASSERT_EQ(std::system(command.c_str()), 0) << script;
  }
  void MakeCa(const std::string& name) {
    Run(absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ",
                     "-keyout ", name, ".key -out ", name, ".pem -days 2 -subj '/CN=", name, "'"));
  }
  void MakeCert(const std::string& ca, const std::string& name, const std::string& common_name,
                const std::string& alt_names = "IP:127.0.0.1,DNS:localhost") {
    WriteFile(dir_.File(name + ".cnf"),
              absl::StrCat("[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = ", common_name,
                           "\n[ext]\nsubjectAltName = ", alt_names, "\n"));
    Run(absl::StrCat("openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes ",
                     "-keyout ", name, ".key -out ", name, ".csr -config ", name, ".cnf && ",
                     "openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ", ca,
                     ".key -set_serial 7 -days 2 -out ", name, ".pem -extfile ", name,
                     ".cnf -extensions ext"));
  }
  rpc::SecurityOptions Tls(const std::string& name) {
    rpc::SecurityOptions s;
    s.tls_cert_file = dir_.File(name + ".pem");
    s.tls_key_file = dir_.File(name + ".key");
    s.tls_ca_file = dir_.File("ca.pem");
    return s;
  }
  std::shared_ptr<grpc::ChannelCredentials> ClientTls(const std::string& name,
                                                      const std::string& ca = "ca") {
    auto read = [this](const std::string& f) {
      std::ifstream in(dir_.File(f));
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = read(ca + ".pem");
    if (!name.empty()) {
      o.pem_private_key = read(name + ".key");
      o.pem_cert_chain = read(name + ".pem");
    }
    return grpc::SslCredentials(o);
  }
};

TEST_P(TlsTest, MutualTlsClustersWorkAndNoOneElseGetsIn) {
  StartSecured(2, {}, [this](int task) { return Tls(task == 0 ? "task0" : "task1"); });
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(1, "weights"));

  // Plaintext, no client certificate, another CA's certificate: no connection at all.
  const std::vector<std::shared_ptr<grpc::ChannelCredentials>> outsiders = {
      grpc::InsecureChannelCredentials(), ClientTls(""), ClientTls("rogue", "other-ca")};
  for (const auto& credentials : outsiders) {
    Caller outsider(Address(1), {kTask0, ""}, credentials);
    for (const auto& [method, status] : outsider.CallEverything(Key(1, "x").full_key)) {
      EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
          << method << ": " << status.error_message();
    }
  }
  // Task 0's certificate speaks for task 0 only.
  Caller impostor(Address(1), {kTask1, ""}, ClientTls("task0"));
  ExpectEverythingRefused(impostor, grpc::StatusCode::UNAUTHENTICATED, "certificate of");
  Caller honest(Address(1), {kTask0, ""}, ClientTls("task0"));
  grpc::Status s = honest.Connect(kTask1);
  if (OnVerbs(protocol())) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  }
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(2, "weights"));
}

// A certificate that names no task is a host's: it speaks for the tasks whose address names
// that host (here every task is on 127.0.0.1) and for no task elsewhere.
TEST_P(TlsTest, AHostsCertificateSpeaksForTheTasksOnThatHostOnly) {
  ASSERT_NO_FATAL_FAILURE(MakeCert("ca", "host", "worker host"));
  ASSERT_NO_FATAL_FAILURE(MakeCert("ca", "elsewhere", "elsewhere", "DNS:elsewhere.example"));
  StartSecured(2, {}, [this](int) { return Tls("host"); });
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(1, "weights"));
  Caller elsewhere(Address(1), {kTask0, ""}, ClientTls("elsewhere"));
  ExpectEverythingRefused(elsewhere, grpc::StatusCode::UNAUTHENTICATED,
                          "names neither that task nor its host 127.0.0.1");
}

TEST_P(TlsTest, TlsAndASecretTogether) {
  WriteFile(dir_.File("secret"), "a cluster secret of some length");
  StartSecured(2, {}, [this](int task) {
    rpc::SecurityOptions s = Tls(task == 0 ? "task0" : "task1");
    s.secret_file = dir_.File("secret");
    return s;
  });
  ASSERT_TRUE(server(0).WaitForPeers(absl::Seconds(30)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectTransfer(1, "weights"));
  Caller no_secret(Address(1), {kTask0, ""}, ClientTls("task0"));
  ExpectEverythingRefused(no_secret, grpc::StatusCode::UNAUTHENTICATED, "does not prove");
}

TEST(RpcSecurity, ProofsDependOnTheSecretAndTheTask) {
  const std::string a = RpcSecurity::Proof("secret one", kTask0);
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a, RpcSecurity::Proof("secret one", kTask0));
  EXPECT_NE(a, RpcSecurity::Proof("secret two", kTask0));
  EXPECT_NE(a, RpcSecurity::Proof("secret one", kTask1));
  EXPECT_FALSE(RpcSecurity::Insecure()->enabled());
  EXPECT_EQ(RpcSecurity::Insecure()->Describe(), "none");
}

// A task without security that listens beyond loopback says so once per process, however many
// tasks it runs; one with a secret, or one on loopback only, does not.
TEST(SecurityWarningTest, AnUnsecuredTaskListeningBeyondLoopbackWarnsOncePerProcess) {
  testing::ScopedTempDir dir;
  WriteFile(dir.File("secret"), "a cluster secret of some length");
  absl::StatusOr<std::vector<int>> ports = PickFreePorts(4);
  ASSERT_TRUE(ports.ok()) << ports.status();
  std::string spec = "worker=";
  for (int i = 0; i < 4; ++i) absl::StrAppend(&spec, i ? "," : "", "127.0.0.1:", (*ports)[i]);
  absl::StatusOr<ClusterSpec> cluster = ClusterSpec::Parse(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto start = [&](int task, bool everywhere, bool secured) {
    ServerOptions options;
    options.cluster = *cluster;
    options.job = "worker";
    options.task = task;
    options.protocol = "grpc";
    if (everywhere) options.listen_address = absl::StrCat("0.0.0.0:", (*ports)[task]);
    if (secured) options.security.secret_file = dir.File("secret");
    return Server::Create(options);
  };
  constexpr char kWarning[] = "without authentication";
  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<Server>> secured = start(0, true, true);
  absl::StatusOr<std::unique_ptr<Server>> loopback = start(1, false, false);
  const std::string quiet = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(secured.ok()) << secured.status();
  ASSERT_TRUE(loopback.ok()) << loopback.status();
  EXPECT_THAT(quiet, ::testing::Not(HasSubstr(kWarning)));

  ::testing::internal::CaptureStderr();
  absl::StatusOr<std::unique_ptr<Server>> open_a = start(2, true, false);
  absl::StatusOr<std::unique_ptr<Server>> open_b = start(3, true, false);
  const std::string warned = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(open_a.ok()) << open_a.status();
  ASSERT_TRUE(open_b.ok()) << open_b.status();
  size_t count = 0;
  for (size_t at = warned.find(kWarning); at != std::string::npos;
       at = warned.find(kWarning, at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u) << warned;
  EXPECT_THAT(warned, HasSubstr(absl::StrCat("0.0.0.0:", (*ports)[2])));
  EXPECT_THAT(warned, HasSubstr("TENSORVERBS_SECRET_FILE"));
}

std::string ParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name;
  for (char c : info.param) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  return name;
}

INSTANTIATE_TEST_SUITE_P(Protocols, SecurityTest,
                         ::testing::Values("grpc", "grpc+verbs", "grpc+verbs-copy", "grpc+gdr"),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Protocols, TlsTest, ::testing::Values("grpc", "grpc+verbs", "grpc+gdr"),
                         ParamName);

}  // namespace
}  // namespace tensorverbs

#include "absl/strings/str_cat.h"
#include "src/common/config.h"
#include "src/common/settings.h"

// The rows of the seed's RDMA variables (the ibverbs backend's), in a room of their own.
namespace tensorverbs::settings_internal {

void AddRdmaSettings(std::vector<Setting>& s) {
  using K = SettingKind;
  auto rdma = [&s](Setting setting) {
    setting.table = SettingTable::kRdma;
    s.push_back(std::move(setting));
  };
  rdma({.variable = "RDMA_DEVICE",
        .kind = K::kText,
        .help = "RDMA device, e.g. `mlx5_0`; several, comma-separated, in order of preference",
        .values = "device names",
        .default_note = "the active port nearest the task's NUMA node",
        .set_text = [](Config& c, const std::string& v) { c.rdma.device = v; },
        .get = [](const Config& c) { return c.rdma.device; }});
  rdma({.variable = "RDMA_DEVICE_PORT",
        .kind = K::kInteger,
        .min = 1,
        .max = 255,
        .help = "port of that device",
        .default_note = "the nearest active port",
        .set_int = [](Config& c, int64_t v) { c.rdma.port = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.port); }});
  rdma({.variable = "RDMA_GID_INDEX",
        .kind = K::kInteger,
        .min = 0,
        .max = 255,
        .help = "GID index",
        .default_note = "RoCEv2 with an IPv4 address, then RoCEv2, RoCEv1, IB",
        .set_int = [](Config& c, int64_t v) { c.rdma.gid_index = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.gid_index); }});
  rdma({.variable = "RDMA_QP_PKEY_INDEX",
        .alias = "RDMA_PKEY",
        .kind = K::kInteger,
        .min = 0,
        .max = 65535,
        .help = "P_Key index",
        .set_int = [](Config& c, int64_t v) { c.rdma.pkey_index = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.pkey_index); }});
  rdma({.variable = "RDMA_QP_QUEUE_DEPTH",
        .alias = "RDMA_QUEUE_DEPTH",
        .kind = K::kInteger,
        .min = 1,
        .max = 65536,
        .help = "send/receive queue depth",
        .set_int = [](Config& c, int64_t v) { c.rdma.queue_depth = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.queue_depth); }});
  rdma({.variable = "RDMA_QP_TIMEOUT",
        .alias = "RDMA_TIMEOUT",
        .kind = K::kInteger,
        .min = 0,
        .max = 31,
        .help = "retransmission timeout exponent (4.096 µs × 2^t)",
        .set_int = [](Config& c, int64_t v) { c.rdma.timeout = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.timeout); }});
  rdma({.variable = "RDMA_QP_RETRY_COUNT",
        .alias = "RDMA_RETRY_CNT",
        .kind = K::kInteger,
        .min = 0,
        .max = 7,
        .help = "retransmissions",
        .set_int = [](Config& c, int64_t v) { c.rdma.retry_count = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.retry_count); }});
  rdma({.variable = "RDMA_QP_SL",
        .alias = "RDMA_SL",
        .kind = K::kInteger,
        .min = 0,
        .max = 7,
        .help = "service level",
        .set_int = [](Config& c, int64_t v) { c.rdma.sl = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.sl); }});
  rdma({.variable = "RDMA_QP_MTU",
        .alias = "RDMA_MTU",
        .kind = K::kInteger,
        .min = 256,
        .max = 4096,
        .help = "path MTU, at most the port's active MTU (equal is fine)",
        .values = "256, 512, 1024, 2048, 4096",
        .default_note = "the active MTU",
        .check = [](int64_t v) -> const char* {
          return v == 256 || v == 512 || v == 1024 || v == 2048 || v == 4096
                     ? nullptr
                     : "expected 256, 512, 1024, 2048 or 4096";
        },
        .set_int = [](Config& c, int64_t v) { c.rdma.mtu = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.mtu); }});
  rdma({.variable = "RDMA_TRAFFIC_CLASS",
        .kind = K::kInteger,
        .min = 0,
        .max = 255,
        .help = "traffic class for DSCP QoS",
        .set_int = [](Config& c, int64_t v) { c.rdma.traffic_class = static_cast<int>(v); },
        .get = [](const Config& c) { return absl::StrCat(c.rdma.traffic_class); }});
}

}  // namespace tensorverbs::settings_internal

// ReadInventory against the real libibverbs (which finds no device on hosts without RDMA) and,
// through -Wl,--wrap, against fakes for the answers such a host cannot give.
#include "src/fabric/ibverbs/inventory.h"

#include <infiniband/verbs.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>

extern "C" {
ibv_device** __real_ibv_get_device_list(int* num);
void __real_ibv_free_device_list(ibv_device** list);
ibv_context* __real_ibv_open_device(ibv_device* device);
}

namespace {

enum class Mode { kReal, kEnosys, kEmpty, kUnopenable };
Mode mode = Mode::kReal;
ibv_device fake_device;
ibv_device* fake_list[2] = {&fake_device, nullptr};

}  // namespace

extern "C" {
ibv_device** __wrap_ibv_get_device_list(int* num) {
  switch (mode) {
    case Mode::kReal:
      return __real_ibv_get_device_list(num);
    case Mode::kEnosys:
      errno = ENOSYS;
      return nullptr;
    case Mode::kEmpty:
      *num = 0;
      return fake_list + 1;
    case Mode::kUnopenable:
      std::strcpy(fake_device.name, "fake_0");
      *num = 1;
      return fake_list;
  }
  return nullptr;
}
void __wrap_ibv_free_device_list(ibv_device** list) {
  if (mode == Mode::kReal) __real_ibv_free_device_list(list);
}
ibv_context* __wrap_ibv_open_device(ibv_device* device) {
  if (mode == Mode::kReal) return __real_ibv_open_device(device);
  errno = EACCES;
  return nullptr;
}
}

namespace tensorverbs::fabric::ibverbs {
namespace {

using ::testing::HasSubstr;

class InventoryTest : public ::testing::Test {
 protected:
  void TearDown() override { mode = Mode::kReal; }
};

TEST_F(InventoryTest, RealLibraryEitherListsDevicesOrSaysWhyNot) {
  absl::StatusOr<Inventory> inv = ReadInventory();
  if (inv.ok()) {
    for (const DeviceInfo& d : inv->devices) EXPECT_FALSE(d.name.empty());
  } else {
    EXPECT_EQ(inv.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(inv.status().message(), HasSubstr("ibv_get_device_list"));
  }
}

TEST_F(InventoryTest, KernelWithoutRdmaIsUnavailableWithTheReason) {
  mode = Mode::kEnosys;
  absl::StatusOr<Inventory> inv = ReadInventory();
  EXPECT_EQ(inv.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(inv.status().message(), HasSubstr("Function not implemented"));
  EXPECT_THAT(inv.status().message(), HasSubstr("no RDMA support"));
}

TEST_F(InventoryTest, NoDevicesThenSelectionSaysSo) {
  mode = Mode::kEmpty;
  absl::StatusOr<Inventory> inv = ReadInventory();
  ASSERT_TRUE(inv.ok());
  EXPECT_TRUE(inv->devices.empty());
  EXPECT_EQ(SelectDevice(*inv, RdmaConfig()).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(InventoryTest, ADeviceThatCannotBeOpenedIsListedNotFatal) {
  mode = Mode::kUnopenable;
  absl::StatusOr<Inventory> inv = ReadInventory();
  ASSERT_TRUE(inv.ok());
  ASSERT_EQ(inv->devices.size(), 1u);
  EXPECT_EQ(inv->devices[0].name, "fake_0");
  absl::StatusOr<Selection> s = SelectDevice(*inv, RdmaConfig());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.status().message(), HasSubstr("fake_0 port 1: cannot open: Permission denied"));
}

}  // namespace
}  // namespace tensorverbs::fabric::ibverbs

#include "src/common/shared_memory.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

namespace tensorverbs {
namespace {

TEST(SharedMemory, AnotherMappingOfItsDescriptorSeesTheSameBytes) {
  absl::StatusOr<std::unique_ptr<SharedMemory>> m = SharedMemory::Create(10000, "test");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->size() % static_cast<size_t>(sysconf(_SC_PAGESIZE)), 0u) << "whole pages";
  EXPECT_GE((*m)->size(), 10000u);
  auto* p = static_cast<char*>((*m)->data());
  SharedMemory::Location where;
  ASSERT_TRUE(SharedMemory::Find(p + 4096, 100, &where));
  EXPECT_EQ(where.offset, 4096u);
  EXPECT_EQ(where.file_size, (*m)->size());
  EXPECT_NE(where.fd, (*m)->fd()) << "the caller gets its own descriptor";
  void* alias = mmap(nullptr, (*m)->size(), PROT_READ | PROT_WRITE, MAP_SHARED, where.fd, 0);
  ASSERT_NE(alias, MAP_FAILED);
  close(where.fd);
  std::strcpy(static_cast<char*>(alias) + 4096, "written through the alias");
  EXPECT_STREQ(p + 4096, "written through the alias");
  munmap(alias, (*m)->size());
}

TEST(SharedMemory, FindRefusesRangesOutsideEveryMapping) {
  auto m = *SharedMemory::Create(8192, "test");
  auto* p = static_cast<char*>(m->data());
  SharedMemory::Location where;
  EXPECT_FALSE(SharedMemory::Find(p + 4096, 8192, &where)) << "runs past the end";
  EXPECT_FALSE(SharedMemory::Find(p - 1, 1, &where)) << "before the start";
  int on_stack = 0;
  EXPECT_FALSE(SharedMemory::Find(&on_stack, sizeof(on_stack), &where));
  EXPECT_TRUE(SharedMemory::Find(p, 8192, &where));
  close(where.fd);
  m.reset();
  EXPECT_FALSE(SharedMemory::Find(p, 1, &where)) << "gone with its mapping";
}

TEST(SharedMemory, ItsSizeIsSealedAgainstAPeerHoldingTheDescriptor) {
  auto m = *SharedMemory::Create(4096, "test");
  EXPECT_NE(ftruncate(m->fd(), 0), 0) << "shrinking would turn our accesses into SIGBUS";
  EXPECT_NE(ftruncate(m->fd(), 1 << 20), 0);
  const int seals = fcntl(m->fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_TRUE(seals & F_SEAL_SEAL) << "and nobody may loosen the seals";
}

TEST(SharedMemory, EmptyOrAbsurdSizesAreErrors) {
  EXPECT_FALSE(SharedMemory::Create(0, "test").ok());
  EXPECT_FALSE(SharedMemory::Create(size_t{1} << 62, "test").ok());
}

}  // namespace
}  // namespace tensorverbs

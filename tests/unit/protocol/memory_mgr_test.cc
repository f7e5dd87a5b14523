// RdmaMemoryMgr over a loopback domain. "Registered" is checked the way a peer would find out:
// by writing through the region's packed key from another domain.
#include "src/protocol/memory_mgr.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "src/fabric/fabric.h"
#include "src/fabric/loopback/loopback.h"
#include "src/protocol/channel_env.h"
#include "src/tensor/allocator.h"
#include "tensorverbs/tensor.h"

namespace tensorverbs::protocol {
namespace {

using ::testing::HasSubstr;

class MemoryMgrTest : public ::testing::Test {
 protected:
  MemoryMgrTest()
      : domain_(*fabric::OpenDomain("loopback", {})),
        pool_("test pool",
              PoolAllocator::Options{.region_bytes = size_t{2} << 20, .pretouch = false}),
        // A grpc+verbs receiver's memory: remote writes only.
        memory_(std::make_unique<RdmaMemoryMgr>(domain_.get(), &pool_,
                                                RemoteAccessFor(VerbsMode::kZeroCopy))) {
    peer_domain_ = *fabric::OpenDomain("loopback", {});
    target_ = *domain_->CreateEndpoint();
    writer_ = *peer_domain_->CreateEndpoint();
    EXPECT_TRUE(writer_->Connect(target_->LocalAddress()).ok());
    EXPECT_TRUE(target_->Connect(writer_->LocalAddress()).ok());
    source_.resize(256);
    std::iota(source_.begin(), source_.end(), 0);
    source_region_ =
        *peer_domain_->RegisterMemory(source_.data(), source_.size(), fabric::kAccessLocal);
  }

  ~MemoryMgrTest() override {
    // Regions before the pool whose memory they name.
    memory_.reset();
  }

  // Writes `len` (<= 256) bytes of 0, 1, 2, ... from the peer into `dest` through `key`, as a
  // sender would; the result is the post's status (the loopback checks key, range and rights
  // there).
  absl::Status RemoteWrite(const fabric::RemoteKey& key, void* dest, size_t len) {
    return PeerAccess(/*read=*/false, key, dest, len);
  }
  // Reads `len` (<= 256) bytes at `src` from the peer into the source buffer through `key`, as
  // a grpc+gdr reader would; the result is the post's status.
  absl::Status RemoteRead(const fabric::RemoteKey& key, const void* src, size_t len) {
    return PeerAccess(/*read=*/true, key, src, len);
  }

  absl::Status PeerAccess(bool read, const fabric::RemoteKey& key, const void* addr, size_t len) {
    fabric::LocalBuffer local{source_region_.get(), source_.data(), len};
    fabric::RemoteBuffer remote{key, reinterpret_cast<uint64_t>(addr), len};
    absl::Status s = read ? writer_->PostRead(local, remote, /*context=*/2)
                          : writer_->PostWrite(local, remote, /*context=*/1);
    if (s.ok()) {
      fabric::Completion c[4];
      absl::StatusOr<size_t> n = peer_domain_->Poll(absl::MakeSpan(c));
      EXPECT_TRUE(n.ok() && *n == 1);
    }
    return s;
  }

  bool Holds(const void* p, size_t len) { return std::memcmp(p, source_.data(), len) == 0; }

  std::unique_ptr<fabric::Domain> domain_;
  PoolAllocator pool_;
  std::unique_ptr<RdmaMemoryMgr> memory_;
  std::unique_ptr<fabric::Domain> peer_domain_;
  std::unique_ptr<fabric::Endpoint> target_, writer_;
  std::vector<uint8_t> source_;
  std::unique_ptr<fabric::MemoryRegion> source_region_;
};

TEST_F(MemoryMgrTest, APoolRegionIsRegisteredOnceHoweverManyLookups) {
  // A second registration would fail: lookups must reuse the first.
  fabric::loopback::SetFaults(domain_.get(), {.fail_register_nth = 2});
  std::vector<Tensor> tensors;
  for (int i = 0; i < 8; ++i) {
    tensors.push_back(*Tensor::Allocate(&pool_, DataType::kInt32, TensorShape::Of({1000})));
  }
  const fabric::MemoryRegion* first = nullptr;
  for (int round = 0; round < 10; ++round) {
    for (const Tensor& t : tensors) {
      absl::StatusOr<const fabric::MemoryRegion*> r =
          memory_->FindRegistered(t.data(), t.TotalBytes());
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_NE(*r, nullptr);
      if (first == nullptr) first = *r;
      EXPECT_EQ(*r, first);
      EXPECT_TRUE((*r)->Contains(t.data(), t.TotalBytes()));
    }
  }
  EXPECT_EQ(memory_->registered_regions(), 1u);
  // The whole pool region, not the tensor, is what was registered: a peer can write anywhere
  // in it.
  MemoryRegion region;
  ASSERT_TRUE(pool_.FindRegion(tensors[0].data(), 1, &region));
  EXPECT_EQ(first->base(), region.base);
  EXPECT_EQ(first->length(), region.size);
  ASSERT_TRUE(RemoteWrite(first->PackRemoteKey(), tensors[5].data(), 200).ok());
  EXPECT_TRUE(Holds(tensors[5].data(), 200));
}

TEST_F(MemoryMgrTest, AReceiversMemoryTakesRemoteWritesButNeverRemoteReads) {
  Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({256}));
  std::memset(t.data(), 0x5A, 256);
  absl::StatusOr<const fabric::MemoryRegion*> r = memory_->FindRegistered(t.data(), 256);
  ASSERT_TRUE(r.ok() && *r != nullptr) << r.status();
  const absl::Status read = RemoteRead((*r)->PackRemoteKey(), t.data(), 64);
  EXPECT_EQ(read.code(), absl::StatusCode::kPermissionDenied) << read;
  EXPECT_EQ(source_[1], 1) << "nothing was read";
  ASSERT_TRUE(RemoteWrite((*r)->PackRemoteKey(), t.data(), 64).ok());
  EXPECT_TRUE(Holds(t.data(), 64));
  // A transient registration gets the same rights.
  std::vector<uint8_t> heap(512, 0x5A);
  std::unique_ptr<fabric::MemoryRegion> mr = *memory_->RegisterTransient(heap.data(), heap.size());
  EXPECT_EQ(RemoteRead(mr->PackRemoteKey(), heap.data(), 64).code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(MemoryMgrTest, ALendersMemoryTakesRemoteReadsButNeverRemoteWrites) {
  PoolAllocator lending_pool(
      "lending pool", PoolAllocator::Options{.region_bytes = size_t{1} << 20, .pretouch = false});
  RdmaMemoryMgr lender(domain_.get(), &lending_pool, RemoteAccessFor(VerbsMode::kGdr));
  Tensor t = *Tensor::Allocate(&lending_pool, DataType::kUInt8, TensorShape::Of({256}));
  std::memset(t.data(), 0x5A, 256);
  absl::StatusOr<const fabric::MemoryRegion*> r = lender.FindRegistered(t.data(), 256);
  ASSERT_TRUE(r.ok() && *r != nullptr) << r.status();
  const absl::Status write = RemoteWrite((*r)->PackRemoteKey(), t.data(), 64);
  EXPECT_EQ(write.code(), absl::StatusCode::kPermissionDenied) << write;
  EXPECT_EQ(static_cast<const uint8_t*>(t.data())[0], 0x5A) << "nothing was written";
  ASSERT_TRUE(RemoteRead((*r)->PackRemoteKey(), t.data(), 64).ok());
  EXPECT_EQ(source_[0], 0x5A);
  EXPECT_EQ(source_[63], 0x5A);
}

TEST_F(MemoryMgrTest, MemoryOutsideThePoolIsNotRegistrable) {
  std::vector<uint8_t> heap(4096);
  absl::StatusOr<const fabric::MemoryRegion*> r = memory_->FindRegistered(heap.data(), heap.size());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, nullptr);
  r = memory_->FindRegistered(nullptr, 0);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, nullptr);
  // A range that starts in a pool region and runs past its end is not inside it either.
  Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({64}));
  MemoryRegion region;
  ASSERT_TRUE(pool_.FindRegion(t.data(), 1, &region));
  r = memory_->FindRegistered(t.data(), region.size + 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, nullptr);
  EXPECT_EQ(memory_->registered_regions(), 0u);
}

TEST_F(MemoryMgrTest, ARefusedRegistrationIsAnErrorAndTheNextLookupRetries) {
  fabric::loopback::SetFaults(domain_.get(), {.fail_register_nth = 1});
  Tensor t = *Tensor::Allocate(&pool_, DataType::kFloat32, TensorShape::Of({16}));
  absl::StatusOr<const fabric::MemoryRegion*> r = memory_->FindRegistered(t.data(), 64);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  r = memory_->FindRegistered(t.data(), 64);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(*r, nullptr);
}

TEST_F(MemoryMgrTest, StagingIsRegisteredPoolMemoryHoldingTheBytes) {
  const fabric::MemoryRegion* region = nullptr;
  absl::StatusOr<Tensor> staging = memory_->AllocateStaging(5000, &region);
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ(staging->dtype(), DataType::kUInt8);
  EXPECT_EQ(staging->TotalBytes(), 5000u);
  ASSERT_NE(region, nullptr);
  EXPECT_TRUE(region->Contains(staging->data(), 5000));
  EXPECT_EQ(staging->allocator(), &pool_);
  ASSERT_TRUE(RemoteWrite(region->PackRemoteKey(), staging->data(), 256).ok());
  EXPECT_TRUE(Holds(staging->data(), 256));

  std::vector<uint8_t> bytes(3000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7);
  const fabric::MemoryRegion* copy_region = nullptr;
  absl::StatusOr<Tensor> copy = memory_->StageCopyOf(bytes.data(), bytes.size(), &copy_region);
  ASSERT_TRUE(copy.ok()) << copy.status();
  ASSERT_EQ(copy->TotalBytes(), bytes.size());
  EXPECT_EQ(std::memcmp(copy->data(), bytes.data(), bytes.size()), 0);
  ASSERT_NE(copy_region, nullptr);
  EXPECT_TRUE(copy_region->Contains(copy->data(), bytes.size()));
  EXPECT_FALSE(copy->SharesBufferWith(*staging));
}

TEST_F(MemoryMgrTest, RegisterTransientRegistersArbitraryMemory) {
  std::vector<uint8_t> heap(1000, 0xEE);
  absl::StatusOr<std::unique_ptr<fabric::MemoryRegion>> mr =
      memory_->RegisterTransient(heap.data(), heap.size());
  ASSERT_TRUE(mr.ok()) << mr.status();
  EXPECT_TRUE((*mr)->Contains(heap.data(), heap.size()));
  const fabric::RemoteKey key = (*mr)->PackRemoteKey();
  ASSERT_TRUE(RemoteWrite(key, heap.data() + 100, 256).ok());
  EXPECT_TRUE(Holds(heap.data() + 100, 256));
  EXPECT_EQ(heap[99], 0xEE);
  EXPECT_EQ(memory_->registered_regions(), 0u) << "not a pool registration";
  // One transfer's registration: gone with its handle.
  mr->reset();
  EXPECT_FALSE(RemoteWrite(key, heap.data(), 16).ok());
}

TEST_F(MemoryMgrTest, MetaDataCacheRoundTrips) {
  EXPECT_EQ(memory_->CachedMeta("k"), nullptr);
  TensorMetaData meta;
  meta.dtype = DataType::kFloat32;
  meta.shape = TensorShape::Of({2, 3});
  meta.tensor_bytes = 24;
  memory_->CacheMeta("k", meta);
  ASSERT_NE(memory_->CachedMeta("k"), nullptr);
  EXPECT_EQ(*memory_->CachedMeta("k"), meta);
  EXPECT_EQ(memory_->CachedMeta("other"), nullptr);

  TensorMetaData bigger = meta;
  bigger.shape = TensorShape::Of({4, 3});
  bigger.tensor_bytes = 48;
  memory_->CacheMeta("k", bigger);
  EXPECT_EQ(*memory_->CachedMeta("k"), bigger) << "the latest meta-data wins";
  memory_->CacheMeta("other", meta);
  EXPECT_EQ(memory_->cached(), 2u);
}

TEST_F(MemoryMgrTest, RegionsThePoolReleasesAreDeregisteredBeforeTheNextLookup) {
  fabric::RemoteKey old_key;
  void* old_base = nullptr;
  {
    Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
    absl::StatusOr<const fabric::MemoryRegion*> r = memory_->FindRegistered(t.data(), 4096);
    ASSERT_TRUE(r.ok() && *r != nullptr);
    old_key = (*r)->PackRemoteKey();
    old_base = (*r)->base();
    ASSERT_TRUE(RemoteWrite(old_key, t.data(), 16).ok());
  }
  ASSERT_EQ(pool_.ReleaseFreeRegions(), 1u);
  // The pool's visitor only recorded the release (it may run on any thread, under the pool's
  // lock); the registration goes at the next lookup, on the progress thread.
  EXPECT_EQ(memory_->registered_regions(), 1u);
  // `tensorverbs stats` sees the same from any thread.
  EXPECT_EQ(memory_->gauges().regions, 1);
  EXPECT_EQ(memory_->gauges().bytes, int64_t{2} << 20);
  absl::StatusOr<const fabric::MemoryRegion*> none = memory_->FindRegistered(nullptr, 0);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(memory_->registered_regions(), 0u);
  EXPECT_EQ(memory_->gauges().regions, 0);
  EXPECT_EQ(memory_->gauges().bytes, 0);
  // A peer still holding the old key is refused before any byte moves (the memory is unmapped).
  absl::Status s = RemoteWrite(old_key, old_base, 16);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("not registered"));

  // A new region is registered afresh.
  Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
  absl::StatusOr<const fabric::MemoryRegion*> r = memory_->FindRegistered(t.data(), 4096);
  ASSERT_TRUE(r.ok() && *r != nullptr);
  EXPECT_NE((*r)->PackRemoteKey(), old_key);
  EXPECT_EQ(memory_->registered_regions(), 1u);
  ASSERT_TRUE(RemoteWrite((*r)->PackRemoteKey(), t.data(), 16).ok());
  EXPECT_TRUE(Holds(t.data(), 16));
}

TEST_F(MemoryMgrTest, WithChannelKeysEachPeerIsOfferedAKeyOfItsOwnThatDiesWithItsChannel) {
  memory_ =
      std::make_unique<RdmaMemoryMgr>(domain_.get(), &pool_, RemoteAccessFor(VerbsMode::kZeroCopy),
                                      /*channel_keys=*/true);
  ASSERT_TRUE(memory_->channel_keys());
  // A second channel: another peer's endpoint, connected to its own endpoint here.
  std::unique_ptr<fabric::Domain> other_domain = *fabric::OpenDomain("loopback", {});
  std::unique_ptr<fabric::Endpoint> other_target = *domain_->CreateEndpoint();
  std::unique_ptr<fabric::Endpoint> other_writer = *other_domain->CreateEndpoint();
  ASSERT_TRUE(other_writer->Connect(other_target->LocalAddress()).ok());
  ASSERT_TRUE(other_target->Connect(other_writer->LocalAddress()).ok());

  Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
  Tensor u = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
  const fabric::MemoryRegion* region = *memory_->FindRegistered(t.data(), 4096);
  ASSERT_NE(region, nullptr);
  absl::StatusOr<fabric::RemoteKey> key = memory_->RemoteKeyFor(*target_, *region);
  absl::StatusOr<fabric::RemoteKey> other_key = memory_->RemoteKeyFor(*other_target, *region);
  ASSERT_TRUE(key.ok()) << key.status();
  ASSERT_TRUE(other_key.ok()) << other_key.status();
  EXPECT_NE(*key, *other_key);
  EXPECT_NE(*key, region->PackRemoteKey()) << "the shared registration is not offered";
  EXPECT_EQ(RemoteWrite(region->PackRemoteKey(), t.data(), 64).code(),
            absl::StatusCode::kPermissionDenied)
      << "and takes no remote access: no key but a channel's reaches the memory";
  // Steady state: a destination in the same pool region reuses the channel's registration.
  const fabric::MemoryRegion* same = *memory_->FindRegistered(u.data(), 4096);
  EXPECT_EQ(*memory_->RemoteKeyFor(*target_, *same), *key);
  EXPECT_EQ(memory_->endpoint_registrations(), 2u);
  EXPECT_EQ(memory_->gauges().endpoint_registrations, 2);
  EXPECT_EQ(memory_->gauges().endpoint_bytes, int64_t{4} << 20);
  EXPECT_EQ(memory_->EndpointRegistrations(target_.get()),
            (std::pair<int64_t, int64_t>{1, int64_t{2} << 20}));

  ASSERT_TRUE(RemoteWrite(*key, t.data(), 64).ok());
  EXPECT_TRUE(Holds(t.data(), 64));
  // The peer of another channel cannot use it (the loopback binds keys to endpoints).
  std::vector<uint8_t> junk(64, 0xAB);
  std::unique_ptr<fabric::MemoryRegion> junk_region =
      *other_domain->RegisterMemory(junk.data(), junk.size(), fabric::kAccessLocal);
  absl::Status s = other_writer->PostWrite({junk_region.get(), junk.data(), 64},
                                           {*key, reinterpret_cast<uint64_t>(u.data()), 64}, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_NE(static_cast<uint8_t*>(u.data())[0], 0xAB);

  // The channel closes: its keys stop working, the other channel's still do.
  memory_->DropEndpoint(target_.get());
  EXPECT_EQ(memory_->endpoint_registrations(), 1u);
  EXPECT_EQ(memory_->gauges().endpoint_registrations, 1);
  EXPECT_EQ(memory_->EndpointRegistrations(target_.get()), (std::pair<int64_t, int64_t>{0, 0}));
  EXPECT_FALSE(RemoteWrite(*key, t.data(), 64).ok());
  ASSERT_TRUE(other_writer
                  ->PostWrite({junk_region.get(), junk.data(), 64},
                              {*other_key, reinterpret_cast<uint64_t>(u.data()), 64}, 2)
                  .ok());
  EXPECT_EQ(static_cast<uint8_t*>(u.data())[0], 0xAB);

  // A key asked for again after the close is a new registration.
  absl::StatusOr<fabric::RemoteKey> again = memory_->RemoteKeyFor(*target_, *region);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(*again, *key);
  memory_->DropEndpoint(target_.get());
  memory_->DropEndpoint(other_target.get());
  EXPECT_EQ(memory_->endpoint_registrations(), 0u);
}

TEST_F(MemoryMgrTest, ChannelKeysOfAReleasedPoolRegionGoWithIt) {
  memory_ =
      std::make_unique<RdmaMemoryMgr>(domain_.get(), &pool_, RemoteAccessFor(VerbsMode::kZeroCopy),
                                      /*channel_keys=*/true);
  fabric::RemoteKey key;
  void* base = nullptr;
  {
    Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
    const fabric::MemoryRegion* region = *memory_->FindRegistered(t.data(), 4096);
    key = *memory_->RemoteKeyFor(*target_, *region);
    base = t.data();
  }
  ASSERT_EQ(pool_.ReleaseFreeRegions(), 1u);
  ASSERT_TRUE(memory_->FindRegistered(nullptr, 0).ok());
  EXPECT_EQ(memory_->endpoint_registrations(), 0u);
  EXPECT_FALSE(RemoteWrite(key, base, 16).ok());
}

TEST_F(MemoryMgrTest, SharedKeysOfferTheRegionsOwnKeyToEveryPeer) {
  // memory_ was made without channel keys (TENSORVERBS_REMOTE_KEYS=shared, or a fabric
  // without them).
  EXPECT_FALSE(memory_->channel_keys());
  Tensor t = *Tensor::Allocate(&pool_, DataType::kUInt8, TensorShape::Of({4096}));
  const fabric::MemoryRegion* region = *memory_->FindRegistered(t.data(), 4096);
  EXPECT_EQ(*memory_->RemoteKeyFor(*target_, *region), region->PackRemoteKey());
  EXPECT_EQ(memory_->endpoint_registrations(), 0u);
  // A transient registration is offered as it is, with or without channel keys.
  std::vector<uint8_t> heap(100);
  std::unique_ptr<fabric::MemoryRegion> transient =
      *memory_->RegisterTransient(heap.data(), heap.size());
  EXPECT_EQ(*memory_->RemoteKeyFor(*target_, *transient), transient->PackRemoteKey());
}

}  // namespace
}  // namespace tensorverbs::protocol

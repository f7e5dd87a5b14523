#include "src/common/net_address.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

namespace tensorverbs {
namespace {

TEST(HostOfTest, StripsThePortAndAnIpv6AddressesBrackets) {
  EXPECT_EQ(HostOf("node7:2222"), "node7");
  EXPECT_EQ(HostOf("10.0.0.1:2222"), "10.0.0.1");
  EXPECT_EQ(HostOf("[fd00::2]:2222"), "fd00::2");
  EXPECT_EQ(HostOf("[fd00::2]"), "fd00::2");
  EXPECT_EQ(HostOf("node7"), "node7");
  EXPECT_EQ(HostOf(""), "");
}

TEST(SameIpTest, ComparesTheAddressNotThePortOrAFamilyMismatch) {
  sockaddr_in a{}, b{};
  a.sin_family = b.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  inet_pton(AF_INET, "127.0.0.1", &b.sin_addr);
  a.sin_port = htons(1);
  b.sin_port = htons(2);
  EXPECT_TRUE(SameIp(reinterpret_cast<sockaddr*>(&a), reinterpret_cast<sockaddr*>(&b)));
  inet_pton(AF_INET, "127.0.0.2", &b.sin_addr);
  EXPECT_FALSE(SameIp(reinterpret_cast<sockaddr*>(&a), reinterpret_cast<sockaddr*>(&b)));
  sockaddr_in6 c{};
  c.sin6_family = AF_INET6;
  EXPECT_FALSE(SameIp(reinterpret_cast<sockaddr*>(&a), reinterpret_cast<sockaddr*>(&c)));
  EXPECT_FALSE(SameIp(nullptr, reinterpret_cast<sockaddr*>(&a)));
}

TEST(AnyResolvedAddressTest, ResolvesLiteralsAndStopsAtTheFirstMatch) {
  int calls = 0;
  EXPECT_TRUE(AnyResolvedAddress("127.0.0.1", [&](const sockaddr* a) {
    ++calls;
    return a->sa_family == AF_INET;
  }));
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(AnyResolvedAddress("not a host name", [](const sockaddr*) { return true; }));
}

}  // namespace
}  // namespace tensorverbs

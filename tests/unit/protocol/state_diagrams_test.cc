// docs/architecture/state-machines.md draws the state tables of the protocol, device staging and
// the torch backend's landings
// (state_table.h): this test renders every table and holds the page to it, so the drawing cannot
// drift from the code, and shows that a stale page is refused naming the table. Run with
// --write=PATH (what `make state-diagrams` does) it writes the page's generated part instead of
// testing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "python/src/torch/landings.h"
#include "src/common/state_table.h"
#include "src/protocol/channel.h"
#include "src/protocol/gdr_pull.h"
#include "src/protocol/tensor_request.h"
#include "src/protocol/tensor_response.h"
#include "src/rendezvous/device_staging.h"

namespace tensorverbs::protocol {
namespace {

constexpr char kBegin[] = "<!-- state-tables: begin (make state-diagrams writes this part) -->\n";
constexpr char kEnd[] = "<!-- state-tables: end -->\n";

std::vector<StateTableView> Tables() {
  return {ChannelStateTable(),
          RequestStateTable(),
          ResponseStateTable(),
          PullStateTable(),
          device_staging::ProxyStateTable(),
          device_staging::StagingStateTable(),
          torch_backend::InPlaceLandingTable(),
          torch_backend::CollectiveLandingTable()};
}

// What stands between the page's markers.
std::string Rendered() {
  std::string out;
  for (const StateTableView& t : Tables()) absl::StrAppend(&out, "\n", RenderStateTable(t));
  return absl::StrCat(out, "\n");
}

// The page with `rendered` between its markers, or why not.
bool Splice(const std::string& page, const std::string& rendered, std::string* out,
            std::string* error) {
  const size_t begin = page.find(kBegin);
  const size_t end = page.find(kEnd);
  if (begin == std::string::npos || end == std::string::npos || end < begin) {
    *error = "the page lacks its state-tables markers";
    return false;
  }
  *out = absl::StrCat(page.substr(0, begin + std::strlen(kBegin)), rendered, page.substr(end));
  return true;
}

// Empty when `page` draws the tables as they are; otherwise the first table whose section
// differs, and the first line that does.
std::string Compare(const std::string& page) {
  std::string expected, error;
  if (!Splice(page, Rendered(), &expected, &error)) return error;
  if (expected == page) return "";
  std::istringstream want(expected), have(page);
  std::string w, h, table = "(before the first table)";
  for (int line = 1;; ++line) {
    const bool more_w = static_cast<bool>(std::getline(want, w));
    const bool more_h = static_cast<bool>(std::getline(have, h));
    if (more_w && w.rfind("## ", 0) == 0) table = w.substr(3);
    if (!more_w && !more_h) break;
    if (w != h || more_w != more_h) {
      return absl::StrCat("the drawing of ", table, " differs from its table at line ", line,
                          ":\n  page:  ", more_h ? h : "(end)", "\n  table: ", more_w ? w : "(end)",
                          "\nrun `make state-diagrams` to redraw it");
    }
  }
  return "";
}

std::string ReadPage() {
  std::ifstream in(TENSORVERBS_STATE_PAGE);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(StateDiagramsTest, EveryTableIsSound) {
  for (const StateTableView& t : Tables()) EXPECT_EQ(CheckStateTable(t), "") << t.name;
}

TEST(StateDiagramsTest, ThePageDrawsEveryTableAsItIs) {
  const std::string page = ReadPage();
  ASSERT_FALSE(page.empty()) << "cannot read " << TENSORVERBS_STATE_PAGE;
  EXPECT_EQ(Compare(page), "");
}

TEST(StateDiagramsTest, AStalePageIsRefusedNamingTheTable) {
  std::string page;
  std::string error;
  ASSERT_TRUE(Splice(absl::StrCat("# page\n", kBegin, kEnd), Rendered(), &page, &error)) << error;
  EXPECT_EQ(Compare(page), "");
  // A row the code has and the drawing lost.
  const std::string row = "  requested --> landed_ahead";
  ASSERT_NE(page.find(row), std::string::npos);
  std::string stale = page;
  stale.erase(stale.find(row), stale.find('\n', stale.find(row)) + 1 - stale.find(row));
  EXPECT_THAT(Compare(stale), ::testing::HasSubstr("the drawing of RdmaTensorRequest differs"));
  // A guard reworded by hand.
  stale = absl::StrReplaceAll(page, {{"the last write", "the final write"}});
  EXPECT_THAT(Compare(stale), ::testing::HasSubstr("RdmaTensorResponse"));
  EXPECT_THAT(Compare("no markers"), ::testing::HasSubstr("markers"));
}

// --write=PATH: puts the rendered tables between the markers of the page at PATH.
int Write(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  std::string page, error;
  if (!Splice(text.str(), Rendered(), &page, &error)) {
    std::cerr << path << ": " << error << "\n";
    return 1;
  }
  std::ofstream out(path, std::ios::trunc);
  out << page;
  return out ? 0 : 1;
}

}  // namespace
}  // namespace tensorverbs::protocol

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--write=", 8) == 0) {
      return tensorverbs::protocol::Write(argv[i] + 8);
    }
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

// Setting: one row of the table that declares every environment variable tensorverbs reads:
// its name (and the alias TensorFlow's code spelled it with), its type, its valid range or
// choices, its help, and how it is stored in Config and read back from it.
//
// Config::FromEnvironment parses the environment by walking this table, the unknown-variable
// check and `tensorverbs info` list it, and `tensorverbs info --settings-markdown` prints the
// README's configuration tables from it; the build fails when the README's copy differs
// (cmake/CheckSettingsTable.cmake). A default is declared once, as the Config field's
// initializer in config.h: the table reads it back through `get` from Config::Defaults(), so
// the two cannot disagree. A few variables are read outside Config (by the Slurm placement
// parser and by setup.py); their rows have no `set`, and their help names the reader.
//
// A variable set to nothing (or to blanks) counts as unset. The table is immutable and built
// on first use; any thread may read it.
#ifndef TENSORVERBS_COMMON_SETTINGS_H_
#define TENSORVERBS_COMMON_SETTINGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tensorverbs {

struct Config;

enum class SettingKind {
  kInteger,  // a decimal integer in [min, max], then `check`
  kChoice,   // one of `choices`, case-insensitive
  kText,     // any text, surrounding blanks dropped
  kCustom,   // parsed by `parse`
};

// Which of the README's two tables a setting is listed in.
enum class SettingTable { kTensorVerbs, kRdma };

struct Setting {
  const char* variable = "";
  const char* alias = nullptr;  // the TensorFlow spelling, accepted too; nullptr: none
  SettingTable table = SettingTable::kTensorVerbs;
  SettingKind kind = SettingKind::kText;
  int64_t min = 0;  // kInteger: the inclusive range
  int64_t max = 0;
  std::vector<std::string> choices = {};  // kChoice, lower case
  const char* help = "";             // the README's "meaning" column
  // The README's "values" column where the kind does not say it (a path, a custom syntax, a
  // range with a hole); nullptr: the range, the choices, or "text".
  const char* values = nullptr;
  // The README's default column where the default value alone does not say it (a value chosen
  // at run time); nullptr: the value `get` reads from Config::Defaults().
  const char* default_note = nullptr;
  // kInteger: why an in-range value is still invalid, or nullptr when it is valid.
  const char* (*check)(int64_t value) = nullptr;
  // kCustom: parses `text` into `config`; the error needs no variable name (the caller adds it).
  absl::Status (*parse)(const std::string& text, Config& config) = nullptr;
  // Stores a valid value: kInteger through set_int, kChoice and kText through set_text.
  // Neither: the variable is read outside Config (its help says by whom).
  void (*set_int)(Config& config, int64_t value) = nullptr;
  void (*set_text)(Config& config, const std::string& value) = nullptr;
  // The value `config` holds, written as the variable would be ("" for unset text).
  std::string (*get)(const Config& config) = nullptr;
};

// Every setting, in the README's order.
const std::vector<Setting>& Settings();

// The row of `variable` (or of its alias); nullptr when tensorverbs does not read it.
const Setting* FindSetting(absl::string_view variable);

// The README's table for `table`: a header row and one row per setting, each line ending in
// '\n'.
std::string SettingsMarkdown(SettingTable table);

namespace settings_internal {
// Appends the rows of the RDMA table (settings_rdma.cc) to `settings`.
void AddRdmaSettings(std::vector<Setting>& settings);
}  // namespace settings_internal

}  // namespace tensorverbs

#endif  // TENSORVERBS_COMMON_SETTINGS_H_

# Rules of the house that the build checks (run by the tv_source_rules target):
#  - no source file in src/, tools/ or python/src/ is over 600 lines: a room that outgrew one
#    idea is split by object (docs/architecture/layers.md, rules the build checks);
#  - nothing but src/common/config.cc reads the environment: a setting is a row of the settings
#    table (src/common/settings.cc), and other readers go through EnvironmentVariables().
# Usage: cmake -DROOT=<source dir> [-DSTAMP=<file>] -P CheckSourceRules.cmake
set(max_lines 600)
set(violations "")
file(GLOB_RECURSE files
  "${ROOT}/src/*.h" "${ROOT}/src/*.cc" "${ROOT}/tools/*.h" "${ROOT}/tools/*.cc"
  "${ROOT}/python/src/*.h" "${ROOT}/python/src/*.cc")
foreach(file IN LISTS files)
  file(RELATIVE_PATH rel "${ROOT}" "${file}")
  file(READ "${file}" text)
  string(REGEX MATCHALL "\n" newlines "${text}")
  list(LENGTH newlines n)
  # A last line without its newline counts too.
  string(LENGTH "${text}" length)
  if(length GREATER 0 AND NOT text MATCHES "\n$")
    math(EXPR n "${n} + 1")
  endif()
  if(n GREATER max_lines)
    list(APPEND violations "${rel} has ${n} lines (at most ${max_lines}): split it by object")
  endif()
  if(NOT rel STREQUAL "src/common/config.cc")
    string(REGEX MATCH "(std::)?(secure_)?getenv[ \t]*\\(|[^_a-zA-Z]environ[^_a-zA-Z0-9]" reader "${text}")
    if(reader)
      list(APPEND violations
        "${rel} reads the environment ('${reader}'): declare a setting in src/common/settings.cc, or use EnvironmentVariables() (src/common/config.h)")
    endif()
  endif()
endforeach()

include(${CMAKE_CURRENT_LIST_DIR}/CheckReport.cmake)
tv_report_violations("source rules broken" "${violations}")

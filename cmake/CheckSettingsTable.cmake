# Compares the README's configuration tables with the settings table they are printed from
# (`tensorverbs info --settings-markdown tensorverbs|rdma`), run by the tv_settings_table
# target; with -DUPDATE=ON it rewrites the README's copies instead (`make settings-table`).
# In the README each table sits between "<!-- settings:NAME -->" and "<!-- /settings -->".
# Usage: cmake -DTOOL=<tensorverbs binary> -DREADME=<README.md> [-DSTAMP=<file>] [-DUPDATE=ON]
#        -P CheckSettingsTable.cmake
file(READ "${README}" readme)
set(updated "${readme}")
set(stale "")
foreach(table tensorverbs rdma)
  execute_process(COMMAND "${TOOL}" info --settings-markdown ${table}
    OUTPUT_VARIABLE generated RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${TOOL} info --settings-markdown ${table} failed (${rc}): ${err}")
  endif()
  set(begin "<!-- settings:${table} -->\n")
  set(end "<!-- /settings -->")
  string(FIND "${updated}" "${begin}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${README} has no '${begin}' marker for the ${table} settings table")
  endif()
  string(LENGTH "${begin}" begin_length)
  math(EXPR body_at "${at} + ${begin_length}")
  string(SUBSTRING "${updated}" ${body_at} -1 rest)
  string(FIND "${rest}" "${end}" body_length)
  if(body_length EQUAL -1)
    message(FATAL_ERROR "${README}: the ${table} settings table has no closing '${end}'")
  endif()
  string(SUBSTRING "${rest}" 0 ${body_length} body)
  if(NOT body STREQUAL generated)
    list(APPEND stale ${table})
    string(SUBSTRING "${updated}" 0 ${body_at} head)
    string(SUBSTRING "${rest}" ${body_length} -1 tail)
    set(updated "${head}${generated}${tail}")
  endif()
endforeach()

if(stale AND UPDATE)
  file(WRITE "${README}" "${updated}")
  message(STATUS "rewrote the README's settings tables: ${stale}")
elseif(stale)
  message(FATAL_ERROR
    "the README's settings tables (${stale}) differ from src/common/settings.cc; "
    "change the table there and run `make settings-table` to rewrite the README's copy")
endif()
if(STAMP)
  file(TOUCH "${STAMP}")
endif()

# How the build's rule checks (CheckLayers.cmake, CheckSourceRules.cmake) end: the build fails
# listing every violation under `title`, or the check's stamp file (STAMP, if given) is touched
# so the check runs again only when a checked file changes.
function(tv_report_violations title violations)
  if(violations)
    list(JOIN violations "\n  " text)
    message(FATAL_ERROR "${title}:\n  ${text}")
  endif()
  if(STAMP)
    file(TOUCH "${STAMP}")
  endif()
endfunction()

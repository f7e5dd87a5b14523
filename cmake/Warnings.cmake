# Project-wide warnings. -Werror is on in CI (TENSORVERBS_WERROR=ON from the Makefile).
add_compile_options(-Wall -Wextra -Wno-unused-parameter)
if(TENSORVERBS_WERROR)
  add_compile_options(-Werror)
endif()
# GCC 12 reports false positives inside absl::InlinedVector and std::variant at -O2.
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  add_compile_options(-Wno-maybe-uninitialized)
endif()

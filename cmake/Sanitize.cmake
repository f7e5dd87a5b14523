# SANITIZE=address builds with ASan and UBSan; SANITIZE=thread with TSan.
if(SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
endif()
if(TENSORVERBS_FUZZ)
  # Every library is instrumented for coverage, so the fuzzers see into the decoders they call;
  # ASan and UBSan turn a bad read or an overflow into a crash with its input.
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "TENSORVERBS_FUZZ needs clang (libFuzzer): configure with "
                        "-DCMAKE_CXX_COMPILER=clang++ -DCMAKE_C_COMPILER=clang, as make fuzz does")
  endif()
  if(NOT SANITIZE STREQUAL "")
    message(FATAL_ERROR "TENSORVERBS_FUZZ brings its own sanitizers; leave SANITIZE empty")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer
                      -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
  add_compile_definitions(TENSORVERBS_DCHECK_ALWAYS_ON=1)
endif()
if(SANITIZE STREQUAL "address" OR SANITIZE STREQUAL "thread")
  add_compile_definitions(TENSORVERBS_DCHECK_ALWAYS_ON=1)
elseif(NOT SANITIZE STREQUAL "")
  message(FATAL_ERROR "SANITIZE must be empty, 'address' or 'thread', not '${SANITIZE}'")
endif()

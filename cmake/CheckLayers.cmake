# Refuses an include that points up the layer stack (run by the build: the tv_layers target).
# Each layer of src/ may include only its own headers and those of the layers it builds on,
# the same ones its CMake target links. Above them: tools/ (the command-line tool) builds on
# the server and everything below it but never on the protocol's or a transport's insides;
# python/src/ (the bindings and the torch backend) builds on the api layer and common only.
# tests/ and bench/ may include anything. Usage: cmake -DROOT=<source dir> -DSTAMP=<file> -P
# CheckLayers.cmake
set(layers common tensor device fabric rendezvous rpc protocol transport/grpc transport/verbs support
  server api)
set(allowed_common common)
set(allowed_tensor common tensor)
set(allowed_device common tensor device)
set(allowed_fabric common fabric)
set(allowed_rendezvous common tensor rendezvous)
set(allowed_rpc common rpc)
set(allowed_protocol common tensor fabric rendezvous protocol)
set(allowed_transport/grpc common tensor rendezvous rpc protocol transport/grpc)
set(allowed_transport/verbs common tensor fabric rendezvous rpc protocol transport/verbs)
set(allowed_support common support)
set(allowed_server common tensor device fabric rendezvous rpc protocol transport/grpc
  transport/verbs server)
set(allowed_api ${allowed_server} api)
set(allowed_tools common tensor device fabric rendezvous rpc support server api)
set(allowed_python common api)
set(dir_tools tools)
set(dir_python python/src)

set(violations "")
foreach(layer IN LISTS layers ITEMS tools python)
  if(DEFINED dir_${layer})
    set(dir "${dir_${layer}}")
  else()
    set(dir "src/${layer}")
  endif()
  file(GLOB_RECURSE files "${ROOT}/${dir}/*.h" "${ROOT}/${dir}/*.cc")
  foreach(file IN LISTS files)
    # The public value types (include/tensorverbs/) need only abseil, so every layer may use
    # them; task.h and the umbrella header are the api layer's, the top of the stack.
    file(STRINGS "${file}" public REGEX "^#include \"tensorverbs/(task|tensorverbs)\\.h\"")
    if(public AND NOT layer MATCHES "^(api|tools|python)$")
      file(RELATIVE_PATH rel "${ROOT}" "${file}")
      list(APPEND violations "${rel} (layer ${layer}) includes the api layer's ${public}")
    endif()
    # transport/grpc and transport/verbs are layers of their own, not parts of a "transport".
    file(STRINGS "${file}" includes REGEX "^#include \"(src|tools|tests|bench|python)/")
    foreach(line IN LISTS includes)
      string(REGEX REPLACE "^#include \"([^\"]+)\".*" "\\1" header "${line}")
      set(ok FALSE)
      set(prefixes "${dir}/")
      foreach(dep IN LISTS allowed_${layer})
        list(APPEND prefixes "src/${dep}/")
      endforeach()
      foreach(allowed IN LISTS prefixes)
        string(LENGTH "${allowed}" n)
        string(SUBSTRING "${header}" 0 ${n} prefix)
        if(prefix STREQUAL allowed)
          set(ok TRUE)
        endif()
      endforeach()
      if(NOT ok)
        file(RELATIVE_PATH rel "${ROOT}" "${file}")
        list(APPEND violations "${rel} (layer ${layer}) includes ${header}")
      endif()
    endforeach()
  endforeach()
endforeach()

include(${CMAKE_CURRENT_LIST_DIR}/CheckReport.cmake)
tv_report_violations("upward includes (see docs/architecture/layers.md)" "${violations}")

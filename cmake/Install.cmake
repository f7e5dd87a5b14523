# `cmake --install`: libtensorverbs (shared and static), the public headers, the tensorverbs
# tool, a CMake package (find_package(tensorverbs CONFIG) -> tensorverbs::tensorverbs and
# tensorverbs::tensorverbs_static) and a pkg-config file (tensorverbs.pc).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(TV_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/tensorverbs)
install(TARGETS tensorverbs_shared tensorverbs_static EXPORT tensorverbsTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS tensorverbs RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${TENSORVERBS_ROOT}/include/tensorverbs
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h")
install(EXPORT tensorverbsTargets NAMESPACE tensorverbs:: DESTINATION ${TV_CMAKE_DIR})

configure_package_config_file(${TENSORVERBS_ROOT}/cmake/tensorverbsConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/tensorverbsConfig.cmake INSTALL_DESTINATION ${TV_CMAKE_DIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/tensorverbsConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMajorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tensorverbsConfig.cmake
  ${CMAKE_CURRENT_BINARY_DIR}/tensorverbsConfigVersion.cmake DESTINATION ${TV_CMAKE_DIR})

# Relative to the installed file, so the tree can be installed under any prefix or moved.
file(RELATIVE_PATH TV_PC_TO_PREFIX /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
if(IBVERBS_FOUND)
  set(TV_PC_IBVERBS " libibverbs")
endif()
configure_file(${TENSORVERBS_ROOT}/cmake/tensorverbs.pc.in
  ${CMAKE_CURRENT_BINARY_DIR}/tensorverbs.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/tensorverbs.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

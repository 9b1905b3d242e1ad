# Install and export rules for kvlink (included only when KVLINK_INSTALL).
#
# Installs:
#   include/kvlink/**                         the headers
#   <libdir>/cmake/kvlink/kvlinkConfig.cmake  find_package(kvlink CONFIG)
#     kvlinkConfigVersion.cmake, kvlinkTargets.cmake (kvlink::kvlink),
#     kvlinkRdmaTargets.cmake (kvlink::rdma, when built),
#     kvlinkTlsTargets.cmake (kvlink::tls, when built),
#     kvlinkCudaTargets.cmake (kvlink::cuda, when built), and
#     kvlinkDependencies.cmake, which kvlinkConfig.cmake includes so a consumer
#     gets asio::asio and the ibverbs target made exactly as the build made them.
#   <datadir>/pkgconfig/kvlink.pc             for non-CMake builds
# and exports the build tree, so find_package(kvlink) also works with
# -Dkvlink_DIR=<kvlink build dir>.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# The usual places (find_package searches <prefix>/lib/cmake/kvlink). kvlink
# is header-only, so the version file is ARCH_INDEPENDENT: a 32-bit consumer
# may use a package installed by a 64-bit build.
set(KVLINK_INSTALL_CMAKEDIR "${CMAKE_INSTALL_LIBDIR}/cmake/kvlink"
    CACHE STRING "Where kvlink's CMake package files are installed (relative to the prefix)")
set(KVLINK_INSTALL_PKGCONFIGDIR "${CMAKE_INSTALL_DATADIR}/pkgconfig"
    CACHE STRING "Where kvlink.pc is installed (relative to the prefix)")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/kvlink"
        DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp")

# kvlink::rdma lives in its own export set: kvlinkConfig.cmake loads it only
# when the consumer's machine has libibverbs, so kvlink::rdma exists exactly
# when it can link (a dangling kvlink_ibverbs would turn into -lkvlink_ibverbs).
install(TARGETS kvlink EXPORT kvlinkTargets)
export(EXPORT kvlinkTargets NAMESPACE kvlink:: FILE "${PROJECT_BINARY_DIR}/kvlinkTargets.cmake")
install(EXPORT kvlinkTargets NAMESPACE kvlink:: DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
set(KVLINK_EXPORTS_RDMA OFF)
if(TARGET kvlink_rdma)
  set(KVLINK_EXPORTS_RDMA ON)
  install(TARGETS kvlink_rdma EXPORT kvlinkRdmaTargets)
  export(EXPORT kvlinkRdmaTargets NAMESPACE kvlink::
         FILE "${PROJECT_BINARY_DIR}/kvlinkRdmaTargets.cmake")
  install(EXPORT kvlinkRdmaTargets NAMESPACE kvlink:: DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
endif()
# kvlink::tls likewise: loaded only where OpenSSL is found.
set(KVLINK_EXPORTS_TLS OFF)
if(TARGET kvlink_tls)
  set(KVLINK_EXPORTS_TLS ON)
  install(TARGETS kvlink_tls EXPORT kvlinkTlsTargets)
  export(EXPORT kvlinkTlsTargets NAMESPACE kvlink::
         FILE "${PROJECT_BINARY_DIR}/kvlinkTlsTargets.cmake")
  install(EXPORT kvlinkTlsTargets NAMESPACE kvlink:: DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
endif()
# kvlink::cuda likewise: loaded only where the CUDA headers are found.
set(KVLINK_EXPORTS_CUDA OFF)
if(TARGET kvlink_cuda)
  set(KVLINK_EXPORTS_CUDA ON)
  install(TARGETS kvlink_cuda EXPORT kvlinkCudaTargets)
  export(EXPORT kvlinkCudaTargets NAMESPACE kvlink::
         FILE "${PROJECT_BINARY_DIR}/kvlinkCudaTargets.cmake")
  install(EXPORT kvlinkCudaTargets NAMESPACE kvlink:: DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")
endif()

# While the major version is 0, a minor release may break the API (0.1 -> 0.2),
# so only the same MAJOR.MINOR satisfies a request; from 1.0 on, SemVer's
# SameMajorVersion.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(_kvlink_compat SameMinorVersion)
else()
  set(_kvlink_compat SameMajorVersion)
endif()

# The same three files serve the build tree (next to the build-tree export) and
# the install tree; kvlinkConfig.cmake only refers to files beside itself.
foreach(_dir IN ITEMS build install)
  if(_dir STREQUAL "build")
    set(_out "${PROJECT_BINARY_DIR}")
  else()
    set(_out "${PROJECT_BINARY_DIR}/kvlink-install-package")
  endif()
  configure_package_config_file(
    "${CMAKE_CURRENT_LIST_DIR}/kvlinkConfig.cmake.in" "${_out}/kvlinkConfig.cmake"
    INSTALL_DESTINATION "${KVLINK_INSTALL_CMAKEDIR}"
    NO_SET_AND_CHECK_MACRO)
  write_basic_package_version_file("${_out}/kvlinkConfigVersion.cmake"
    VERSION "${PROJECT_VERSION}" COMPATIBILITY ${_kvlink_compat} ARCH_INDEPENDENT)
  # COPYONLY registers the source as a configure dependency: edits propagate.
  configure_file("${CMAKE_CURRENT_LIST_DIR}/kvlinkDependencies.cmake"
                 "${_out}/kvlinkDependencies.cmake" COPYONLY)
endforeach()
install(FILES
  "${PROJECT_BINARY_DIR}/kvlink-install-package/kvlinkConfig.cmake"
  "${PROJECT_BINARY_DIR}/kvlink-install-package/kvlinkConfigVersion.cmake"
  "${PROJECT_BINARY_DIR}/kvlink-install-package/kvlinkDependencies.cmake"
  DESTINATION "${KVLINK_INSTALL_CMAKEDIR}")

# pkg-config. The prefix is derived from the .pc file's own location, so an
# install with `cmake --install --prefix <elsewhere>` stays correct.
file(RELATIVE_PATH _kvlink_pc_to_prefix
     "/prefix/${KVLINK_INSTALL_PKGCONFIGDIR}" "/prefix")
string(REGEX REPLACE "/$" "" _kvlink_pc_to_prefix "${_kvlink_pc_to_prefix}")
set(KVLINK_PC_PREFIX "\${pcfiledir}/${_kvlink_pc_to_prefix}")
if(IS_ABSOLUTE "${CMAKE_INSTALL_INCLUDEDIR}")
  set(KVLINK_PC_INCLUDEDIR "${CMAKE_INSTALL_INCLUDEDIR}")
else()
  set(KVLINK_PC_INCLUDEDIR "\${prefix}/${CMAKE_INSTALL_INCLUDEDIR}")
endif()
# Standalone Asio has no .pc file: add its include directory unless the
# compiler searches it anyway.
set(KVLINK_PC_ASIO_CFLAGS "")
if(KVLINK_ASIO_INCLUDE_DIR AND NOT KVLINK_ASIO_INCLUDE_DIR IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES)
  set(KVLINK_PC_ASIO_CFLAGS " -I${KVLINK_ASIO_INCLUDE_DIR}")
endif()
configure_file("${CMAKE_CURRENT_LIST_DIR}/kvlink.pc.in" "${PROJECT_BINARY_DIR}/kvlink.pc" @ONLY)
install(FILES "${PROJECT_BINARY_DIR}/kvlink.pc" DESTINATION "${KVLINK_INSTALL_PKGCONFIGDIR}")

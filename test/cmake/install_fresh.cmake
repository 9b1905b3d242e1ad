# ctest fixture consumer.install: installs the kvlink build BUILD_DIR into a
# fresh PREFIX (stale headers from an earlier run must not satisfy a consumer)
# and checks that the package files are there.
#   cmake -DBUILD_DIR=... -DPREFIX=... [-DCONFIG=...] -P install_fresh.cmake
file(REMOVE_RECURSE "${PREFIX}")
set(_config)
if(CONFIG)
  set(_config --config "${CONFIG}")
endif()
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}" ${_config}
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed: ${_rc}")
endif()
foreach(_f IN ITEMS include/kvlink/version.hpp include/kvlink/core/error.hpp)
  if(NOT EXISTS "${PREFIX}/${_f}")
    message(FATAL_ERROR "${PREFIX}/${_f} was not installed")
  endif()
endforeach()
foreach(_glob IN ITEMS kvlinkConfig.cmake kvlinkConfigVersion.cmake kvlinkTargets.cmake
                       kvlinkDependencies.cmake kvlink.pc)
  file(GLOB_RECURSE _hits "${PREFIX}/*/${_glob}")
  if(NOT _hits)
    message(FATAL_ERROR "${_glob} was not installed under ${PREFIX}")
  endif()
endforeach()

# ctest consumer.pkg_config: compiles and runs the consumer program with only
# the flags `pkg-config --cflags --libs kvlink` gives for the installed kvlink.
#   cmake -DPKG_CONFIG=... -DCXX=... -DPREFIX=... -DSOURCE=...
#         -DWORK_DIR=... -DEXPECTED_VERSION=... -P pkg_config.cmake
file(GLOB_RECURSE _pc "${PREFIX}/*/kvlink.pc")
list(LENGTH _pc _n)
if(NOT _n EQUAL 1)
  message(FATAL_ERROR "expected one kvlink.pc under ${PREFIX}, found: ${_pc}")
endif()
get_filename_component(_pc_dir "${_pc}" DIRECTORY)
set(ENV{PKG_CONFIG_PATH} "${_pc_dir}")
foreach(_what IN ITEMS modversion cflags libs)
  execute_process(COMMAND "${PKG_CONFIG}" --${_what} kvlink
                  OUTPUT_VARIABLE _out ERROR_VARIABLE _err RESULT_VARIABLE _rc
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "pkg-config --${_what} kvlink failed: ${_err}")
  endif()
  set(_${_what} "${_out}")
endforeach()
if(NOT _modversion STREQUAL EXPECTED_VERSION)
  message(FATAL_ERROR "kvlink.pc says version ${_modversion}, expected ${EXPECTED_VERSION}")
endif()
if(NOT _cflags MATCHES "-I${PREFIX}/")
  message(FATAL_ERROR "kvlink.pc's Cflags (${_cflags}) do not point into ${PREFIX}")
endif()
message(STATUS "pkg-config kvlink: ${_cflags} ${_libs}")
separate_arguments(_cflags UNIX_COMMAND "${_cflags}")
separate_arguments(_libs UNIX_COMMAND "${_libs}")
file(MAKE_DIRECTORY "${WORK_DIR}")
execute_process(COMMAND "${CXX}" -std=c++20 ${_cflags} "-DKVLINK_EXPECTED_VERSION=\"${_modversion}\""
                        "${SOURCE}" -o "${WORK_DIR}/consumer" ${_libs}
                RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "compiling ${SOURCE} with pkg-config's flags failed")
endif()
execute_process(COMMAND "${WORK_DIR}/consumer" RESULT_VARIABLE _rc)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "the pkg-config consumer failed: ${_rc}")
endif()

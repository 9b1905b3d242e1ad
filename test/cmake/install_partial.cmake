# ctest consumer.install_partial: `cmake --build build --target X` then
# `cmake --install build` (issue 28). A fresh kvlink build tree in which
# nothing was built (so no Python module) must install the C++ package and
# say that the Python package was left out; asking for the python component
# by name must fail with the command that builds it.
#   cmake -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -DCXX=... -P install_partial.cmake
file(REMOVE_RECURSE "${WORK_DIR}")
set(_build "${WORK_DIR}/build")
set(_prefix "${WORK_DIR}/prefix")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${_build}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX}" -DKVLINK_BUILD_TESTS=OFF -DKVLINK_BUILD_EXAMPLES=OFF
    -DKVLINK_BUILD_BENCH=OFF -DKVLINK_INSTALL=ON
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configure failed:\n${_out}")
endif()
set(_with_python ON)
if(_out MATCHES "Python binding not built")
  set(_with_python OFF)
endif()

execute_process(COMMAND "${CMAKE_COMMAND}" --install "${_build}" --prefix "${_prefix}"
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
message(STATUS "cmake --install (nothing built):\n${_out}")
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "cmake --install of a build with nothing built failed (${_rc})")
endif()
if(NOT EXISTS "${_prefix}/include/kvlink/version.hpp")
  message(FATAL_ERROR "the headers were not installed")
endif()
if(NOT _with_python)
  message(STATUS "kvlink-test-skipped: the Python binding is not configured here")
  return()
endif()
if(NOT _out MATCHES "Python module [^\n]*_kvlink[^\n]* was not built \\(build it with `cmake --build [^\n]* --target kvlink_python`")
  message(FATAL_ERROR "no message saying the Python module was not built")
endif()
file(GLOB_RECURSE _py "${_prefix}/*/kvlink/__init__.py")
if(_py)
  message(FATAL_ERROR "a Python package without its module was installed: ${_py}")
endif()

execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${_build}" --prefix "${_prefix}" --component python
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out)
message(STATUS "cmake --install --component python (nothing built):\n${_out}")
if(_rc EQUAL 0)
  message(FATAL_ERROR "--component python succeeded without the module")
endif()
if(NOT _out MATCHES "--target kvlink_python")
  message(FATAL_ERROR "--component python failed without saying how to build the module")
endif()

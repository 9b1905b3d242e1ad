# Included by the add_subdirectory and FetchContent consumers after kvlink was
# added: as a sub-project kvlink must add its library targets and nothing of
# its own tests, examples, benchmarks or install rules.
if(NOT TARGET kvlink::kvlink)
  message(FATAL_ERROR "kvlink::kvlink is not defined")
endif()
foreach(_opt IN ITEMS KVLINK_BUILD_TESTS KVLINK_BUILD_EXAMPLES KVLINK_BUILD_BENCH KVLINK_INSTALL)
  if(${_opt})
    message(FATAL_ERROR "${_opt} is ON although kvlink is not the top-level project")
  endif()
endforeach()
foreach(_t IN ITEMS kvlink_doctest_main kvlink_unit_core)
  if(TARGET ${_t})
    message(FATAL_ERROR "kvlink's test target ${_t} exists in a consumer build")
  endif()
endforeach()
message(STATUS "kvlink from ${kvlink_SOURCE_DIR} added as a sub-project without tests, examples or install rules")

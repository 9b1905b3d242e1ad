# Runs a bench command and checks that it succeeds and prints what it
# should: ctest's PASS_REGULAR_EXPRESSION alone would ignore the exit status.
#
#   cmake -DCOMMAND="prog;arg;..." -DEXPECT="regex;regex;..." -P smoke.cmake
#
# Every regex of EXPECT must match the output (stdout and stderr together).
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message("${err}${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "smoke: exit status ${rc}")
endif()
foreach(re IN LISTS EXPECT)
  if(NOT out MATCHES "${re}")
    message(FATAL_ERROR "smoke: the output does not match '${re}'")
  endif()
endforeach()

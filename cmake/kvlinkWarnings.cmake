# Warnings (as errors with KVLINK_WERROR, as CI builds) and sanitizers for
# kvlink's own targets only: never global flags, never on what consumers build.
function(kvlink_strict target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
    -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Wunused -Woverloaded-virtual
    -Wconversion -Wno-sign-conversion)
  if(KVLINK_WERROR)
    target_compile_options(${target} PRIVATE -Werror)
  endif()
  if(KVLINK_SANITIZE)
    # GCC's -Wmaybe-uninitialized is unreliable under sanitizers (its manual
    # says so) and fires inside Asio's headers there; g++ 12 at -O1 with
    # sanitizers also takes Asio's coroutine frame operator new/delete pair
    # for a mismatch (-Wmismatched-new-delete). The plain build keeps both.
    target_compile_options(${target} PRIVATE -fsanitize=${KVLINK_SANITIZE} -fno-omit-frame-pointer
      -fno-sanitize-recover=all)
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
      target_compile_options(${target} PRIVATE -Wno-maybe-uninitialized -Wno-mismatched-new-delete)
    elseif(CMAKE_CXX_COMPILER_ID STREQUAL "Clang" AND KVLINK_SANITIZE MATCHES "undefined")
      # clang 14's -fsanitize=function (part of undefined; GCC has no such
      # check) puts data before coroutine functions that its assembler then
      # cannot place ("Cannot represent a difference across sections").
      target_compile_options(${target} PRIVATE -fno-sanitize=function)
    endif()
    target_link_options(${target} PRIVATE -fsanitize=${KVLINK_SANITIZE})
  endif()
endfunction()

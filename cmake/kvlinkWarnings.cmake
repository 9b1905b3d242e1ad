# Warnings (as errors) and sanitizers for kvlink's own targets only: never
# global flags, never on what consumers build.
function(kvlink_strict target)
  target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wshadow
    -Wnon-virtual-dtor -Wold-style-cast -Wcast-align -Wunused -Woverloaded-virtual
    -Wconversion -Wno-sign-conversion -Werror)
  if(KVLINK_SANITIZE)
    # GCC's -Wmaybe-uninitialized is unreliable under sanitizers (its manual
    # says so) and fires inside Asio's headers there; the plain build keeps it.
    target_compile_options(${target} PRIVATE -fsanitize=${KVLINK_SANITIZE} -fno-omit-frame-pointer
      -fno-sanitize-recover=all -Wno-maybe-uninitialized)
    target_link_options(${target} PRIVATE -fsanitize=${KVLINK_SANITIZE})
  endif()
endfunction()

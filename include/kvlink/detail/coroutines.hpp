// Asio's C++20 coroutine support (asio::awaitable, use_awaitable, co_spawn),
// which kvlink's asynchronous code is written in, checked once where a
// kvlink header first needs it.
//
// Asio 1.22 (Debian 12) switches it on by itself for g++ with -std=c++20,
// but for clang only with libc++'s <experimental/coroutine>: clang with
// libstdc++ compiles kvlink only with the two defines below, which kvlink's
// CMake target (kvlink::kvlink) and kvlink.pc carry. Without them Asio
// leaves out asio::awaitable and the first use fails deep inside a header;
// this says what is missing instead.
#pragma once

#include <asio/detail/config.hpp>

#if !defined(ASIO_HAS_CO_AWAIT) || !defined(ASIO_HAS_STD_COROUTINE)
#error \
    "kvlink needs Asio's C++20 coroutines, which this compiler did not switch on by itself: compile with -std=c++20 -DASIO_HAS_CO_AWAIT=1 -DASIO_HAS_STD_COROUTINE=1. kvlink's own flags carry them: `pkg-config --cflags kvlink`, or link the CMake target kvlink::kvlink."
#endif

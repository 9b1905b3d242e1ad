// engine.hpp's built-in transports (TCP, same-host shared memory) and its
// etcd and HTTP metadata backends, compiled in one translation unit instead
// of in every one that includes the engine.
//
// kvlink is header-only: every translation unit of a program that includes
// <kvlink/engine.hpp> compiles these (the engine makes them from its
// config), and a program of many such files pays for that many times over.
// Opt in, as with Asio's separate compilation: define
// KVLINK_SEPARATE_COMPILATION in every translation unit of the program (a
// compile definition of the target, never in some files only), and include
// this header in exactly one of them:
//
//   // kvlink_engine.cpp, built with -DKVLINK_SEPARATE_COMPILATION like the rest
//   #include <kvlink/separate.hpp>
//
// The definitions are in <kvlink/engine/backends.hpp>, which this includes
// (and engine.hpp does, in a header-only build). kvlink's own tests are
// built so (test/CMakeLists.txt); its examples, benches, tools and Python
// module are header-only, as a user builds them.
#pragma once

#ifndef KVLINK_SEPARATE_COMPILATION
#error "<kvlink/separate.hpp> is for programs built with KVLINK_SEPARATE_COMPILATION"
#endif

#include <kvlink/engine.hpp>
#include <kvlink/engine/backends.hpp>

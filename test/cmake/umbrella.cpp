// consumer.clang_*_coroutine_flags: the umbrella header, compiled by clang++
// with and without the defines kvlink's flags carry (test/cmake/CMakeLists.txt).
#include <kvlink/kvlink.hpp>

int main() { return 0; }

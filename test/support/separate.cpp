// The engine's transports and metadata backends for every test program,
// compiled once (include/kvlink/separate.hpp): test/CMakeLists.txt
// builds this into kvlink_test_engine, which defines
// KVLINK_SEPARATE_COMPILATION for the programs that link it.
#include <kvlink/separate.hpp>

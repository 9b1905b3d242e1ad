// KVLINK_DECL: how the functions <kvlink/separate.hpp> can compile once per
// program are declared. Header-only (the default) they are `inline`,
// defined in every translation unit that includes the engine; with
// KVLINK_SEPARATE_COMPILATION they are ordinary functions, defined in the
// one translation unit that includes <kvlink/separate.hpp>.
#pragma once

#ifdef KVLINK_SEPARATE_COMPILATION
#define KVLINK_DECL
#else
#define KVLINK_DECL inline
#endif

// kvlink_metadata_test's main: doctest, except that the etcd suites
// ("etcd", "example-etcd") report themselves skipped (exit 77, ctest's
// SKIP_RETURN_CODE) when no etcd binary is installed (apt-get install
// etcd-server) instead of failing, unless KVLINK_REQUIRE_ETCD=1 (CI).
#define DOCTEST_CONFIG_IMPLEMENT
#include <cstdio>
#include <string_view>

#include "etcd_binary.hpp"
#include <doctest/doctest.h>

int main(int argc, char** argv) {
  bool etcd_suite = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]).find("etcd") != std::string_view::npos) etcd_suite = true;
  }
  if (etcd_suite && kvlink_meta::etcd_binary().empty()) return kvlink_meta::without_etcd();
  doctest::Context context(argc, argv);
  return context.run();
}

# Conan 2 recipe for kvlink, a header-only library.
#
# Not run on kvlink's build machine (Conan is not installed there): ctest
# builds test_package/ with plain CMake against `cmake --install` instead,
# which checks test_package but not this recipe. To use it:
#   conan create . --build=missing [-o kvlink/*:with_rdma=False]
import os
import re

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy, load
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class KvlinkConan(ConanFile):
    name = "kvlink"
    description = "Moves KV cache between LLM serving processes over TCP and RDMA"
    topics = ("llm", "kv-cache", "rdma", "asio", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {"with_rdma": [True, False]}
    default_options = {"with_rdma": True}
    # Only the headers are packaged. Conan's CMakeDeps / PkgConfigDeps make the
    # consumer's kvlink::kvlink / kvlink::rdma from package_info(): kvlink's
    # own kvlinkConfig.cmake and kvlink.pc would look for the system's
    # dependencies, not Conan's.
    exports_sources = "include/*", "LICENSE*"
    no_copy_source = True

    def set_version(self):
        # The version lives in include/kvlink/version.hpp only.
        header = load(self, os.path.join(self.recipe_folder, "include", "kvlink", "version.hpp"))
        parts = [re.search(rf"#define KVLINK_VERSION_{p} (\d+)", header).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def config_options(self):
        # rdma-core (libibverbs) is Linux only.
        if self.settings.os != "Linux":
            del self.options.with_rdma

    def layout(self):
        basic_layout(self, src_folder=".")

    def requirements(self):
        # Headers of the dependencies appear in kvlink's headers.
        self.requires("asio/1.30.2", transitive_headers=True)
        self.requires("fmt/10.2.1", transitive_headers=True, transitive_libs=True)
        self.requires("nlohmann_json/3.11.3", transitive_headers=True)
        self.requires("libsodium/cci.20220430", transitive_headers=True, transitive_libs=True)
        if self.options.get_safe("with_rdma"):
            self.requires("rdma-core/52.0", transitive_headers=True, transitive_libs=True)

    def package_id(self):
        # Header-only: one package whatever the compiler or build type; the
        # with_rdma option still tells packages apart.
        self.info.settings.clear()
        self.info.requires.clear()

    def validate(self):
        if self.settings.compiler.get_safe("cppstd"):
            check_min_cppstd(self, 20)
        if self.options.get_safe("with_rdma") and self.settings.os != "Linux":
            raise ConanInvalidConfiguration("kvlink's RDMA transport needs Linux (rdma-core)")

    def build(self):
        pass  # header-only: nothing to build

    def package(self):
        copy(self, "LICENSE*", src=self.source_folder, dst=os.path.join(self.package_folder, "licenses"))
        copy(self, "*.hpp", src=os.path.join(self.source_folder, "include"),
             dst=os.path.join(self.package_folder, "include"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "kvlink")
        self.cpp_info.set_property("pkg_config_name", "kvlink")

        # The component is called "core", not "kvlink": a component named like
        # its package is rejected by some Conan versions. Its CMake target is
        # still kvlink::kvlink.
        core = self.cpp_info.components["core"]
        core.set_property("cmake_target_name", "kvlink::kvlink")
        core.set_property("pkg_config_name", "kvlink")
        core.bindirs = []
        core.libdirs = []
        core.requires = ["asio::asio", "fmt::fmt", "nlohmann_json::nlohmann_json", "libsodium::libsodium"]
        # What kvlink's own asio::asio target adds (Conan's asio package
        # already defines ASIO_STANDALONE).
        core.defines = [
            "ASIO_STANDALONE", "ASIO_NO_DEPRECATED", "ASIO_HAS_CO_AWAIT=1", "ASIO_HAS_STD_COROUTINE=1"
        ]
        if self.settings.os in ("Linux", "FreeBSD"):
            core.system_libs = ["pthread"]

        if self.options.get_safe("with_rdma"):
            rdma = self.cpp_info.components["rdma"]
            rdma.set_property("cmake_target_name", "kvlink::rdma")
            rdma.set_property("pkg_config_name", "kvlink-rdma")
            rdma.bindirs = []
            rdma.libdirs = []
            rdma.requires = ["core", "rdma-core::libibverbs"]

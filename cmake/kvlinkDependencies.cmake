# Finds kvlink's dependencies. Each one names the Debian package that provides
# it when it is missing. Used both by the build and by kvlinkConfig.cmake.
include(CMakeFindDependencyMacro)

# From kvlinkConfig.cmake (_kvlink_from_config set) a missing dependency makes
# find_package(kvlink) fail the way find_dependency() does: kvlink_FOUND FALSE
# with the message, and return() leaves this file (a macro runs in the
# including file's scope). A build of kvlink itself stops with FATAL_ERROR.
macro(_kvlink_require _found _what _pkg)
  if(NOT ${_found})
    if(_kvlink_from_config)
      set(kvlink_FOUND FALSE)
      set(kvlink_NOT_FOUND_MESSAGE "kvlink: ${_what} not found. On Debian/Ubuntu: apt-get install ${_pkg}")
      return()
    endif()
    message(FATAL_ERROR "kvlink: ${_what} not found. On Debian/Ubuntu: apt-get install ${_pkg}")
  endif()
endmacro()

# Standalone Asio ships no CMake config: make an imported target.
if(NOT TARGET asio::asio)
  find_path(KVLINK_ASIO_INCLUDE_DIR asio.hpp)
  _kvlink_require(KVLINK_ASIO_INCLUDE_DIR "standalone Asio (asio.hpp)" libasio-dev)
  find_package(Threads REQUIRED)
  add_library(asio::asio INTERFACE IMPORTED)
  set_target_properties(asio::asio PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${KVLINK_ASIO_INCLUDE_DIR}"
    INTERFACE_COMPILE_DEFINITIONS "ASIO_STANDALONE;ASIO_NO_DEPRECATED"
    INTERFACE_LINK_LIBRARIES Threads::Threads)
endif()

if(NOT TARGET fmt::fmt)
  find_package(fmt QUIET)
  _kvlink_require(fmt_FOUND "{fmt}" libfmt-dev)
endif()
if(NOT TARGET nlohmann_json::nlohmann_json)
  find_package(nlohmann_json 3 QUIET)
  _kvlink_require(nlohmann_json_FOUND "nlohmann/json" nlohmann-json3-dev)
endif()

# libsodium: the shared-secret authentication of peers (HMAC-SHA-256).
if(NOT TARGET kvlink_sodium)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(KVLINK_SODIUM QUIET IMPORTED_TARGET libsodium)
  endif()
  _kvlink_require(KVLINK_SODIUM_FOUND "libsodium (pkg-config libsodium)" "libsodium-dev pkg-config")
  add_library(kvlink_sodium INTERFACE IMPORTED)
  set_target_properties(kvlink_sodium PROPERTIES INTERFACE_LINK_LIBRARIES PkgConfig::KVLINK_SODIUM)
endif()

if(KVLINK_WITH_RDMA AND NOT TARGET kvlink_ibverbs)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(KVLINK_IBVERBS QUIET IMPORTED_TARGET libibverbs)
  endif()
  if(KVLINK_IBVERBS_FOUND)
    add_library(kvlink_ibverbs INTERFACE IMPORTED)
    set_target_properties(kvlink_ibverbs PROPERTIES INTERFACE_LINK_LIBRARIES PkgConfig::KVLINK_IBVERBS)
  else()
    message(STATUS "kvlink: libibverbs not found, kvlink::rdma not built (apt-get install libibverbs-dev librdmacm-dev pkg-config)")
  endif()
endif()

# OpenSSL: TLS to a metadata store (kvlink::tls, include/kvlink/metadata/tls.hpp).
if(KVLINK_WITH_TLS AND NOT TARGET kvlink_openssl)
  find_package(OpenSSL QUIET)
  if(OPENSSL_FOUND)
    add_library(kvlink_openssl INTERFACE IMPORTED)
    set_target_properties(kvlink_openssl PROPERTIES INTERFACE_LINK_LIBRARIES "OpenSSL::SSL;OpenSSL::Crypto")
  else()
    message(STATUS "kvlink: OpenSSL not found, kvlink::tls not built (apt-get install libssl-dev)")
  endif()
endif()

# CUDA: kvlink::cuda needs the toolkit's headers only (cuda.h, cudaTypedefs.h):
# the driver (libcuda.so.1) is loaded at run time with dlopen, so nothing CUDA
# is linked and a program built with it runs where no driver is installed.
if(KVLINK_WITH_CUDA AND NOT TARGET kvlink_cuda_headers)
  find_package(CUDAToolkit QUIET)
  find_path(KVLINK_CUDA_INCLUDE_DIR NAMES cuda.h cudaTypedefs.h
    HINTS ${CUDAToolkit_INCLUDE_DIRS} "$ENV{CUDA_HOME}/include" "$ENV{CUDA_PATH}/include"
    PATHS /usr/local/cuda/include)
  if(KVLINK_CUDA_INCLUDE_DIR AND EXISTS "${KVLINK_CUDA_INCLUDE_DIR}/cudaTypedefs.h")
    add_library(kvlink_cuda_headers INTERFACE IMPORTED)
    set_target_properties(kvlink_cuda_headers PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${KVLINK_CUDA_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES "${CMAKE_DL_LIBS}")
  else()
    message(STATUS "kvlink: CUDA headers (cuda.h) not found, kvlink::cuda not built (install the CUDA toolkit or set CUDAToolkit_ROOT)")
  endif()
endif()

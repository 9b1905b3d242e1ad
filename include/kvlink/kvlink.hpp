// kvlink: the umbrella header. Everything but the RDMA layer (kvlink/rdma.hpp
// and kvlink/rdma/, which need libibverbs), TLS to a metadata store
// (kvlink/metadata/tls.hpp, which needs OpenSSL) and CUDA support.
#pragma once

#include <kvlink/control/channel.hpp>
#include <kvlink/control/descriptor.hpp>
#include <kvlink/control/handshake.hpp>
#include <kvlink/control/message.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/settings.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/engine.hpp>
#include <kvlink/engine/config.hpp>
#include <kvlink/kv/block_transfer.hpp>
#include <kvlink/kv/layout.hpp>
#include <kvlink/metadata/backend.hpp>
#include <kvlink/metadata/config.hpp>
#include <kvlink/metadata/etcd.hpp>
#include <kvlink/metadata/http.hpp>
#include <kvlink/metadata/p2p.hpp>
#include <kvlink/planner/slice_planner.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/tcp/transport.hpp>
#include <kvlink/transport/set.hpp>
#include <kvlink/transport/transport.hpp>
#include <kvlink/version.hpp>

// kvlink: the umbrella header. Everything but the RDMA layer (kvlink/rdma/,
// which needs libibverbs) and CUDA support.
#pragma once

#include <kvlink/control/message.hpp>
#include <kvlink/core/config.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/core/instance.hpp>
#include <kvlink/core/segment_registry.hpp>
#include <kvlink/core/types.hpp>
#include <kvlink/engine.hpp>
#include <kvlink/kv/block_transfer.hpp>
#include <kvlink/kv/layout.hpp>
#include <kvlink/planner/slice_planner.hpp>
#include <kvlink/tcp/frame.hpp>
#include <kvlink/tcp/lane.hpp>
#include <kvlink/version.hpp>

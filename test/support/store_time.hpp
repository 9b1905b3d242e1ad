// Made-up time points for the store master's logic, which is given `now`
// and never reads a clock (store/master/config.hpp).
#pragma once

#include <kvlink/store/master/config.hpp>

#include <chrono>
#include <cstdint>

namespace kvlink_test {

/// The master time `ms` milliseconds after the clock's epoch.
inline kvlink::store::master_time at(std::int64_t ms) {
  return kvlink::store::master_time{std::chrono::milliseconds{ms}};
}

}  // namespace kvlink_test

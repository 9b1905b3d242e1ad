// The listener: binds the engine's listen address when the engine is made,
// accepts connections (backing off on errors such as EMFILE instead of
// spinning), runs the accepting side of the handshake on each one
// concurrently, within connect_timeout, and hands the connection to its
// owner: the engine's control sessions, or the transport a lane names.
#pragma once

#include <kvlink/control/handshake.hpp>
#include <kvlink/control/socket.hpp>
#include <kvlink/core/address.hpp>
#include <kvlink/core/error.hpp>
#include <kvlink/detail/coroutines.hpp>
#include <kvlink/detail/log.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>

#include <arpa/inet.h>
#include <asio/any_io_executor.hpp>
#include <asio/awaitable.hpp>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>
#include <fmt/format.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <nlohmann/json.hpp>
#include <sys/resource.h>

namespace kvlink::detail {

/// The IPv4 address of the first up, non-loopback interface, or "" when
/// there is none.
inline std::string first_interface_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string out;
  for (ifaddrs* a = list; a != nullptr && out.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_UP) == 0 || (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char buf[INET_ADDRSTRLEN] = {};
    const auto* sin = reinterpret_cast<const sockaddr_in*>(a->ifa_addr);
    if (::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf) != nullptr) out = buf;
  }
  ::freeifaddrs(list);
  return out;
}

/// Whether `host` is a wildcard address (0.0.0.0, ::).
inline bool is_unspecified_host(std::string_view host) {
  std::error_code ec;
  const auto a = asio::ip::make_address(std::string(host), ec);
  return !ec && a.is_unspecified();
}

/// Open inbound connections, in total and per remote address, within
/// limits. A connection holds a lease (a shared_ptr) while it is open; the
/// count drops when the last copy of its lease goes.
class connection_limits : public std::enable_shared_from_this<connection_limits> {
 public:
  /// The configured limits, lowered to fit the process's file descriptor
  /// limit (less 64 kept for the engine's own connections and the user's).
  connection_limits(std::size_t max_total, std::size_t max_per_address) {
    rlimit rl{};
    std::size_t fd_room = max_total;
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
      fd_room = rl.rlim_cur > 80 ? static_cast<std::size_t>(rl.rlim_cur) - 64 : 16;
    }
    max_total_ = std::min(max_total, fd_room);
    max_per_address_ = std::min(max_per_address, std::max<std::size_t>(max_total_ / 2, 1));
  }

  std::size_t max_total() const noexcept { return max_total_; }
  std::size_t max_per_address() const noexcept { return max_per_address_; }

  /// A lease for a connection from `address`, or null (with the limit it
  /// would break in `which`).
  std::shared_ptr<void> acquire(const std::string& address, std::string& which) {
    std::lock_guard lock{m_};
    auto& mine = by_address_[address];
    if (total_ >= max_total_) {
      which = fmt::format("max_connections ({})", max_total_);
    } else if (mine >= max_per_address_) {
      which = fmt::format("max_connections_per_address ({})", max_per_address_);
    } else {
      ++total_;
      ++mine;
      return std::make_shared<lease>(shared_from_this(), address);
    }
    if (mine == 0) by_address_.erase(address);
    return nullptr;
  }

  /// Whether a refusal of `address` for `which` is the first: each is logged once.
  bool first_refusal(const std::string& address, const std::string& which) {
    std::lock_guard lock{m_};
    return logged_.insert(which + " " + address).second;
  }

  std::size_t open() const {
    std::lock_guard lock{m_};
    return total_;
  }

 private:
  struct lease {
    lease(std::shared_ptr<connection_limits> o, std::string a)
        : owner(std::move(o)), address(std::move(a)) {}
    ~lease() { owner->release(address); }
    lease(const lease&) = delete;
    lease& operator=(const lease&) = delete;
    std::shared_ptr<connection_limits> owner;
    std::string address;
  };

  void release(const std::string& address) {
    std::lock_guard lock{m_};
    --total_;
    auto it = by_address_.find(address);
    if (it != by_address_.end() && --it->second == 0) by_address_.erase(it);
  }

  mutable std::mutex m_;
  std::size_t max_total_ = 0;
  std::size_t max_per_address_ = 0;
  std::size_t total_ = 0;
  std::unordered_map<std::string, std::size_t> by_address_;
  std::set<std::string> logged_;
};

/// Who the listener hands connections to (the engine core).
class connection_owner {
 public:
  /// The secret (if any), this engine's instance, its sessions' keys.
  virtual const control::server_auth& server_auth() const = 0;
  /// Decides on a hello that passed authentication: an error refuses the
  /// connection (the peer is told why); otherwise `answer` is the welcome.
  virtual std::error_code admit(const control::hello& h, const control::session_keys& session,
                                nlohmann::json& answer) = 0;
  /// Takes an admitted connection; `lease` is held while it is open.
  virtual void adopt(asio::ip::tcp::socket socket, control::hello h, control::session_keys session,
                     std::shared_ptr<void> lease) = 0;

 protected:
  ~connection_owner() = default;
};

class listener {
 public:
  struct limits {
    std::chrono::milliseconds handshake_timeout{5000};
    control::socket_options socket;
    std::size_t max_connections = 4096;
    std::size_t max_connections_per_address = 65535;
  };

  /// Binds and listens on `address` ("host:port"; port 0 = any). Throws
  /// std::system_error (not host:port, cannot resolve, address in use).
  listener(const asio::any_io_executor& ex, const std::string& address, limits l)
      : acceptor_(ex),
        limits_(l),
        count_(
            std::make_shared<connection_limits>(l.max_connections, l.max_connections_per_address)) {
    std::string_view host;
    std::uint16_t port = 0;
    if (!split_host_port(address, host, port)) {
      throw std::system_error(make_error_code(errc::invalid_argument),
                              fmt::format("kvlink: listen address '{}' is not host:port", address));
    }
    asio::ip::tcp::resolver resolver(ex);
    std::error_code ec;
    const auto results = resolver.resolve(std::string(host), std::to_string(port),
                                          asio::ip::tcp::resolver::passive, ec);
    if (ec || results.empty()) {
      throw std::system_error(ec ? ec : make_error_code(errc::invalid_argument),
                              fmt::format("kvlink: cannot resolve listen address '{}'", address));
    }
    const auto ep = results.begin()->endpoint();
    acceptor_.open(ep.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    acceptor_.bind(ep, ec);
    if (ec) throw std::system_error(ec, fmt::format("kvlink: bind({})", address));
    acceptor_.listen(asio::socket_base::max_listen_connections);
    local_address_ = control::format_endpoint(acceptor_.local_endpoint());
  }

  /// host:port it listens on (the real port when port 0 was asked for).
  const std::string& local_address() const noexcept { return local_address_; }
  /// The connection limits in force, and how many are open.
  const connection_limits& connections() const noexcept { return *count_; }

  /// Starts accepting; connections go to `owner` while `alive` is held.
  template <class Owner>
  void start(std::shared_ptr<Owner> owner) {
    asio::co_spawn(acceptor_.get_executor(), accept_loop(this, std::move(owner)), asio::detached);
  }

  void close() {
    closed_ = true;
    std::error_code ignored;
    acceptor_.close(ignored);
  }

 private:
  // `self` outlives the loop: the owner holds the listener and the loop holds
  // the owner.
  template <class Owner>
  static asio::awaitable<void> accept_loop(listener* self, std::shared_ptr<Owner> owner) {
    for (;;) {
      asio::ip::tcp::socket s(self->acceptor_.get_executor());
      auto [ec] = co_await self->acceptor_.async_accept(s, control::use_nothrow);
      if (self->closed_ || !self->acceptor_.is_open()) co_return;
      if (ec) {
        // EMFILE and friends: back off instead of spinning on the error.
        asio::steady_timer pause(self->acceptor_.get_executor(), std::chrono::milliseconds(50));
        co_await pause.async_wait(control::use_nothrow);
        continue;
      }
      std::error_code rec;
      const auto from = s.remote_endpoint(rec);
      const std::string address = rec ? std::string("?") : from.address().to_string();
      std::string which;
      auto lease = self->count_->acquire(address, which);
      if (!lease) {
        if (self->count_->first_refusal(address, which)) {
          log("refused a connection from {}: {} reached (logged once per address)", address, which);
        }
        std::error_code ignored;
        s.close(ignored);
        continue;
      }
      asio::co_spawn(self->acceptor_.get_executor(),
                     serve(self->limits_, owner, std::move(s), std::move(lease)), asio::detached);
    }
  }

  template <class Owner>
  static asio::awaitable<void> serve(limits l, std::shared_ptr<Owner> owner,
                                     asio::ip::tcp::socket s, std::shared_ptr<void> lease) {
    control::hello hello;
    control::session_keys session;
    {
      control::watchdog dog(s.get_executor(), s, l.handshake_timeout);
      if (co_await control::server_handshake(s, control::max_handshake_message,
                                             owner->server_auth(), hello, session)) {
        co_return;
      }
      nlohmann::json answer;
      if (auto ec = owner->admit(hello, session, answer)) {
        // Named, not a temporary inside co_await (g++ 12 destroys those wrongly).
        const nlohmann::json refusal = control::make_error(ec);
        if (!dog.fired()) (void)co_await control::server_answer(s, refusal);
        co_return;
      }
      control::tune_socket(s, l.socket);
      if (co_await control::server_answer(s, answer) || dog.fired()) co_return;
    }
    owner->adopt(std::move(s), std::move(hello), std::move(session), std::move(lease));
  }

  asio::ip::tcp::acceptor acceptor_;
  limits limits_;
  std::shared_ptr<connection_limits> count_;
  std::string local_address_;
  bool closed_ = false;
};

}  // namespace kvlink::detail

// TLS for the metadata store connections (etcd with https endpoints and
// client certificates, an https:// HTTP metadata server), with asio::ssl
// over OpenSSL. Including this header puts TLS in the program; link
// kvlink::tls (OpenSSL, from libssl-dev). Without it, an engine whose
// settings ask for TLS refuses to start and says what to include.
//
//   #include <kvlink/engine.hpp>
//   #include <kvlink/metadata/tls.hpp>
//   kvlink::config c;
//   c.metadata.url = "etcd://10.0.0.1:2379";
//   c.metadata.tls_ca = "/etc/etcd/ca.pem";           // checks etcd's certificate and name
//   c.metadata.tls_cert = "/etc/kvlink/client.pem";   // for --client-cert-auth
//   c.metadata.tls_key = "/etc/kvlink/client-key.pem";
//
// The store's certificate is checked against the CA (or the system's CAs
// when metadata_tls_ca is empty) and against the host name or IP address of
// the endpoint. TLS 1.2 or later.
#pragma once

#include <kvlink/detail/coroutines.hpp>
#include <kvlink/metadata/http_client.hpp>

#include <memory>
#include <string>
#include <system_error>

#include <asio/connect.hpp>
#include <asio/ssl.hpp>
#include <openssl/ssl.h>

namespace kvlink::detail::http {

class tls_stream final : public stream {
 public:
  tls_stream(const asio::any_io_executor& ex, asio::ssl::context& ctx, std::string host,
             std::shared_ptr<void> keep_ctx)
      : keep_(std::move(keep_ctx)), stream_(ex, ctx), host_(std::move(host)) {}

  asio::awaitable<std::error_code> connect(
      const asio::ip::tcp::resolver::results_type& endpoints) override {
    auto [ec, ep] = co_await asio::async_connect(stream_.lowest_layer(), endpoints, nothrow);
    (void)ep;
    if (ec) co_return ec;
    std::error_code ignored;
    stream_.lowest_layer().set_option(asio::ip::tcp::no_delay{true}, ignored);
    // SNI for a host name; the certificate is checked against the name or
    // the IP address either way.
    std::error_code aec;
    asio::ip::make_address(host_, aec);
    if (aec) {
      // SSL_set_tlsext_host_name, without its macro's C cast.
      SSL_ctrl(stream_.native_handle(), SSL_CTRL_SET_TLSEXT_HOSTNAME, TLSEXT_NAMETYPE_host_name,
               const_cast<char*>(host_.c_str()));
    }
    stream_.set_verify_callback(asio::ssl::host_name_verification(host_));
    auto [hec] = co_await stream_.async_handshake(asio::ssl::stream_base::client, nothrow);
    co_return hec;
  }
  asio::awaitable<std::size_t> read_some(asio::mutable_buffer b, std::error_code& ec) override {
    auto [e, n] = co_await stream_.async_read_some(b, nothrow);
    // A peer that closes without close_notify: the end of the stream.
    ec = e == asio::ssl::error::stream_truncated ? std::error_code{asio::error::eof} : e;
    co_return n;
  }
  asio::awaitable<std::error_code> write_all(asio::const_buffer b) override {
    auto [e, n] = co_await asio::async_write(stream_, b, nothrow);
    (void)n;
    co_return e;
  }
  void close() noexcept override {
    std::error_code ignored;
    stream_.lowest_layer().close(ignored);
  }

 private:
  std::shared_ptr<void> keep_;  // the context outlives the stream
  asio::ssl::stream<asio::ip::tcp::socket> stream_;
  std::string host_;
};

class openssl_context final : public tls_context,
                              public std::enable_shared_from_this<openssl_context> {
 public:
  openssl_context() : ctx_(asio::ssl::context::tls_client) {}

  /// Loads the files; false with `what` naming the file and OpenSSL's reason.
  bool load(const tls_files& files, std::string& what) {
    std::error_code ec;
    ctx_.set_options(asio::ssl::context::default_workarounds | asio::ssl::context::no_sslv2 |
                         asio::ssl::context::no_sslv3 | asio::ssl::context::no_tlsv1 |
                         asio::ssl::context::no_tlsv1_1,
                     ec);
    ctx_.set_verify_mode(asio::ssl::verify_peer, ec);
    if (files.ca.empty()) {
      ctx_.set_default_verify_paths(ec);
    } else {
      ctx_.load_verify_file(files.ca, ec);
    }
    if (ec) {
      what = "metadata_tls_ca \"" + files.ca + "\": " + ec.message();
      return false;
    }
    if (!files.cert.empty()) {
      ctx_.use_certificate_chain_file(files.cert, ec);
      if (ec) {
        what = "metadata_tls_cert \"" + files.cert + "\": " + ec.message();
        return false;
      }
      ctx_.use_private_key_file(files.key, asio::ssl::context::pem, ec);
      if (ec) {
        what = "metadata_tls_key \"" + files.key + "\": " + ec.message();
        return false;
      }
    }
    return true;
  }

  std::shared_ptr<stream> make_stream(const asio::any_io_executor& ex,
                                      const std::string& host) override {
    return std::make_shared<tls_stream>(ex, ctx_, host, shared_from_this());
  }

 private:
  asio::ssl::context ctx_;
};

inline std::shared_ptr<tls_context> load_openssl(const tls_files& files, std::string& what) {
  auto ctx = std::make_shared<openssl_context>();
  if (!ctx->load(files, what)) return nullptr;
  return ctx;
}

// Including this header is what puts TLS in the program.
inline const bool tls_in_program = (tls_support() = &load_openssl, true);

}  // namespace kvlink::detail::http

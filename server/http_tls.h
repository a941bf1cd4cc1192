// The HTTP API's TLS server identity (--tls-cert, --tls-key) and client verification
// (--tls-client-ca), set up on cpp-httplib's OpenSSL context. The certificate and key are read
// again when their files change (looked at, at most, every `refresh` on a handshake), as gRPC's
// file watcher does for the gRPC listener: cert-manager's renewals apply to new connections
// without a restart. A pair that does not load (a half-written file, a key that is not the
// certificate's) keeps the one in use, with a warning. The client CA is read at start.
#pragma once

#include <openssl/ssl.h>

#include <chrono>
#include <ctime>
#include <memory>
#include <mutex>

#include "common/status.h"
#include "common/tls.h"

namespace baton {

class TlsIdentity {
 public:
  // Files checked with check_tls_files first; INVALID_ARGUMENT when they do not load.
  static Result<std::shared_ptr<TlsIdentity>> load(const TlsFiles& files, std::chrono::seconds refresh);
  ~TlsIdentity();
  TlsIdentity(const TlsIdentity&) = delete;
  TlsIdentity& operator=(const TlsIdentity&) = delete;

  // Sets `ctx` up: TLS 1.2 or newer, this identity on every handshake, and client certificates
  // required and verified against the CA when one is given. False when OpenSSL refuses.
  bool configure(SSL_CTX& ctx);

 private:
  struct Pair;  // certificate chain + key, as OpenSSL objects
  TlsIdentity(TlsFiles files, std::chrono::seconds refresh) : files_(std::move(files)), refresh_(refresh) {}
  // The chain in `cert` and the key in `key`, when they load and belong together; else null.
  static std::shared_ptr<const Pair> read_pair(const std::string& cert, const std::string& key);
  // The pair for a new handshake, re-read first when the files changed.
  std::shared_ptr<const Pair> current();
  static int on_handshake(SSL* ssl, void* self);

  const TlsFiles files_;
  const std::chrono::seconds refresh_;
  std::mutex mu_;
  std::shared_ptr<const Pair> pair_;                  // guarded by mu_
  struct timespec cert_mtime_ {}, key_mtime_ {};      // guarded by mu_
  std::chrono::steady_clock::time_point checked_{};  // guarded by mu_
};

}  // namespace baton

#include "server/http_tls.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <cstdio>

namespace baton {

struct TlsIdentity::Pair {
  X509* leaf = nullptr;
  STACK_OF(X509)* chain = nullptr;  // the certificates after the leaf
  EVP_PKEY* key = nullptr;
  ~Pair() {
    X509_free(leaf);
    sk_X509_pop_free(chain, X509_free);
    EVP_PKEY_free(key);
  }
};

namespace {

struct timespec mtime_of(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 ? st.st_mtim : timespec{};
}

bool same_time(const timespec& a, const timespec& b) { return a.tv_sec == b.tv_sec && a.tv_nsec == b.tv_nsec; }

}  // namespace

std::shared_ptr<const TlsIdentity::Pair> TlsIdentity::read_pair(const std::string& cert_path,
                                                                const std::string& key_path) {
  auto pair = std::make_shared<Pair>();
  if (FILE* f = std::fopen(cert_path.c_str(), "r")) {
    pair->leaf = PEM_read_X509(f, nullptr, nullptr, nullptr);
    pair->chain = sk_X509_new_null();
    while (X509* x = PEM_read_X509(f, nullptr, nullptr, nullptr)) sk_X509_push(pair->chain, x);
    std::fclose(f);
  }
  if (FILE* f = std::fopen(key_path.c_str(), "r")) {
    pair->key = PEM_read_PrivateKey(f, nullptr, nullptr, nullptr);
    std::fclose(f);
  }
  const bool ok = pair->leaf != nullptr && pair->key != nullptr && X509_check_private_key(pair->leaf, pair->key) == 1;
  ERR_clear_error();  // reading to the end of the chain leaves an error behind
  return ok ? pair : nullptr;
}

Result<std::shared_ptr<TlsIdentity>> TlsIdentity::load(const TlsFiles& files, std::chrono::seconds refresh) {
  auto id = std::shared_ptr<TlsIdentity>(new TlsIdentity(files, refresh));
  id->cert_mtime_ = mtime_of(files.cert);
  id->key_mtime_ = mtime_of(files.key);
  id->pair_ = read_pair(files.cert, files.key);
  if (id->pair_ == nullptr) {
    return invalid_argument("--tls-cert / --tls-key: '" + files.cert + "' and '" + files.key +
                            "' do not load as a certificate and its private key");
  }
  id->checked_ = std::chrono::steady_clock::now();
  return id;
}

TlsIdentity::~TlsIdentity() = default;

std::shared_ptr<const TlsIdentity::Pair> TlsIdentity::current() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = std::chrono::steady_clock::now();
  if (now - checked_ < refresh_) return pair_;
  checked_ = now;
  const timespec cert = mtime_of(files_.cert), key = mtime_of(files_.key);
  if (same_time(cert, cert_mtime_) && same_time(key, key_mtime_)) return pair_;
  if (auto fresh = read_pair(files_.cert, files_.key)) {
    pair_ = std::move(fresh);
    cert_mtime_ = cert;
    key_mtime_ = key;
    spdlog::info("HTTP API: read the rotated certificate '{}'", files_.cert);
  } else {
    // Possibly a rotation caught half-way (the key written, not yet the certificate): the next
    // look tries again.
    spdlog::warn("HTTP API: '{}' and '{}' changed but do not load as a pair; keeping the certificate in use",
                 files_.cert, files_.key);
  }
  return pair_;
}

int TlsIdentity::on_handshake(SSL* ssl, void* self) {
  const std::shared_ptr<const Pair> p = static_cast<TlsIdentity*>(self)->current();
  return SSL_use_cert_and_key(ssl, p->leaf, p->key, p->chain, /*override=*/1) == 1 ? 1 : 0;
}

bool TlsIdentity::configure(SSL_CTX& ctx) {
  SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
  SSL_CTX_set_options(&ctx, SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  // cpp-httplib holds the context for the server's life; HttpApi holds this identity longer.
  SSL_CTX_set_cert_cb(&ctx, &TlsIdentity::on_handshake, this);
  if (!files_.ca.empty()) {
    if (SSL_CTX_load_verify_locations(&ctx, files_.ca.c_str(), nullptr) != 1) return false;
    SSL_CTX_set_client_CA_list(&ctx, SSL_load_client_CA_file(files_.ca.c_str()));
    SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  }
  return true;
}

}  // namespace baton

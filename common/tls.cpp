#include "common/tls.h"

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_certificate_verifier.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <arpa/inet.h>
#include <netdb.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace baton {
namespace {

Result<std::string> read_file(const std::string& path, const std::string& flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found(flag + ": cannot read '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Deleter {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using BioPtr = std::unique_ptr<BIO, BioDeleter>;
using X509Ptr = std::unique_ptr<X509, X509Deleter>;

BioPtr bio_of(const std::string& pem) { return BioPtr(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()))); }

// Every certificate in a PEM bundle; empty when none parses.
std::vector<X509Ptr> parse_certificates(const std::string& pem) {
  std::vector<X509Ptr> out;
  BioPtr bio = bio_of(pem);
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  return out;
}

Status check_certificate(const std::string& pem, const std::string& path, const std::string& flag,
                         std::vector<X509Ptr>* certs) {
  *certs = parse_certificates(pem);
  if (certs->empty()) return invalid_argument(flag + ": '" + path + "' holds no PEM certificate");
  X509* leaf = certs->front().get();
  if (X509_cmp_current_time(X509_get0_notAfter(leaf)) < 0) {
    return invalid_argument(flag + ": the certificate in '" + path + "' has expired");
  }
  if (X509_cmp_current_time(X509_get0_notBefore(leaf)) > 0) {
    return invalid_argument(flag + ": the certificate in '" + path + "' is not valid yet (check the clock)");
  }
  return {};
}

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> file_provider(const TlsFiles& files,
                                                                                  std::chrono::seconds refresh) {
  const auto seconds = static_cast<unsigned>(std::max<int64_t>(1, refresh.count()));
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(files.key, files.cert, files.ca, seconds);
}

}  // namespace

// "ipv6:[::1]:5" → "ipv6:[::1]"; anything that is not ipv4:/ipv6: whole.
std::string peer_host(const std::string& peer) {
  if (peer.rfind("ipv4:", 0) != 0 && peer.rfind("ipv6:", 0) != 0) return peer;
  const size_t colon = peer.rfind(':');
  std::string host = colon > 5 ? peer.substr(0, colon) : peer;
  // An IPv4 peer of a dual-stack listener ("ipv6:[::ffff:10.0.0.7]") is that IPv4 address.
  constexpr std::string_view kMapped = "ipv6:[::ffff:";
  if (host.rfind(kMapped, 0) == 0 && host.back() == ']' && host.find('.') != std::string::npos) {
    host = "ipv4:" + host.substr(kMapped.size(), host.size() - kMapped.size() - 1);
  }
  return host;
}

std::vector<std::string> peer_hosts_of(const std::string& address) {
  std::string host = address;
  if (!host.empty() && host.front() == '[') {
    const size_t end = host.find(']');
    host = host.substr(1, end == std::string::npos ? std::string::npos : end - 1);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char buf[INET6_ADDRSTRLEN] = {};
    std::string h;
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, buf, sizeof buf);
      h = std::string("ipv4:") + buf;
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, buf, sizeof buf);
      h = std::string("ipv6:[") + buf + "]";
    } else {
      continue;
    }
    if (std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
  }
  freeaddrinfo(res);
  return out;
}

Status check_tls_files(const TlsFiles& files, const TlsFlagNames& flags, bool need_ca) {
  const std::string cert_flag = flags.cert, key_flag = flags.key, ca_flag = flags.ca;
  if (need_ca && (files.cert.empty() || files.key.empty() || files.ca.empty())) {
    return invalid_argument("mutual TLS needs all of " + cert_flag + ", " + key_flag + " and " + ca_flag);
  }
  if (files.cert.empty() != files.key.empty()) {
    return invalid_argument(cert_flag + " and " + key_flag + " go together: give both or neither");
  }
  if (!files.cert.empty()) {
    BATON_ASSIGN_OR_RETURN(std::string cert_pem, read_file(files.cert, cert_flag));
    BATON_ASSIGN_OR_RETURN(std::string key_pem, read_file(files.key, key_flag));
    std::vector<X509Ptr> chain;
    BATON_RETURN_IF_ERROR(check_certificate(cert_pem, files.cert, cert_flag, &chain));
    BioPtr bio = bio_of(key_pem);
    std::unique_ptr<EVP_PKEY, KeyDeleter> key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
    if (!key) ERR_clear_error();
    if (!key) return invalid_argument(key_flag + ": '" + files.key + "' holds no unencrypted PEM private key");
    const bool matches = X509_check_private_key(chain.front().get(), key.get()) == 1;
    ERR_clear_error();  // leave OpenSSL's error queue as gRPC expects it
    if (!matches) {
      return invalid_argument(key_flag + ": '" + files.key + "' is not the private key of the certificate in '" +
                              files.cert + "'");
    }
  }
  if (!files.ca.empty()) {
    BATON_ASSIGN_OR_RETURN(std::string ca_pem, read_file(files.ca, ca_flag));
    if (parse_certificates(ca_pem).empty()) {
      return invalid_argument(ca_flag + ": '" + files.ca + "' holds no PEM certificate");
    }
  }
  return {};
}

PlaneCredentials insecure_plane() {
  PlaneCredentials p;
  p.server = grpc::InsecureServerCredentials();
  p.channel = grpc::InsecureChannelCredentials();
  return p;
}

PlaneCredentials internal_mtls_plane(const TlsFiles& files, std::chrono::seconds refresh) {
  auto provider = file_provider(files, refresh);
  PlaneCredentials p;
  grpc::experimental::TlsServerCredentialsOptions server(provider);
  server.watch_root_certs();
  server.watch_identity_key_cert_pairs();
  server.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  p.server = grpc::experimental::TlsServerCredentials(server);

  grpc::experimental::TlsChannelCredentialsOptions channel;
  channel.set_certificate_provider(provider);
  channel.watch_root_certs();
  channel.watch_identity_key_cert_pairs();
  channel.set_verify_server_certs(true);  // the chain must reach the internal CA
  channel.set_certificate_verifier(std::make_shared<grpc::experimental::NoOpCertificateVerifier>());
  channel.set_check_call_host(false);
  p.channel = grpc::experimental::TlsCredentials(channel);
  p.authenticated = true;
  return p;
}

std::shared_ptr<grpc::ServerCredentials> public_server_credentials(const TlsFiles& files, std::chrono::seconds refresh) {
  if (files.cert.empty()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(file_provider(files, refresh));
  options.watch_identity_key_cert_pairs();
  if (!files.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

Result<std::shared_ptr<grpc::ChannelCredentials>> client_channel_credentials(const TlsFiles& files) {
  if (!files.any()) return grpc::InsecureChannelCredentials();
  BATON_RETURN_IF_ERROR(check_tls_files(files, kClientTlsFlags, false));
  grpc::SslCredentialsOptions options;
  if (!files.ca.empty()) {
    BATON_ASSIGN_OR_RETURN(options.pem_root_certs, read_file(files.ca, "--tls-ca"));
  }
  if (!files.cert.empty()) {
    BATON_ASSIGN_OR_RETURN(options.pem_cert_chain, read_file(files.cert, "--tls-cert"));
    BATON_ASSIGN_OR_RETURN(options.pem_private_key, read_file(files.key, "--tls-key"));
  }
  return grpc::SslCredentials(options);
}

namespace {

std::string certificate_of(const std::shared_ptr<const grpc::AuthContext>& auth) {
  if (!auth || !auth->IsPeerAuthenticated()) return {};
  // The whole subject (replicas of one role may share names in their SANs), else the SANs.
  std::vector<grpc::string_ref> names = auth->FindPropertyValues(GRPC_X509_SUBJECT_PROPERTY_NAME);
  if (names.empty()) names = auth->GetPeerIdentity();
  std::string id;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) id += ",";
    id.append(names[i].data(), names[i].size());
  }
  return id;
}

}  // namespace

std::string peer_certificate(const grpc::ServerContextBase& context) { return certificate_of(context.auth_context()); }
std::string peer_certificate(const grpc::ClientContext& context) { return certificate_of(context.auth_context()); }

std::string peer_identity(const grpc::ServerContextBase& context) {
  const std::string host = peer_host(context.peer());
  const std::string cert = peer_certificate(context);
  return cert.empty() ? host : host + " as " + cert;
}

bool is_loopback_address(const std::string& address) {
  if (address.rfind("unix:", 0) == 0 || address.rfind("unix-abstract:", 0) == 0) return true;
  std::string host = address;
  if (!host.empty() && host.front() == '[') {
    host = host.substr(1, host.find(']') == std::string::npos ? std::string::npos : host.find(']') - 1);
  } else if (std::count(host.begin(), host.end(), ':') == 1) {
    host = host.substr(0, host.find(':'));
  }
  if (host.empty()) return false;
  // A numeric address is judged as it is; a name by every address it resolves to, so that
  // "127.example.com" is not loopback, and a name that resolves to nothing is not either.
  in_addr v4{};
  in6_addr v6{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) return ntohl(v4.s_addr) >> 24 == 127;
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0 || found == nullptr) return false;
  bool loopback = true;
  for (const addrinfo* a = found; a != nullptr; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      loopback = loopback && ntohl(reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24 == 127;
    } else if (a->ai_family == AF_INET6) {
      loopback = loopback && IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr);
    } else {
      loopback = false;
    }
  }
  ::freeaddrinfo(found);
  return loopback;
}

bool is_loopback_peer(const std::string& peer) {
  if (peer.rfind("unix:", 0) == 0 || peer.rfind("unix-abstract:", 0) == 0) return true;
  const std::string host = peer_host(peer);  // the IPv4 form of an IPv4-mapped IPv6 peer
  return host.rfind("ipv4:127.", 0) == 0 || host == "ipv6:[::1]";
}

}  // namespace baton

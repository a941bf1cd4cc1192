// Transport security for baton's gRPC endpoints: the credentials of the two planes and of
// clients, who a caller is, and which addresses count as loopback.
//
//   public plane    clients → frontend. TLS when --tls-cert/--tls-key are given; clients must also
//                   present a certificate the --tls-client-ca signed when that is given (mTLS).
//   internal plane  frontend → prefill/decode workers, prefill → decode (KV hand-off). Mutual TLS
//                   when --internal-tls-cert/--internal-tls-key/--internal-tls-ca are given: both
//                   ends present a certificate and accept only peers whose certificate the
//                   internal CA signed. Host names are not checked: the internal CA is the
//                   deployment's own, so whatever it signed is a member (workers are reached by
//                   pod IP, which certificates rarely name).
//
// Servers read their certificate, key and CA through gRPC's file watcher: files rewritten in
// place (cert-manager's Secret volume swaps a symlink) are picked up within the refresh interval,
// without a restart, for new connections.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace baton {

// PEM files of one TLS identity and the CA that verifies peers; "" = not given.
struct TlsFiles {
  std::string cert;  // certificate chain, leaf first
  std::string key;   // the leaf's private key
  std::string ca;    // CA bundle that peers' certificates must chain to
  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

// The flags that name a TlsFiles' paths, for error messages.
struct TlsFlagNames {
  const char* cert;
  const char* key;
  const char* ca;
};
inline constexpr TlsFlagNames kPublicTlsFlags{"--tls-cert", "--tls-key", "--tls-client-ca"};
inline constexpr TlsFlagNames kInternalTlsFlags{"--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca"};
inline constexpr TlsFlagNames kClientTlsFlags{"--tls-cert", "--tls-key", "--tls-ca"};

// Checks the files before anything listens, so a mistake is an error at start and not a failed
// handshake later: cert and key come together; every given file is readable PEM; the key belongs
// to the certificate; the certificate is within its validity period. Errors name `flags`.
// `need_ca`: all three files are required (mutual TLS).
Status check_tls_files(const TlsFiles& files, const TlsFlagNames& flags, bool need_ca);

// The credentials of one plane (servers and the channels to them).
struct PlaneCredentials {
  std::shared_ptr<grpc::ServerCredentials> server;
  std::shared_ptr<grpc::ChannelCredentials> channel;
  bool authenticated = false;  // mutual TLS: peers proved they belong
};

// Plaintext, unauthenticated.
PlaneCredentials insecure_plane();
// The internal plane over mutual TLS (files checked with check_tls_files first). `refresh`:
// how often the files are looked at again.
PlaneCredentials internal_mtls_plane(const TlsFiles& files, std::chrono::seconds refresh);
// The public listener: TLS with files.cert/key; when files.ca is given, clients must present a
// certificate it signed. Insecure when no file is given.
std::shared_ptr<grpc::ServerCredentials> public_server_credentials(const TlsFiles& files, std::chrono::seconds refresh);

// A client's credentials (batonctl): TLS verifying the server's name against files.ca (the
// system roots when only a client certificate is given), presenting files.cert/key when given;
// plaintext when no file is given. Files are read now: NOT_FOUND / INVALID_ARGUMENT naming the
// flag when one cannot be used.
Result<std::shared_ptr<grpc::ChannelCredentials>> client_channel_credentials(const TlsFiles& files);

// Who is calling, as a key for "the same peer": the host part of the peer address (no port: a
// reconnected channel is the same peer) and, over TLS, the certificate's subject (its subject
// alternative names when it has no subject).
std::string peer_identity(const grpc::ServerContextBase& context);
// What a peer's TLS certificate proves (its subject, else its subject alternative names); empty
// when the peer is not authenticated (plaintext, --insecure). The server's side of a call, and
// the client's (the server it reached, once the call has run).
std::string peer_certificate(const grpc::ServerContextBase& context);
std::string peer_certificate(const grpc::ClientContext& context);

// The host part of a peer (context.peer()): "ipv4:10.0.0.7:41234" → "ipv4:10.0.0.7" (an
// IPv4-mapped IPv6 peer becomes its IPv4 form).
std::string peer_host(const std::string& peer);
// The peer hosts an address (host:port, the host a name or an IP) can connect from, in
// peer_host's form: an IP itself, a name every address it resolves to. Empty when it does not
// resolve.
std::vector<std::string> peer_hosts_of(const std::string& address);

// True for 127.0.0.0/8, ::1, a name that resolves only to those (localhost), with a port or not,
// and unix: sockets: addresses only this host can reach. Judged on the address, never on how a
// name begins ("127.example.com" is whatever it resolves to). 0.0.0.0 and [::] listen on every
// interface.
bool is_loopback_address(const std::string& address);
// True when a caller (context.peer(): "ipv4:127.0.0.1:5", "ipv6:[::1]:5", "unix:...") is on this
// host, over loopback or a unix socket.
bool is_loopback_peer(const std::string& peer);

}  // namespace baton

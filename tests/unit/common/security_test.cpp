// Transport security and API keys (common/tls.h, common/api_keys.h): which addresses count as
// loopback, how certificate files are checked at start (certificates made here with OpenSSL),
// how keys are parsed, compared and re-read. The handshakes themselves run between real
// processes in tests/integration/test_security.py.
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <thread>

#include "common/api_keys.h"
#include "common/tls.h"

namespace baton {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path;
  TempDir() {
    std::random_device rd;
    path = fs::temp_directory_path() / ("baton-security-" + std::to_string(rd()));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name, const std::string& text) const {
    std::ofstream(path / name) << text;
    return (path / name).string();
  }
};

// A P-256 key and a certificate for it, signed by `issuer` (self-signed when null), valid from
// now + not_before to now + not_after.
struct Identity {
  EVP_PKEY* key = nullptr;
  X509* cert = nullptr;
  Identity() = default;
  Identity(const Identity&) = delete;
  ~Identity() {
    X509_free(cert);
    EVP_PKEY_free(key);
  }
  std::string cert_pem() const {
    BIO* b = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(b, cert);
    return drain(b);
  }
  std::string key_pem() const {
    BIO* b = BIO_new(BIO_s_mem());
    PEM_write_bio_PrivateKey(b, key, nullptr, nullptr, 0, nullptr, nullptr);
    return drain(b);
  }
  static std::string drain(BIO* b) {
    char* data = nullptr;
    const long n = BIO_get_mem_data(b, &data);
    std::string s(data, static_cast<size_t>(n));
    BIO_free(b);
    return s;
  }
};

void make_identity(Identity& id, const std::string& cn, const Identity* issuer, long not_before_s, long not_after_s) {
  id.key = EVP_EC_gen("P-256");
  REQUIRE(id.key != nullptr);
  id.cert = X509_new();
  X509_set_version(id.cert, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(id.cert), std::random_device{}() & 0x7fffffff);
  X509_gmtime_adj(X509_getm_notBefore(id.cert), not_before_s);
  X509_gmtime_adj(X509_getm_notAfter(id.cert), not_after_s);
  X509_set_pubkey(id.cert, id.key);
  X509_NAME* name = X509_get_subject_name(id.cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509_set_issuer_name(id.cert, issuer ? X509_get_subject_name(issuer->cert) : name);
  REQUIRE(X509_sign(id.cert, issuer ? issuer->key : id.key, EVP_sha256()) > 0);
}

TEST_CASE("loopback addresses are those only this host can reach", "[security]") {
  for (const char* a : {"127.0.0.1:50051", "127.5.6.7:1", "localhost:80", "[::1]:50051", "::1", "127.0.0.1",
                        "unix:/tmp/baton.sock"}) {
    CHECK(is_loopback_address(a));
  }
  // A name is judged by what it resolves to, not by how it begins (127.example.com resolves to
  // nothing here; to a public address in a real DNS, it would be no loopback either).
  for (const char* a : {"0.0.0.0:50051", "[::]:50051", "10.0.0.7:50051", "baton-decode:50051", "example.com:443",
                        "[2001:db8::1]:1", "128.0.0.1:5", "127.example.com:443", "127.0.0.1.invalid", "[::ffff:10.0.0.1]:1"}) {
    CHECK_FALSE(is_loopback_address(a));
  }
}

TEST_CASE("peer hosts: a peer's host, and the hosts an address connects from", "[security]") {
  CHECK(peer_host("ipv4:10.0.0.7:41234") == "ipv4:10.0.0.7");
  CHECK(peer_host("ipv6:[fd00::1]:5") == "ipv6:[fd00::1]");
  CHECK(peer_host("ipv6:[::ffff:10.0.0.7]:5") == "ipv4:10.0.0.7");  // dual-stack listener
  CHECK(peer_host("unix:/tmp/s") == "unix:/tmp/s");
  CHECK(peer_hosts_of("10.1.2.3:50051") == std::vector<std::string>{"ipv4:10.1.2.3"});
  CHECK(peer_hosts_of("[fd00::1]:50051") == std::vector<std::string>{"ipv6:[fd00::1]"});
  const auto local = peer_hosts_of("localhost:1");
  CHECK(std::find(local.begin(), local.end(), "ipv4:127.0.0.1") != local.end());
  CHECK(peer_hosts_of("no-such-host.invalid:1").empty());
}

TEST_CASE("loopback peers are callers on this host", "[security]") {
  for (const char* p : {"ipv4:127.0.0.1:41234", "ipv4:127.9.9.9:1", "ipv6:[::1]:5", "ipv6:[::ffff:127.0.0.1]:5",
                        "unix:/tmp/baton.sock", "unix-abstract:baton"}) {
    CHECK(is_loopback_peer(p));
  }
  for (const char* p : {"ipv4:10.0.0.7:41234", "ipv4:192.0.2.2:5", "ipv6:[fd00::1]:5", "ipv6:[::ffff:10.0.0.7]:5",
                        "ipv4:128.0.0.1:5", ""}) {
    CHECK_FALSE(is_loopback_peer(p));
  }
}

TEST_CASE("certificate files are checked before anything listens", "[security]") {
  TempDir dir;
  Identity ca, leaf, other, expired;
  make_identity(ca, "baton-internal-ca", nullptr, 0, 3600);
  make_identity(leaf, "baton-decode", &ca, 0, 3600);
  make_identity(other, "somebody", &ca, 0, 3600);
  make_identity(expired, "baton-old", &ca, -7200, -3600);
  TlsFiles files{dir.file("leaf.crt", leaf.cert_pem()), dir.file("leaf.key", leaf.key_pem()),
                 dir.file("ca.crt", ca.cert_pem())};

  CHECK(check_tls_files(files, kInternalTlsFlags, true).ok());
  CHECK(check_tls_files(TlsFiles{}, kPublicTlsFlags, false).ok());  // nothing given: plaintext

  auto message_of = [](const TlsFiles& f, bool need_ca, TlsFlagNames flags = kInternalTlsFlags) {
    const Status s = check_tls_files(f, flags, need_ca);
    REQUIRE_FALSE(s.ok());
    return s.message();
  };
  SECTION("mutual TLS needs all three") {
    TlsFiles f = files;
    f.ca.clear();
    CHECK_THAT(message_of(f, true), Catch::Contains("--internal-tls-ca"));
  }
  SECTION("cert and key together") {
    TlsFiles f = files;
    f.key.clear();
    CHECK_THAT(message_of(f, false, kPublicTlsFlags), Catch::Contains("--tls-cert and --tls-key go together"));
  }
  SECTION("a missing file is named") {
    TlsFiles f = files;
    f.cert = (dir.path / "nope.crt").string();
    CHECK_THAT(message_of(f, true), Catch::Contains("--internal-tls-cert: cannot read") && Catch::Contains("nope.crt"));
  }
  SECTION("not PEM") {
    TlsFiles f = files;
    f.cert = dir.file("junk.crt", "hello");
    CHECK_THAT(message_of(f, true), Catch::Contains("holds no PEM certificate"));
    f = files;
    f.key = dir.file("junk.key", leaf.cert_pem());
    CHECK_THAT(message_of(f, true), Catch::Contains("holds no unencrypted PEM private key"));
    f = files;
    f.ca = dir.file("junk-ca.crt", "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n");
    CHECK_THAT(message_of(f, true), Catch::Contains("--internal-tls-ca"));
  }
  SECTION("the key must belong to the certificate") {
    TlsFiles f = files;
    f.key = dir.file("other.key", other.key_pem());
    CHECK_THAT(message_of(f, true), Catch::Contains("is not the private key of the certificate"));
  }
  SECTION("an expired certificate") {
    TlsFiles f{dir.file("old.crt", expired.cert_pem()), dir.file("old.key", expired.key_pem()), files.ca};
    CHECK_THAT(message_of(f, true), Catch::Contains("has expired"));
  }
  SECTION("a client's files are checked the same way") {
    TlsFiles f = files;
    f.key = dir.file("other.key", other.key_pem());
    auto c = client_channel_credentials(f);
    REQUIRE_FALSE(c.ok());
    CHECK_THAT(c.status().message(), Catch::Contains("--tls-key"));
    CHECK(client_channel_credentials(files).ok());
  }
}

TEST_CASE("API keys: parsing, constant-time comparison, bearer tokens", "[security]") {
  CHECK(constant_time_equal("0123456789abcdef", "0123456789abcdef"));
  CHECK_FALSE(constant_time_equal("0123456789abcdef", "0123456789abcdeF"));
  CHECK_FALSE(constant_time_equal("0123456789abcde", "0123456789abcdef"));
  CHECK_FALSE(constant_time_equal("0123456789abcdef0", "0123456789abcdef"));
  CHECK_FALSE(constant_time_equal("", ""));  // an empty secret matches nothing
  // A prefix repeated is not the key (the comparison wraps over the secret's bytes).
  CHECK_FALSE(constant_time_equal("abcdefghabcdefgh", "abcdefgh"));

  auto keys = parse_api_keys("# team a\n  key-aaaaaaaaaaaaaaaa  \n\nkey-bbbbbbbbbbbbbbbb max-priority=50\r\n", "keys.txt");
  REQUIRE(keys.ok());
  REQUIRE(keys->size() == 2);
  CHECK((*keys)[0].secret == "key-aaaaaaaaaaaaaaaa");
  CHECK_FALSE((*keys)[0].max_priority.has_value());
  CHECK((*keys)[1].secret == "key-bbbbbbbbbbbbbbbb");
  CHECK((*keys)[1].max_priority == 50);
  // `admin` (the Admin service) and max-priority, in either order, each at most once.
  auto admin = parse_api_keys("key-aaaaaaaaaaaaaaaa admin\nkey-bbbbbbbbbbbbbbbb  max-priority=3\tadmin\n"
                              "key-cccccccccccccccc admin max-priority=-2\n", "keys.txt");
  REQUIRE(admin.ok());
  REQUIRE(admin->size() == 3);
  CHECK((*admin)[0].admin);
  CHECK_FALSE((*admin)[0].max_priority.has_value());
  CHECK((*admin)[1].admin);
  CHECK((*admin)[1].max_priority == 3);
  CHECK((*admin)[2].admin);
  CHECK((*admin)[2].max_priority == -2);
  CHECK_FALSE((*keys)[0].admin);
  CHECK_FALSE((*keys)[1].admin);
  for (const char* bad : {"key-aaaaaaaaaaaaaaaa priority=5", "key-aaaaaaaaaaaaaaaa max-priority=",
                          "key-aaaaaaaaaaaaaaaa max-priority=5x", "key-aaaaaaaaaaaaaaaa admin admin",
                          "key-aaaaaaaaaaaaaaaa max-priority=1 max-priority=2", "key-aaaaaaaaaaaaaaaa Admin",
                          "key-aaaaaaaaaaaaaaaa max-priority"}) {
    auto parsed = parse_api_keys(bad, "keys.txt");
    REQUIRE_FALSE(parsed.ok());
    CHECK_THAT(parsed.status().message(), Catch::Contains("line 1") && Catch::Contains("max-priority=N"));
  }
  auto short_key = parse_api_keys("key-aaaaaaaaaaaaaaaa\nshort\n", "keys.txt");
  REQUIRE_FALSE(short_key.ok());
  CHECK_THAT(short_key.status().message(), Catch::Contains("line 2") && Catch::Contains("at least 16"));
  CHECK_FALSE(parse_api_keys("# nothing\n\n", "keys.txt").ok());

  TempDir dir;
  CHECK(ApiKeys::load((dir.path / "missing").string()).status().code() == StatusCode::kNotFound);
  const std::string path = dir.file("keys", "key-aaaaaaaaaaaaaaaa\nkey-bbbbbbbbbbbbbbbb max-priority=7 admin\n");
  auto loaded = ApiKeys::load(path);
  REQUIRE(loaded.ok());
  ApiKeys& k = **loaded;
  std::optional<int32_t> bound = 99;
  bool is_admin = true;
  CHECK(k.check_authorization("Bearer key-aaaaaaaaaaaaaaaa", &bound, &is_admin).ok());
  CHECK_FALSE(bound.has_value());  // the frontend's --max-priority
  CHECK_FALSE(is_admin);
  CHECK(k.check_authorization("bearer key-bbbbbbbbbbbbbbbb", &bound, &is_admin).ok());
  CHECK(bound == 7);
  CHECK(is_admin);
  for (const char* bad : {"", "key-aaaaaaaaaaaaaaaa", "Bearer key-aaaaaaaaaaaaaaab", "Basic key-aaaaaaaaaaaaaaaa",
                          "Bearer ", "Bearer key-aaaaaaaaaaaaaaaakey-aaaaaaaaaaaaaaaa"}) {
    CAPTURE(bad);
    const Status s = k.check_authorization(bad);
    CHECK(s.code() == StatusCode::kUnauthenticated);
    CHECK_THAT(s.message(), Catch::Contains("authorization: Bearer <key>"));
  }

  SECTION("rotated without a restart") {
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // the file is looked at once a second
    dir.file("keys", "key-cccccccccccccccc\n");
    CHECK(k.check_authorization("Bearer key-cccccccccccccccc").ok());
    CHECK(k.check_authorization("Bearer key-aaaaaaaaaaaaaaaa").code() == StatusCode::kUnauthenticated);
    // A broken rewrite keeps the keys in use.
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    dir.file("keys", "short\n");
    CHECK(k.check_authorization("Bearer key-cccccccccccccccc").ok());
  }
}

}  // namespace
}  // namespace baton

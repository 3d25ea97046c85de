package caddysse

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"go.uber.org/zap"

	"github.com/caddy-sse/caddy-sse/internal/redistest"
)

// testPKI is a certificate authority that issues certificates into files.
type testPKI struct {
	t    testing.TB
	dir  string
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	CA   string // the CA's PEM file
}

func newTestPKI(t testing.TB) *testPKI {
	t.Helper()
	p := &testPKI{t: t, dir: t.TempDir()}
	p.CA = filepath.Join(p.dir, "ca.pem")
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "caddy-sse test CA"},
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour), IsCA: true,
		BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	p.cert, p.key = p.sign(tmpl, nil, p.CA, "")
	return p
}

// issue writes a certificate for dnsNames (a server's; a client's when
// dnsNames is empty) and its key, and returns their files.
func (p *testPKI) issue(name string, dnsNames ...string) (certFile, keyFile string) {
	p.t.Helper()
	usage := x509.ExtKeyUsageClientAuth
	if len(dnsNames) > 0 {
		usage = x509.ExtKeyUsageServerAuth
	}
	serial, _ := rand.Int(rand.Reader, big.NewInt(1<<62))
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: name}, DNSNames: dnsNames,
		NotBefore: time.Now().Add(-time.Minute), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}}
	certFile = filepath.Join(p.dir, name+".pem")
	keyFile = filepath.Join(p.dir, name+"-key.pem")
	p.sign(tmpl, p, certFile, keyFile)
	return certFile, keyFile
}

// sign makes a key and a certificate of tmpl signed by parent (self-signed
// when nil), written to certFile and, if given, keyFile.
func (p *testPKI) sign(tmpl *x509.Certificate, parent *testPKI, certFile, keyFile string) (*x509.Certificate, *ecdsa.PrivateKey) {
	p.t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		p.t.Fatal(err)
	}
	issuer, signer := tmpl, key
	if parent != nil {
		issuer, signer = parent.cert, parent.key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, issuer, &key.PublicKey, signer)
	if err != nil {
		p.t.Fatal(err)
	}
	p.write(certFile, "CERTIFICATE", der)
	if keyFile != "" {
		keyDER, err := x509.MarshalECPrivateKey(key)
		if err != nil {
			p.t.Fatal(err)
		}
		p.write(keyFile, "EC PRIVATE KEY", keyDER)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		p.t.Fatal(err)
	}
	return cert, key
}

func (p *testPKI) write(file, typ string, der []byte) {
	p.t.Helper()
	if err := os.WriteFile(file, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		p.t.Fatal(err)
	}
}

// startTLSRedis starts a redis-server that speaks TLS on tlsPort with a
// certificate for redis.test only (not for 127.0.0.1), and requires a
// client certificate from pki (Redis' default, tls-auth-clients yes). Its
// plain port stays open for the test's own redis-cli.
func startTLSRedis(t *testing.T, pki *testPKI) (rds *redistest.Server, tlsPort int) {
	t.Helper()
	cert, key := pki.issue("redis", "redis.test")
	tlsPort = redistest.FreePort(t)
	rds = redistest.Start(t, "--tls-port", strconv.Itoa(tlsPort), "--tls-cert-file", cert, "--tls-key-file", key,
		"--tls-ca-cert-file", pki.CA)
	return rds, tlsPort
}

// tlsRedisSite is redisSite on rediss://127.0.0.1:port with tlsBlock in the
// redis block.
func tlsRedisSite(port int, tlsBlock string) string {
	return strings.Replace(redisSite(fmt.Sprintf("rediss://127.0.0.1:%d", port)), "max_retries -1",
		"max_retries -1\n\t\t\t"+tlsBlock, 1)
}

// A self-hosted Redis with TLS checks its clients' certificates by default,
// and its certificate may name a host other than the address the module
// dials (a Sentinel's or a cluster's nodes announce their IPs): the tls
// block's client_auth and server_name make such a Redis usable. Without
// either, publishing fails (503): the handshake is refused.
func TestRedisTLSClientCertificateAndServerName(t *testing.T) {
	pki := newTestPKI(t)
	rds, port := startTLSRedis(t, pki)
	clientCert, clientKey := pki.issue("caddy")

	for _, tc := range []struct{ name, block string }{
		{"no client certificate", "tls " + pki.CA + " {\n\t\t\t\tserver_name redis.test\n\t\t\t}"},
		{"the dialed address as server name", "tls " + pki.CA + " {\n\t\t\t\tclient_auth " + clientCert + " " + clientKey + "\n\t\t\t}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := startCaddy(t, tlsRedisSite(port, tc.block))
			status, body := srv.post("/events", "application/json", mustJSON(t, map[string]any{"channel": "a", "data": "x"}), header("Authorization", "Bearer "+testSecret))
			if status != http.StatusServiceUnavailable {
				t.Fatalf("publish answered %d %s, want 503: the handshake should have been refused", status, body)
			}
		})
	}

	srv := startCaddy(t, tlsRedisSite(port, "tls {\n\t\t\t\tca "+pki.CA+"\n\t\t\t\tclient_auth "+clientCert+" "+clientKey+"\n\t\t\t\tserver_name redis.test\n\t\t\t}"))
	assertFirstEventGoesThroughRedis(t, srv, rds, "over tls")
}

// assertFirstEventGoesThroughRedis publishes a channel's first event through
// srv and checks that a stream got it and that Redis holds it.
func assertFirstEventGoesThroughRedis(t *testing.T, srv *testServer, rds *redistest.Server, data string) {
	t.Helper()
	c := srv.subscribe("/events?channels=a", nil)
	rds.WaitShardSubscribers(t, "sse:{a}", 1)
	srv.publish("/events", map[string]any{"channel": "a", "data": data})
	if ev := c.next(); ev.Data != data {
		t.Fatalf("got %+v", ev)
	}
	if n := rds.MustCLI("XLEN", "sse:{a}:s"); n != "1" {
		t.Fatalf("the history in Redis has %s events, want 1", n)
	}
}

// The tls block's mistakes are refused with the file and line.
func TestRedisTLSBlockMistakesRefused(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"unknown subdirective", "tls {\n\t\t\t\tverify off\n\t\t\t}", "unrecognized redis tls subdirective"},
		{"client_auth without its key", "tls {\n\t\t\t\tclient_auth cert.pem\n\t\t\t}", "client_auth takes"},
		{"the CA twice", "tls ca.pem {\n\t\t\t\tca other.pem\n\t\t\t}", "given twice"},
		{"server_name twice", "tls {\n\t\t\t\tserver_name a\n\t\t\t\tserver_name b\n\t\t\t}", "more than once"},
		{"server_name without a name", "tls {\n\t\t\t\tserver_name\n\t\t\t}", "wrong argument count"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			input := ":8080 {\n\tsse /events {\n\t\tchannel a\n\t\tredis {\n\t\t\taddresses 127.0.0.1:7000\n\t\t\t" + tc.block + "\n\t\t}\n\t}\n}\n"
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile.test"})
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Caddyfile.test:") {
				t.Fatalf("error %v, want one saying %q with the file and line", err, tc.want)
			}
		})
	}
}

// A client certificate without its key (possible in JSON) is refused at
// load, as are files that do not hold a certificate and its key.
func TestRedisTLSClientCertificateMistakesRefused(t *testing.T) {
	pki := newTestPKI(t)
	cert, key := pki.issue("caddy")
	_, otherKey := pki.issue("other")
	for _, tc := range []struct {
		name string
		tls  RedisTLS
	}{
		{"certificate without key", RedisTLS{ClientCertificateFile: cert}},
		{"key without certificate", RedisTLS{ClientCertificateKeyFile: key}},
		{"key of another certificate", RedisTLS{ClientCertificateFile: cert, ClientCertificateKeyFile: otherKey}},
		{"missing file", RedisTLS{ClientCertificateFile: cert + ".gone", ClientCertificateKeyFile: key}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rc := &RedisConfig{URL: "redis://127.0.0.1:7000", TLS: &tc.tls}
			if err := redisSettingsErr(rc); err == nil {
				t.Fatalf("%s accepted", tc.name)
			}
		})
	}
}

// The hub key follows the client certificate's contents and the server
// name: a reload after the certificate was renewed gets a hub that
// presents the new one, and one with another server_name a hub that checks
// it.
func TestHubKeyTracksClientCertificateAndServerName(t *testing.T) {
	pki := newTestPKI(t)
	cert, key := pki.issue("caddy")
	keyOf := func(serverName string) string {
		h := validHandler()
		h.logger = zap.NewNop()
		h.Redis = &RedisConfig{URL: "redis://127.0.0.1:7000", TLS: &RedisTLS{ClientCertificateFile: cert,
			ClientCertificateKeyFile: key, ServerName: serverName}}
		_, k, err := h.redisOptions()
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	before := keyOf("redis.test")
	if keyOf("other.test") == before {
		t.Fatal("another server_name gives the same hub key")
	}
	pki.issue("caddy") // renewed: same files, new contents
	if keyOf("redis.test") == before {
		t.Fatal("a renewed client certificate gives the same hub key: a reload keeps presenting the old one")
	}
}

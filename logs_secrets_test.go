package caddysse

import (
	"strings"
	"testing"
)

// A malformed Redis URL is a config error that Caddy logs and its admin
// API answers: it must not quote the password. An unescaped / # or ? in a
// password (base64 passwords hold / often) ends the URL's host there:
// url.Parse then read the password's start as a port (`invalid port
// ":Qx9" after host`), and go-redis the rest as the database (`invalid
// database number: "Zk7w@127.0.0.1:6379"`); a unix:// URL echoed it whole.
func TestMalformedRedisURLErrorQuotesNoPassword(t *testing.T) {
	for _, c := range []struct{ url, secret string }{
		{"redis://user:Qx9/Zk7w@127.0.0.1:6379", "Qx9"},
		{"redis://user:Qx9/Zk7w@127.0.0.1:6379", "Zk7w"},
		{"redis://user:4711/Zk7w@127.0.0.1:6379", "Zk7w"},
		{"redis://:Qx9#Zk7w@127.0.0.1:6379", "Qx9"},
		{"redis://:Qx9?Zk7w@127.0.0.1:6379", "Qx9"},
		{"redis://:Qx9%zzZk7w@127.0.0.1:6379", "%zz"},
		{"unix://u:4711/Zk7w@/run/redis.sock", "4711"},
		{"unix://u:4711/Zk7w@/run/redis.sock", "Zk7w"},
	} {
		_, err := (&RedisConfig{URL: c.url}).redisOptions()
		if err == nil {
			t.Fatalf("%s: no error", c.url)
		}
		if strings.Contains(err.Error(), c.secret) {
			t.Errorf("%s: the error quotes the password (%q): %v", c.url, c.secret, err)
		}
	}
	// without credentials the reason is kept: it helps and hides nothing
	_, err := (&RedisConfig{URL: "redis://127.0.0.1:6379/notadb"}).redisOptions()
	if err == nil || !strings.Contains(err.Error(), "notadb") {
		t.Errorf("a malformed URL without a password lost its reason: %v", err)
	}
}

package caddysse

import (
	"net/http"
	"time"
)

// setDate sets a stream's Date header itself. net/http and HTTP/2 would
// otherwise format it with time.Format while writing the headers, deep in
// Caddy's handler chain: that call's large frames grow the handler
// goroutine's stack from 8 to 16 KiB, which an HTTP/2 (or net_http writer)
// stream then keeps for its whole life. appendHTTPDate needs a few
// hundred bytes of stack.
func setDate(hdr http.Header, now time.Time) {
	var buf [len(http.TimeFormat)]byte
	hdr["Date"] = []string{string(appendHTTPDate(buf[:0], now))}
}

const (
	weekdays = "SunMonTueWedThuFriSat"
	months   = "JanFebMarAprMayJunJulAugSepOctNovDec"
)

// appendHTTPDate appends t in the IMF-fixdate form of RFC 9110
// (http.TimeFormat), in UTC.
func appendHTTPDate(b []byte, t time.Time) []byte {
	t = t.UTC()
	year, month, day := t.Date()
	hour, minute, sec := t.Clock()
	wd := int(t.Weekday())
	b = append(b, weekdays[3*wd:3*wd+3]...)
	b = append(b, ',', ' ')
	b = appendTwoDigits(b, day)
	b = append(b, ' ')
	b = append(b, months[3*(month-1):3*month]...)
	b = append(b, ' ')
	b = appendTwoDigits(b, year/100)
	b = appendTwoDigits(b, year%100)
	b = append(b, ' ')
	b = appendTwoDigits(b, hour)
	b = append(b, ':')
	b = appendTwoDigits(b, minute)
	b = append(b, ':')
	b = appendTwoDigits(b, sec)
	return append(b, " GMT"...)
}

func appendTwoDigits(b []byte, n int) []byte {
	return append(b, byte('0'+n/10), byte('0'+n%10))
}

// Package clusterslot computes Redis Cluster hash slots. go-redis keeps its
// own copy internal; the broker needs it to send one SSUBSCRIBE per slot,
// and the tests to pick channels on a given primary.
package clusterslot

import "strings"

// Count is how many hash slots a cluster has.
const Count = 16384

// Of is the hash slot of key: CRC16 (XMODEM) of its hash tag (what is
// between the first "{" and the next "}", if not empty) or of the whole key,
// modulo 16384, as the Cluster specification defines it.
func Of(key string) uint16 {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if end := strings.IndexByte(key[open+1:], '}'); end > 0 {
			key = key[open+1 : open+1+end]
		}
	}
	var crc uint16
	for i := 0; i < len(key); i++ {
		crc ^= uint16(key[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % Count
}

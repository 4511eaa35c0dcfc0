package memory

import (
	"crypto/rand"
	"fmt"
)

// newUUID is a random (version 4) UUID, the idempotency key of an
// AddMemory the caller gave none. crypto/rand, so that two clients never
// draw the same key.
func newUUID() string {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		// The kernel's random source failing is not something to write on.
		panic(fmt.Sprintf("memory: no random bytes for an idempotency key: %v", err))
	}
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

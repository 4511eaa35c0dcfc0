package memory

import (
	"context"
	"errors"
	"math"
	"math/rand"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// jitter draws the waits; math/rand's global source is seeded with 1 before
// Go 1.20, and every client retrying in step is what jitter is there to
// prevent.
var jitter = struct {
	sync.Mutex
	*rand.Rand
}{Rand: rand.New(rand.NewSource(time.Now().UnixNano()))}

// backoff is the wait before retry number `retry` (1 for the first): drawn
// from [0, min(MaxBackoff, FirstBackoff * Multiplier^(retry-1))].
func (p RetryPolicy) backoff(retry int) time.Duration {
	multiplier := p.Multiplier
	if multiplier < 1 {
		multiplier = 1
	}
	ceiling := float64(p.FirstBackoff) * math.Pow(multiplier, float64(retry-1))
	if p.MaxBackoff > 0 && ceiling > float64(p.MaxBackoff) {
		ceiling = float64(p.MaxBackoff)
	}
	if ceiling <= 0 {
		return 0
	}
	jitter.Lock()
	defer jitter.Unlock()
	return time.Duration(jitter.Int63n(int64(ceiling) + 1))
}

// wait sleeps before retry number `retry`, or returns the context's error
// when it ends first.
func (p RetryPolicy) wait(ctx context.Context, retry int) error {
	timer := time.NewTimer(p.backoff(retry))
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// retryable is whether err may be retried: UNAVAILABLE only, whatever its
// reason (DATABASE_BUSY, REPLICA_BEHIND, a cut connection).
func retryable(err error) bool {
	return status.Code(err) == codes.Unavailable
}

// nothingWritten is whether the daemon said a failed write wrote nothing
// (DATABASE_BUSY, DATABASE_UNAVAILABLE): then even a write without an
// idempotency key may be sent again, unlike after a cut connection.
func nothingWritten(err error) bool {
	var e *Error
	if !errors.As(convert(err), &e) {
		return false
	}
	return e.Reason == "DATABASE_BUSY" || e.Reason == "DATABASE_UNAVAILABLE"
}

// unary runs one unary call under the client's deadline and token,
// retrying UNAVAILABLE when `retry` says the call is safe to repeat (a
// read, or a write that carries an idempotency key) or the daemon said
// nothing was written, and returns a failure
// as *Error or *BudgetError.
func unary[Req, Resp any](
	ctx context.Context,
	c *Client,
	retry bool,
	call func(context.Context, Req, ...grpc.CallOption) (Resp, error),
	req Req,
) (Resp, error) {
	ctx, cancel := c.unaryContext(ctx)
	defer cancel()
	for attempt := 1; ; attempt++ {
		resp, err := call(ctx, req)
		if err == nil {
			return resp, nil
		}
		if !retryable(err) || attempt >= c.cfg.retry.Attempts || !(retry || nothingWritten(err)) {
			return resp, convert(err)
		}
		if c.cfg.retry.wait(ctx, attempt) != nil {
			return resp, convert(err)
		}
	}
}

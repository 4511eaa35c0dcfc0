package memory

import (
	"fmt"
	"strconv"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Error is a failed call: the gRPC code, the google.rpc.ErrorInfo reason
// and metadata the daemon sent (docs/API.md lists them), and the message.
// Match it with errors.As; a budget refusal is a *BudgetError, which
// errors.As also finds as an *Error.
type Error struct {
	Code     codes.Code
	Reason   string
	Domain   string
	Metadata map[string]string
	Message  string

	status *status.Status
}

func (e *Error) Error() string {
	if e.Reason == "" {
		return fmt.Sprintf("memory: %s: %s", e.Code, e.Message)
	}
	return fmt.Sprintf("memory: %s %s: %s", e.Code, e.Reason, e.Message)
}

// GRPCStatus lets status.FromError and status.Code see the call's status.
func (e *Error) GRPCStatus() *status.Status { return e.status }

// Budget reasons: the write does not fit its tier.
const (
	ReasonTierBudgetExceeded = "TIER_BUDGET_EXCEEDED"
	ReasonEntryTooLarge      = "ENTRY_TOO_LARGE"
)

// BudgetError is a write refused for its tier's budget
// (TIER_BUDGET_EXCEEDED, or ENTRY_TOO_LARGE when the entry alone is longer
// than the whole budget), with the usage as numbers. RequestedChars is set
// for TIER_BUDGET_EXCEEDED, EntryChars for ENTRY_TOO_LARGE.
type BudgetError struct {
	// Err is the refusal as any other error: code, reason, metadata.
	Err *Error
	// Tier is the metadata's tier: "memory" or "user".
	Tier           string
	UsedChars      int64
	LimitChars     int64
	RequestedChars int64
	EntryChars     int64
}

func (b *BudgetError) Error() string { return b.Err.Error() }

// Unwrap gives the *Error, so errors.As(err, &*memory.Error) matches too.
func (b *BudgetError) Unwrap() error { return b.Err }

// GRPCStatus lets status.FromError and status.Code see the call's status.
func (b *BudgetError) GRPCStatus() *status.Status { return b.Err.status }

// convert turns a gRPC failure into *Error or *BudgetError; an error that
// carries no status (none does from grpc-go) is returned as it is.
func convert(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	e := &Error{Code: st.Code(), Message: st.Message(), Metadata: map[string]string{}, status: st}
	for _, detail := range st.Details() {
		if info, ok := detail.(*errdetails.ErrorInfo); ok {
			e.Reason, e.Domain = info.GetReason(), info.GetDomain()
			for key, value := range info.GetMetadata() {
				e.Metadata[key] = value
			}
		}
	}
	if e.Reason != ReasonTierBudgetExceeded && e.Reason != ReasonEntryTooLarge {
		return e
	}
	number := func(key string) int64 {
		n, _ := strconv.ParseInt(e.Metadata[key], 10, 64)
		return n
	}
	return &BudgetError{
		Err:            e,
		Tier:           e.Metadata["tier"],
		UsedChars:      number("used_chars"),
		LimitChars:     number("limit_chars"),
		RequestedChars: number("requested_chars"),
		EntryChars:     number("entry_chars"),
	}
}

package memory

import (
	"context"
	"io"
	"strings"
	"sync/atomic"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

// MemoryIterator walks every entry GetMemories lists, page by page,
// following next_page_token to the end:
//
//	it := c.Memories(ctx, &memoryv1.GetMemoriesRequest{})
//	for it.Next() {
//		m := it.Memory()
//	}
//	if err := it.Err(); err != nil { ... }
type MemoryIterator struct {
	ctx     context.Context
	c       *Client
	req     *memoryv1.GetMemoriesRequest
	page    []*memoryv1.Memory
	current *memoryv1.Memory
	usage   []*memoryv1.TierUsage
	done    bool
	err     error
}

// Memories iterates over every entry req lists (its page_token is where to
// start; empty for the first page). Each page is one GetMemories call,
// retried and read-your-writes as GetMemories is.
func (c *Client) Memories(ctx context.Context, req *memoryv1.GetMemoriesRequest) *MemoryIterator {
	return &MemoryIterator{ctx: ctx, c: c, req: clone(req)}
}

// Next moves to the next entry; false at the end or on an error (Err).
func (it *MemoryIterator) Next() bool {
	for len(it.page) == 0 {
		if it.done || it.err != nil {
			return false
		}
		resp, err := it.c.GetMemories(it.ctx, it.req)
		if err != nil {
			it.err = err
			return false
		}
		it.page, it.usage = resp.GetMemories(), resp.GetUsage()
		it.req.PageToken = resp.GetNextPageToken()
		it.done = it.req.PageToken == ""
	}
	it.current, it.page = it.page[0], it.page[1:]
	return true
}

// Memory is the entry Next moved to.
func (it *MemoryIterator) Memory() *memoryv1.Memory { return it.current }

// Usage is each tier's usage as the last page read reported it.
func (it *MemoryIterator) Usage() []*memoryv1.TierUsage { return it.usage }

// Err is the error that ended the iteration, nil at its end.
func (it *MemoryIterator) Err() error { return it.err }

// HitIterator walks SearchMemories' hits, page by page.
type HitIterator struct {
	ctx     context.Context
	c       *Client
	req     *memoryv1.SearchMemoriesRequest
	page    []*memoryv1.SearchHit
	current *memoryv1.SearchHit
	done    bool
	err     error
}

// Search iterates over the hits of req, best first, as SearchMemories pages
// them (up to req.limit in all).
func (c *Client) Search(ctx context.Context, req *memoryv1.SearchMemoriesRequest) *HitIterator {
	return &HitIterator{ctx: ctx, c: c, req: clone(req)}
}

// Next moves to the next hit; false at the end or on an error (Err).
func (it *HitIterator) Next() bool {
	for len(it.page) == 0 {
		if it.done || it.err != nil {
			return false
		}
		resp, err := it.c.SearchMemories(it.ctx, it.req)
		if err != nil {
			it.err = err
			return false
		}
		it.page = resp.GetHits()
		it.req.PageToken = resp.GetNextPageToken()
		it.done = it.req.PageToken == ""
	}
	it.current, it.page = it.page[0], it.page[1:]
	return true
}

// Hit is the hit Next moved to.
func (it *HitIterator) Hit() *memoryv1.SearchHit { return it.current }

// Err is the error that ended the iteration, nil at its end.
func (it *HitIterator) Err() error { return it.err }

// resumable is the loop both streams share: open a stream from the resume
// point, receive, and on UNAVAILABLE (a cut connection, a daemon
// restarting) open it again from where the last message left off. The
// retry policy bounds the attempts in a row that bring nothing; a message
// received starts the count again, so a long watch survives any number of
// cuts spread over its life.
type resumable[Resp any] struct {
	ctx      context.Context
	cancel   context.CancelFunc
	c        *Client
	open     func(context.Context) (receiver[Resp], error)
	stream   receiver[Resp]
	failures int
	ended    bool
	// closed is set by Close, which may run in another goroutine while
	// recv waits.
	closed  atomic.Bool
	err     error
	resumes int
}

type receiver[Resp any] interface{ Recv() (Resp, error) }

func newResumable[Resp any](
	ctx context.Context, c *Client, open func(context.Context) (receiver[Resp], error),
) *resumable[Resp] {
	ctx, cancel := context.WithCancel(c.withToken(ctx))
	return &resumable[Resp]{ctx: ctx, cancel: cancel, c: c, open: open}
}

// recv is the next message; false at the stream's end, once closed, or on
// an error kept in r.err.
func (r *resumable[Resp]) recv() (Resp, bool) {
	var zero Resp
	for !r.ended {
		if r.stream == nil {
			stream, err := r.open(r.ctx)
			if err != nil {
				r.retry(err)
				continue
			}
			r.stream = stream
		}
		msg, err := r.stream.Recv()
		if err == nil {
			r.failures = 0
			return msg, true
		}
		r.stream = nil
		if err == io.EOF {
			r.end(nil)
			break
		}
		if r.retry(err) {
			r.resumes++
		}
	}
	return zero, false
}

// retry waits before the stream is opened again (true), or ends the
// iteration with err (false).
func (r *resumable[Resp]) retry(err error) bool {
	r.failures++
	switch {
	case r.closed.Load():
		r.end(nil)
	case r.ctx.Err() != nil:
		r.end(r.ctx.Err())
	case !retryable(err) || r.failures >= r.c.cfg.retry.Attempts:
		r.end(convert(err))
	case r.c.cfg.retry.wait(r.ctx, r.failures) != nil:
		if r.closed.Load() {
			r.end(nil)
		} else {
			r.end(r.ctx.Err())
		}
	default:
		return true
	}
	return false
}

func (r *resumable[Resp]) end(err error) {
	r.ended, r.err = true, err
	r.cancel()
}

func (r *resumable[Resp]) close() {
	r.closed.Store(true)
	r.cancel()
}

// ExportIterator walks the JSONL lines ExportMemories streams, resuming
// from the cursor of the last batch received when the stream is cut.
//
//	it := c.Export(ctx, &memoryv1.ExportMemoriesRequest{})
//	for it.Next() {
//		fmt.Println(it.Line())
//	}
//	if err := it.Err(); err != nil { ... }
type ExportIterator struct {
	r      *resumable[*memoryv1.ExportMemoriesResponse]
	req    *memoryv1.ExportMemoriesRequest
	lines  []string
	line   string
	cursor string
}

// Export iterates over the lines of an export of req (the client's scope
// unless req names one; for_user exports a user's entries everywhere).
// req.cursor resumes an export an earlier iterator's Cursor left off.
func (c *Client) Export(ctx context.Context, req *memoryv1.ExportMemoriesRequest) *ExportIterator {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	it := &ExportIterator{req: req, cursor: req.Cursor}
	it.r = newResumable(ctx, c, func(ctx context.Context) (receiver[*memoryv1.ExportMemoriesResponse], error) {
		req := clone(it.req)
		req.Cursor = it.cursor
		return c.stub.ExportMemories(ctx, req)
	})
	return it
}

// Next moves to the next line; false at the end or on an error (Err).
func (it *ExportIterator) Next() bool {
	for len(it.lines) == 0 {
		batch, ok := it.r.recv()
		if !ok {
			return false
		}
		it.lines = strings.SplitAfter(batch.GetJsonl(), "\n")
		if last := len(it.lines) - 1; it.lines[last] == "" {
			it.lines = it.lines[:last]
		}
		// The whole batch is held here, so after a cut the export resumes
		// behind it, whether or not the caller has read it all yet.
		it.cursor = batch.GetCursor()
	}
	it.line, it.lines = strings.TrimSuffix(it.lines[0], "\n"), it.lines[1:]
	return true
}

// Line is the JSON object Next moved to, one line of the JSONL
// `memory-sidecar import` reads (without its newline).
func (it *ExportIterator) Line() string { return it.line }

// Cursor is where the export resumes after the last batch received: pass it
// as ExportMemoriesRequest.cursor to continue in another iterator.
func (it *ExportIterator) Cursor() string { return it.cursor }

// Resumes counts how often the stream was opened again after a cut.
func (it *ExportIterator) Resumes() int { return it.r.resumes }

// Err is the error that ended the export, nil at its end.
func (it *ExportIterator) Err() error { return it.r.err }

// Close ends the stream early.
func (it *ExportIterator) Close() { it.r.close() }

// WatchIterator walks a scope's changes as WatchMemories streams them,
// resuming after a cut from the last event it gave (after_generation,
// after_tier, after_id), so that no event is missed or repeated. It runs
// until Close or the context ends.
//
//	it := c.Watch(ctx, &memoryv1.WatchMemoriesRequest{})
//	defer it.Close()
//	for it.Next() {
//		event := it.Event()
//	}
type WatchIterator struct {
	r     *resumable[*memoryv1.WatchMemoriesResponse]
	req   *memoryv1.WatchMemoriesRequest
	event *memoryv1.MemoryEvent
}

// Watch iterates over the changes of req's scope (the client's unless it
// names one) after req.after_generation (0: from now on; the first event is
// then a SYNC carrying the current generation).
func (c *Client) Watch(ctx context.Context, req *memoryv1.WatchMemoriesRequest) *WatchIterator {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	it := &WatchIterator{req: req}
	it.r = newResumable(ctx, c, func(ctx context.Context) (receiver[*memoryv1.WatchMemoriesResponse], error) {
		return c.stub.WatchMemories(ctx, clone(it.req))
	})
	return it
}

// Next waits for the next event; false once closed, or on an error (Err).
func (it *WatchIterator) Next() bool {
	resp, ok := it.r.recv()
	if !ok {
		return false
	}
	it.event = resp.GetEvent()
	it.req.AfterGeneration = it.event.GetGeneration()
	// Inside one generation (an expiry sweep's batch) events come in
	// (tier, id) order: resume behind this one. SYNC and ERASE name no entry,
	// so a resume starts behind their whole generation.
	if it.event.GetId() != "" {
		it.req.AfterTier, it.req.AfterId = it.event.GetTier(), it.event.GetId()
	} else {
		it.req.AfterTier, it.req.AfterId = memoryv1.Tier_TIER_UNSPECIFIED, ""
	}
	return true
}

// Event is the event Next moved to.
func (it *WatchIterator) Event() *memoryv1.MemoryEvent { return it.event }

// Resumes counts how often the stream was opened again after a cut.
func (it *WatchIterator) Resumes() int { return it.r.resumes }

// Err is the error that ended the watch: nil after Close, the context's
// error when it ended (context.Canceled, context.DeadlineExceeded), else
// the call's *Error.
func (it *WatchIterator) Err() error { return it.r.err }

// Close ends the watch; Next then returns false and Err nil.
func (it *WatchIterator) Close() { it.r.close() }

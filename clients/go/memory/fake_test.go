package memory

import (
	"context"
	"io"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
)

// fakeConn stands in for a connection in the unit tests: it records every
// request with its context and answers from the test's functions.
type fakeConn struct {
	mu       sync.Mutex
	calls    []call
	answer   func(method string, n int, req proto.Message) (proto.Message, error)
	openings func(method string, n int, req proto.Message) ([]proto.Message, error)
}

type call struct {
	method string
	req    proto.Message
	ctx    context.Context
}

func (f *fakeConn) record(ctx context.Context, method string, req proto.Message) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls = append(f.calls, call{method, proto.Clone(req), ctx})
	n := 0
	for _, c := range f.calls {
		if c.method == method {
			n++
		}
	}
	return n
}

func (f *fakeConn) requests(method string) []proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	var found []proto.Message
	for _, c := range f.calls {
		if c.method == method {
			found = append(found, c.req)
		}
	}
	return found
}

func (f *fakeConn) Invoke(ctx context.Context, method string, args, reply interface{}, _ ...grpc.CallOption) error {
	n := f.record(ctx, method, args.(proto.Message))
	resp, err := f.answer(method, n, args.(proto.Message))
	if err != nil {
		return err
	}
	proto.Merge(reply.(proto.Message), resp)
	return nil
}

func (f *fakeConn) NewStream(ctx context.Context, _ *grpc.StreamDesc, method string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	return &fakeStream{ctx: ctx, conn: f, method: method}, nil
}

// fakeStream sends what the test's openings function gives for the
// request it was opened with, then that function's error (io.EOF: the end).
type fakeStream struct {
	ctx     context.Context
	conn    *fakeConn
	method  string
	pending []proto.Message
	end     error
}

func (s *fakeStream) SendMsg(m interface{}) error {
	n := s.conn.record(s.ctx, s.method, m.(proto.Message))
	s.pending, s.end = s.conn.openings(s.method, n, m.(proto.Message))
	return nil
}

func (s *fakeStream) RecvMsg(m interface{}) error {
	if len(s.pending) == 0 {
		if s.end == nil {
			return io.EOF
		}
		return s.end
	}
	proto.Merge(m.(proto.Message), s.pending[0])
	s.pending = s.pending[1:]
	return nil
}

func (s *fakeStream) Header() (metadata.MD, error) { return nil, nil }
func (s *fakeStream) Trailer() metadata.MD         { return nil }
func (s *fakeStream) CloseSend() error             { return nil }
func (s *fakeStream) Context() context.Context     { return s.ctx }

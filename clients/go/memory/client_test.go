package memory

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

const service = "/memory.v1.MemoryService/"

// fast retries, so the unit tests do not wait out real back-offs.
var fast = WithRetry(RetryPolicy{Attempts: 4, FirstBackoff: time.Millisecond, Multiplier: 2, MaxBackoff: time.Millisecond})

var scope = Scope{AgentID: "agent", UserID: "user"}

func unavailable(reason string) error {
	st := status.New(codes.Unavailable, "try again")
	if reason != "" {
		st, _ = st.WithDetails(&errdetails.ErrorInfo{Reason: reason, Domain: "memory.v1"})
	}
	return st.Err()
}

func TestAddMemoryRetriesUnavailableWithOneGeneratedKey(t *testing.T) {
	conn := &fakeConn{answer: func(method string, n int, req proto.Message) (proto.Message, error) {
		if n < 3 {
			return nil, unavailable("DATABASE_BUSY")
		}
		return &memoryv1.AddMemoryResponse{Generation: 7, Created: true}, nil
	}}
	c := New(conn, scope, fast)
	request := &memoryv1.AddMemoryRequest{Content: "uses uv"}
	if _, err := c.AddMemory(context.Background(), request); err != nil {
		t.Fatal(err)
	}
	sent := conn.requests(service + "AddMemory")
	if len(sent) != 3 {
		t.Fatalf("%d attempts, want 3", len(sent))
	}
	key := sent[0].(*memoryv1.AddMemoryRequest).GetIdempotencyKey()
	if len(key) != 36 || key[14] != '4' {
		t.Fatalf("generated key %q is no UUID v4", key)
	}
	for _, attempt := range sent {
		if got := attempt.(*memoryv1.AddMemoryRequest); got.GetIdempotencyKey() != key ||
			got.GetScope().GetAgentId() != "agent" {
			t.Fatalf("attempt %v differs from the first (key %s)", got, key)
		}
	}
	if request.IdempotencyKey != "" || request.Scope != nil {
		t.Fatal("the caller's request was changed")
	}
	if c.Generation() != 7 {
		t.Fatalf("generation %d, want 7", c.Generation())
	}
}

func TestAddMemoryKeepsTheCallersKeyAndGivesUpAfterTheAttempts(t *testing.T) {
	conn := &fakeConn{answer: func(string, int, proto.Message) (proto.Message, error) {
		return nil, unavailable("")
	}}
	c := New(conn, scope, fast)
	_, err := c.AddMemory(context.Background(), &memoryv1.AddMemoryRequest{Content: "x", IdempotencyKey: "mine"})
	var failed *Error
	if !errors.As(err, &failed) || failed.Code != codes.Unavailable {
		t.Fatalf("error %v, want *Error UNAVAILABLE", err)
	}
	sent := conn.requests(service + "AddMemory")
	if len(sent) != 4 || sent[3].(*memoryv1.AddMemoryRequest).GetIdempotencyKey() != "mine" {
		t.Fatalf("%d attempts (want 4) with the caller's key", len(sent))
	}
}

func TestWritesWithoutAKeyAndOtherCodesAreNotRetried(t *testing.T) {
	conn := &fakeConn{answer: func(method string, _ int, _ proto.Message) (proto.Message, error) {
		if strings.HasSuffix(method, "GetMemories") {
			return nil, status.Error(codes.Internal, "broken")
		}
		return nil, unavailable("")
	}}
	c := New(conn, scope, fast)
	ctx := context.Background()
	_, err := c.UpdateMemory(ctx, &memoryv1.UpdateMemoryRequest{Id: "m1", Content: proto.String("new")})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("update: %v", err)
	}
	_, _ = c.DeleteMemory(ctx, &memoryv1.DeleteMemoryRequest{Id: "m1"})
	_, _ = c.CallTool(ctx, "s", "memory", `{"action": "add", "content": "x"}`)
	_, _ = c.GetMemories(ctx, &memoryv1.GetMemoriesRequest{})
	for _, method := range []string{"UpdateMemory", "DeleteMemory", "CallTool", "GetMemories"} {
		if n := len(conn.requests(service + method)); n != 1 {
			t.Errorf("%s: %d attempts, want 1", method, n)
		}
	}
	// A reading tool call is retried as any read is.
	_, _ = c.CallTool(ctx, "s", "memory_search", `{"query": "x"}`)
	_, _ = c.CallTool(ctx, "s", ClaudeMemoryTool, `{"command": "view", "path": "/memories"}`)
	if n := len(conn.requests(service + "CallTool")); n != 1+4+4 {
		t.Errorf("CallTool: %d attempts, want 9", n)
	}
}

func TestAWriteWithoutAKeyIsRetriedWhenTheDaemonWroteNothing(t *testing.T) {
	conn := &fakeConn{answer: func(_ string, n int, _ proto.Message) (proto.Message, error) {
		if n < 2 {
			return nil, unavailable("DATABASE_BUSY")
		}
		return &memoryv1.UpdateMemoryResponse{Generation: 3}, nil
	}}
	c := New(conn, scope, fast)
	_, err := c.UpdateMemory(context.Background(), &memoryv1.UpdateMemoryRequest{Id: "m1", Content: proto.String("new")})
	if err != nil {
		t.Fatalf("update: %v", err)
	}
	if n := len(conn.requests(service + "UpdateMemory")); n != 2 {
		t.Errorf("UpdateMemory: %d attempts, want 2", n)
	}
}

func TestReadsCarryTheHighestGenerationWritten(t *testing.T) {
	generation := uint64(0)
	conn := &fakeConn{answer: func(method string, _ int, _ proto.Message) (proto.Message, error) {
		switch strings.TrimPrefix(method, service) {
		case "AddMemory":
			generation += 10
			return &memoryv1.AddMemoryResponse{Generation: generation}, nil
		case "DeleteMemory":
			return &memoryv1.DeleteMemoryResponse{Generation: 3}, nil // older: kept out
		case "GetMemories":
			return &memoryv1.GetMemoriesResponse{}, nil
		case "SearchMemories":
			return &memoryv1.SearchMemoriesResponse{}, nil
		default:
			return &memoryv1.InjectForTurnResponse{}, nil
		}
	}}
	ctx := context.Background()
	c := New(conn, scope)
	if _, err := c.GetMemories(ctx, &memoryv1.GetMemoriesRequest{}); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 2; i++ {
		if _, err := c.AddMemory(ctx, &memoryv1.AddMemoryRequest{Content: "x"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.DeleteMemory(ctx, &memoryv1.DeleteMemoryRequest{Id: "m"}); err != nil {
		t.Fatal(err)
	}
	_, _ = c.GetMemories(ctx, &memoryv1.GetMemoriesRequest{})
	_, _ = c.SearchMemories(ctx, &memoryv1.SearchMemoriesRequest{Query: "x"})
	_, _ = c.Turn(ctx, "s", "hello")
	_, _ = c.GetMemories(ctx, &memoryv1.GetMemoriesRequest{MinGeneration: 5}) // the caller's own wins
	gets := conn.requests(service + "GetMemories")
	got := []uint64{
		gets[0].(*memoryv1.GetMemoriesRequest).GetMinGeneration(),
		gets[1].(*memoryv1.GetMemoriesRequest).GetMinGeneration(),
		conn.requests(service + "SearchMemories")[0].(*memoryv1.SearchMemoriesRequest).GetMinGeneration(),
		conn.requests(service + "InjectForTurn")[0].(*memoryv1.InjectForTurnRequest).GetMinGeneration(),
		gets[2].(*memoryv1.GetMemoriesRequest).GetMinGeneration(),
	}
	if want := []uint64{0, 20, 20, 20, 5}; !equal(got, want) {
		t.Fatalf("min_generation sent %v, want %v", got, want)
	}

	off := New(conn, scope, WithoutReadYourWrites())
	_, _ = off.AddMemory(ctx, &memoryv1.AddMemoryRequest{Content: "x"})
	_, _ = off.GetMemories(ctx, &memoryv1.GetMemoriesRequest{})
	gets = conn.requests(service + "GetMemories")
	if last := gets[len(gets)-1].(*memoryv1.GetMemoriesRequest); last.GetMinGeneration() != 0 {
		t.Fatalf("read-your-writes off, yet min_generation %d", last.GetMinGeneration())
	}
}

func TestReadsCarryAToolCallsGeneration(t *testing.T) {
	conn := &fakeConn{answer: func(method string, _ int, _ proto.Message) (proto.Message, error) {
		switch strings.TrimPrefix(method, service) {
		case "AddMemory":
			return &memoryv1.AddMemoryResponse{Generation: 10}, nil
		case "CallTool":
			return &memoryv1.CallToolResponse{Text: "Saved", Generation: 12}, nil
		default:
			return &memoryv1.GetMemoriesResponse{}, nil
		}
	}}
	ctx := context.Background()
	c := New(conn, scope)
	if _, err := c.AddMemory(ctx, &memoryv1.AddMemoryRequest{Content: "x"}); err != nil {
		t.Fatal(err)
	}
	result, err := c.CallTool(ctx, "s", "memory", `{"action": "add", "content": "y"}`)
	if err != nil {
		t.Fatal(err)
	}
	if result.Generation != 12 || c.Generation() != 12 {
		t.Fatalf("tool call's generation %d, client remembers %d, want 12", result.Generation, c.Generation())
	}
	_, _ = c.GetMemories(ctx, &memoryv1.GetMemoriesRequest{})
	if got := conn.requests(service + "GetMemories")[0].(*memoryv1.GetMemoriesRequest).GetMinGeneration(); got != 12 {
		t.Fatalf("min_generation sent %d, want the tool call's 12", got)
	}
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestEveryCallCarriesTheTokenAndADeadline(t *testing.T) {
	conn := &fakeConn{answer: func(string, int, proto.Message) (proto.Message, error) {
		return &memoryv1.EndSessionResponse{}, nil
	}}
	c := New(conn, scope, WithToken("s3cret"), WithTimeout(time.Minute))
	before := time.Now()
	if _, err := c.EndSession(context.Background(), "s"); err != nil {
		t.Fatal(err)
	}
	mine, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	if _, err := c.EndSession(mine, "s"); err != nil {
		t.Fatal(err)
	}
	conn.mu.Lock()
	defer conn.mu.Unlock()
	for i, sent := range conn.calls {
		md, _ := metadata.FromOutgoingContext(sent.ctx)
		if got := md.Get("authorization"); len(got) != 1 || got[0] != "Bearer s3cret" {
			t.Fatalf("call %d: authorization %v", i, got)
		}
	}
	// The default deadline, then the caller's own: never one in between.
	first, _ := conn.calls[0].ctx.Deadline()
	second, _ := conn.calls[1].ctx.Deadline()
	if first.Before(before.Add(time.Minute)) || first.After(time.Now().Add(time.Minute)) {
		t.Fatalf("default deadline %v is not a minute from the call", first)
	}
	if want, _ := mine.Deadline(); !second.Equal(want) {
		t.Fatalf("deadline %v, want the caller's %v", second, want)
	}
}

func TestABudgetRefusalIsABudgetErrorWithNumbers(t *testing.T) {
	refusal, _ := status.New(codes.FailedPrecondition, "full").WithDetails(&errdetails.ErrorInfo{
		Reason: "TIER_BUDGET_EXCEEDED", Domain: "memory.v1",
		Metadata: map[string]string{"tier": "user", "used_chars": "1300", "limit_chars": "1375", "requested_chars": "120"},
	})
	conn := &fakeConn{answer: func(string, int, proto.Message) (proto.Message, error) {
		return nil, refusal.Err()
	}}
	_, err := New(conn, scope, fast).AddMemory(context.Background(), &memoryv1.AddMemoryRequest{Content: "x"})
	var budget *BudgetError
	if !errors.As(err, &budget) {
		t.Fatalf("%T %v is no *BudgetError", err, err)
	}
	if budget.Tier != "user" || budget.UsedChars != 1300 || budget.LimitChars != 1375 || budget.RequestedChars != 120 {
		t.Fatalf("budget %+v", budget)
	}
	var failed *Error
	if !errors.As(err, &failed) || failed.Reason != ReasonTierBudgetExceeded || failed.Metadata["tier"] != "user" {
		t.Fatalf("as *Error: %v", failed)
	}
	if status.Code(err) != codes.FailedPrecondition || len(conn.calls) != 1 {
		t.Fatalf("code %v after %d attempts", status.Code(err), len(conn.calls))
	}
}

func TestMemoriesFollowsPageTokens(t *testing.T) {
	pages := map[string]*memoryv1.GetMemoriesResponse{
		"":   {Memories: []*memoryv1.Memory{{Id: "a"}, {Id: "b"}}, NextPageToken: "p2"},
		"p2": {Memories: []*memoryv1.Memory{}, NextPageToken: "p3"},
		"p3": {Memories: []*memoryv1.Memory{{Id: "c"}}},
	}
	conn := &fakeConn{answer: func(_ string, _ int, req proto.Message) (proto.Message, error) {
		return pages[req.(*memoryv1.GetMemoriesRequest).GetPageToken()], nil
	}}
	it := New(conn, scope).Memories(context.Background(), &memoryv1.GetMemoriesRequest{PageSize: 2})
	var ids []string
	for it.Next() {
		ids = append(ids, it.Memory().GetId())
	}
	if it.Err() != nil || strings.Join(ids, ",") != "a,b,c" {
		t.Fatalf("ids %v, error %v", ids, it.Err())
	}
}

func TestExportResumesFromTheLastCursorAfterACut(t *testing.T) {
	conn := &fakeConn{openings: func(_ string, n int, req proto.Message) ([]proto.Message, error) {
		switch cursor := req.(*memoryv1.ExportMemoriesRequest).GetCursor(); {
		case n == 1 && cursor == "":
			return []proto.Message{&memoryv1.ExportMemoriesResponse{Jsonl: "{\"a\":1}\n{\"b\":2}\n", Count: 2, Cursor: "c1"}},
				unavailable("")
		case n == 2 && cursor == "c1":
			return []proto.Message{&memoryv1.ExportMemoriesResponse{Jsonl: "{\"c\":3}\n", Count: 1, Cursor: "c2", Done: true}}, io.EOF
		}
		return nil, status.Errorf(codes.InvalidArgument, "opening %d with cursor %q", n, req.(*memoryv1.ExportMemoriesRequest).GetCursor())
	}}
	it := New(conn, scope, fast).Export(context.Background(), &memoryv1.ExportMemoriesRequest{BatchSize: 2})
	var lines []string
	for it.Next() {
		lines = append(lines, it.Line())
	}
	if it.Err() != nil || strings.Join(lines, " ") != `{"a":1} {"b":2} {"c":3}` || it.Resumes() != 1 {
		t.Fatalf("lines %v, resumes %d, error %v", lines, it.Resumes(), it.Err())
	}
}

func TestWatchResumesBehindTheLastEventAfterACut(t *testing.T) {
	conn := &fakeConn{openings: func(_ string, n int, req proto.Message) ([]proto.Message, error) {
		w := req.(*memoryv1.WatchMemoriesRequest)
		event := func(gen int64, id string) proto.Message {
			return &memoryv1.WatchMemoriesResponse{Event: &memoryv1.MemoryEvent{
				Kind: memoryv1.MemoryEvent_KIND_ADD, Generation: gen, Tier: memoryv1.Tier_TIER_MEMORY, Id: id,
			}}
		}
		switch {
		case n == 1 && w.GetAfterGeneration() == 0:
			return []proto.Message{event(5, "a")}, unavailable("")
		case n == 2 && w.GetAfterGeneration() == 5 && w.GetAfterId() == "a" && w.GetAfterTier() == memoryv1.Tier_TIER_MEMORY:
			return []proto.Message{event(5, "b"), event(6, "c")}, status.Error(codes.Canceled, "done")
		}
		return nil, status.Errorf(codes.InvalidArgument, "opening %d: %v", n, w)
	}}
	it := New(conn, scope, fast).Watch(context.Background(), &memoryv1.WatchMemoriesRequest{})
	var ids []string
	for it.Next() {
		ids = append(ids, it.Event().GetId())
	}
	var failed *Error
	if !errors.As(it.Err(), &failed) || failed.Code != codes.Canceled || strings.Join(ids, ",") != "a,b,c" {
		t.Fatalf("ids %v, error %v", ids, it.Err())
	}
	it.Close()
}

func TestToolsComeInEitherShape(t *testing.T) {
	listed := &memoryv1.ListToolsResponse{
		Tools: []*memoryv1.Tool{
			{Name: "memory", OpenaiJson: `{"type":"function","function":{"name":"memory"}}`, AnthropicJson: `{"name":"memory"}`},
			{Name: "memory_search", OpenaiJson: `{"type":"function","function":{"name":"memory_search"}}`, AnthropicJson: `{"name":"memory_search"}`},
		},
		ClaudeMemoryTool: &memoryv1.Tool{Name: ClaudeMemoryTool, AnthropicJson: `{"type":"memory_20250818","name":"memory"}`},
	}
	conn := &fakeConn{answer: func(string, int, proto.Message) (proto.Message, error) { return listed, nil }}
	c := New(conn, scope)
	shapes := map[string][]json.RawMessage{}
	for name, make := range map[string]func() ([]json.RawMessage, error){
		"openai":    func() ([]json.RawMessage, error) { return c.Tools(context.Background(), OpenAI) },
		"anthropic": func() ([]json.RawMessage, error) { return c.Tools(context.Background(), Anthropic) },
		"claude": func() ([]json.RawMessage, error) {
			return c.Tools(context.Background(), Anthropic, WithClaudeMemoryTool())
		},
	} {
		tools, err := make()
		if err != nil {
			t.Fatal(err)
		}
		shapes[name] = tools
	}
	if string(shapes["openai"][1]) != `{"type":"function","function":{"name":"memory_search"}}` ||
		string(shapes["anthropic"][0]) != `{"name":"memory"}` ||
		string(shapes["claude"][0]) != `{"type":"memory_20250818","name":"memory"}` ||
		string(shapes["claude"][1]) != `{"name":"memory_search"}` {
		t.Fatalf("shapes %s", shapes)
	}
	if _, err := c.Tools(context.Background(), ToolFormat(9)); err == nil {
		t.Fatal("an unknown format was accepted")
	}
}

func TestBackoffIsJitteredAndCapped(t *testing.T) {
	p := DefaultRetryPolicy()
	for retry := 1; retry <= 10; retry++ {
		ceiling := p.FirstBackoff << (retry - 1)
		if ceiling > p.MaxBackoff || ceiling <= 0 {
			ceiling = p.MaxBackoff
		}
		for i := 0; i < 50; i++ {
			if wait := p.backoff(retry); wait < 0 || wait > ceiling {
				t.Fatalf("retry %d waited %v, over %v", retry, wait, ceiling)
			}
		}
	}
}

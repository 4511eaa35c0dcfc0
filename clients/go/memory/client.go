// Package memory is a client of memory-sidecar's memory.v1 gRPC API, bound
// to one scope: retries with back-off, read-your-writes, typed errors,
// iterators that page and resume, and the turn loop of an agent runtime
// (clients/README.md is the contract all three clients share).
//
//	c, err := memory.Dial(ctx, "127.0.0.1:50051", memory.Scope{AgentID: "coder", UserID: "alice"})
//	if err != nil { ... }
//	defer c.Close()
//	turn, err := c.Turn(ctx, "session-1", "Where is the deploy script?")
//
// Every method takes a context. A context without a deadline gets the
// client's default for unary calls (10 s, WithTimeout); one with a deadline
// keeps it, which is how a caller overrides the default for one call.
// Streams (Export, Watch) have no deadline unless the context has one.
package memory

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

// Version is this client's version: 1.x serves memory.v1 (clients/README.md,
// "Versioning").
const Version = "1.0.0"

// DefaultTimeout is the deadline a unary call gets when its context has none.
const DefaultTimeout = 10 * time.Second

// Scope names whose memories the client reads and writes: the agent's notes
// (AgentID) and the user's profile (UserID). Empty ids are the default scope.
type Scope struct {
	AgentID string
	UserID  string
}

func (s Scope) proto() *memoryv1.Scope {
	return &memoryv1.Scope{AgentId: s.AgentID, UserId: s.UserID}
}

// RetryPolicy says how UNAVAILABLE is retried: Attempts in all (1: never
// retried), the first back-off, its growth and its cap. Each wait is drawn
// uniformly from zero to the back-off ("full jitter"), so clients that fail
// together do not retry together.
type RetryPolicy struct {
	Attempts     int
	FirstBackoff time.Duration
	Multiplier   float64
	MaxBackoff   time.Duration
}

// DefaultRetryPolicy is the policy every client of memory.v1 uses unless
// told otherwise: 4 attempts, 50 ms doubling, capped at 2 s.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{Attempts: 4, FirstBackoff: 50 * time.Millisecond, Multiplier: 2, MaxBackoff: 2 * time.Second}
}

type config struct {
	token          string
	timeout        time.Duration
	retry          RetryPolicy
	readYourWrites bool
	dialOptions    []grpc.DialOption
}

// Option configures a Client.
type Option func(*config)

// WithToken sends `authorization: Bearer <token>` on every call.
func WithToken(token string) Option { return func(c *config) { c.token = token } }

// WithTimeout sets the deadline of unary calls whose context has none;
// 0 means none.
func WithTimeout(d time.Duration) Option { return func(c *config) { c.timeout = d } }

// WithRetry replaces the retry policy; RetryPolicy{Attempts: 1} turns
// retries off.
func WithRetry(p RetryPolicy) Option { return func(c *config) { c.retry = p } }

// WithoutReadYourWrites stops sending the highest generation the client
// wrote as min_generation on reads.
func WithoutReadYourWrites() Option { return func(c *config) { c.readYourWrites = false } }

// WithDialOptions adds grpc.DialOptions to what Dial uses (TLS credentials,
// interceptors); New ignores them.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(c *config) { c.dialOptions = append(c.dialOptions, opts...) }
}

// Client calls one daemon in one scope. It is safe for concurrent use.
type Client struct {
	stub  memoryv1.MemoryServiceClient
	owned *grpc.ClientConn
	scope Scope
	cfg   config

	mu         sync.Mutex
	generation uint64
}

// Dial connects to the daemon at target and binds a client to scope. The
// connection is plaintext unless WithDialOptions brings transport
// credentials: grpc.WithInsecure, since grpc-go 1.33 (Debian 12's, which CI
// builds against) predates credentials/insecure and grpc.NewClient. Dial
// does not wait for the connection; the first call does.
func Dial(ctx context.Context, target string, scope Scope, opts ...Option) (*Client, error) {
	cfg := newConfig(opts)
	dialOptions := append([]grpc.DialOption{grpc.WithInsecure()}, cfg.dialOptions...)
	conn, err := grpc.DialContext(ctx, target, dialOptions...)
	if err != nil {
		return nil, err
	}
	c := New(conn, scope, opts...)
	c.owned = conn
	return c, nil
}

// New binds a client to scope over a connection the caller owns (Close
// leaves it open).
func New(conn grpc.ClientConnInterface, scope Scope, opts ...Option) *Client {
	return &Client{stub: memoryv1.NewMemoryServiceClient(conn), scope: scope, cfg: newConfig(opts)}
}

func newConfig(opts []Option) config {
	cfg := config{timeout: DefaultTimeout, retry: DefaultRetryPolicy(), readYourWrites: true}
	for _, opt := range opts {
		opt(&cfg)
	}
	if cfg.retry.Attempts < 1 {
		cfg.retry.Attempts = 1
	}
	return cfg
}

// Close closes the connection Dial made.
func (c *Client) Close() error {
	if c.owned == nil {
		return nil
	}
	return c.owned.Close()
}

// Scope is the scope the client is bound to.
func (c *Client) Scope() Scope { return c.scope }

// Stub is the generated stub under the client, for what the client does
// not wrap (ForgetUser, DeleteScope): no scope, retry or typed errors.
func (c *Client) Stub() memoryv1.MemoryServiceClient { return c.stub }

// Generation is the highest generation a write of this client returned
// (0 before any), the min_generation its reads send.
func (c *Client) Generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.generation
}

func (c *Client) wrote(generation uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if generation > c.generation {
		c.generation = generation
	}
}

// minGeneration is what a read sends as min_generation: the caller's own
// when it set one, else the client's highest write.
func (c *Client) minGeneration(given uint64) uint64 {
	if given != 0 || !c.cfg.readYourWrites {
		return given
	}
	return c.Generation()
}

// unaryContext adds the token and, when the context has no deadline, the
// default one.
func (c *Client) unaryContext(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx = c.withToken(ctx)
	if _, ok := ctx.Deadline(); ok || c.cfg.timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.cfg.timeout)
}

func (c *Client) withToken(ctx context.Context) context.Context {
	if c.cfg.token == "" {
		return ctx
	}
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.cfg.token)
}

// clone copies the caller's request, which the client never changes in
// place (it sets the scope, a key, min_generation on its copy).
func clone[T proto.Message](req T) T {
	return proto.Clone(req).(T)
}

// scope is the request's own scope, or the client's when it names none.
func (c *Client) scopeOr(given *memoryv1.Scope) *memoryv1.Scope {
	if given != nil {
		return given
	}
	return c.scope.proto()
}

// AddMemory stores an entry. Without an idempotency_key the client sets a
// random one, so a retry after a cut connection returns the entry the
// first attempt stored instead of storing it twice.
func (c *Client) AddMemory(ctx context.Context, req *memoryv1.AddMemoryRequest) (*memoryv1.AddMemoryResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	if req.IdempotencyKey == "" {
		req.IdempotencyKey = newUUID()
	}
	resp, err := unary(ctx, c, true, c.stub.AddMemory, req)
	if err == nil {
		c.wrote(resp.GetGeneration())
	}
	return resp, err
}

// UpdateMemory changes an entry. It has no idempotency key, so it is not
// retried once it may have reached the daemon.
func (c *Client) UpdateMemory(ctx context.Context, req *memoryv1.UpdateMemoryRequest) (*memoryv1.UpdateMemoryResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	resp, err := unary(ctx, c, false, c.stub.UpdateMemory, req)
	if err == nil {
		c.wrote(resp.GetGeneration())
	}
	return resp, err
}

// DeleteMemory removes an entry; not retried, as UpdateMemory.
func (c *Client) DeleteMemory(ctx context.Context, req *memoryv1.DeleteMemoryRequest) (*memoryv1.DeleteMemoryResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	resp, err := unary(ctx, c, false, c.stub.DeleteMemory, req)
	if err == nil {
		c.wrote(resp.GetGeneration())
	}
	return resp, err
}

// GetMemories reads one page; Memories iterates over all of them.
func (c *Client) GetMemories(ctx context.Context, req *memoryv1.GetMemoriesRequest) (*memoryv1.GetMemoriesResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	req.MinGeneration = c.minGeneration(req.MinGeneration)
	return unary(ctx, c, true, c.stub.GetMemories, req)
}

// SearchMemories reads one page of hits; Search iterates over all of them.
func (c *Client) SearchMemories(ctx context.Context, req *memoryv1.SearchMemoriesRequest) (*memoryv1.SearchMemoriesResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	req.MinGeneration = c.minGeneration(req.MinGeneration)
	return unary(ctx, c, true, c.stub.SearchMemories, req)
}

// InjectForTurn is the whole InjectForTurn call; Turn is its short form.
func (c *Client) InjectForTurn(ctx context.Context, req *memoryv1.InjectForTurnRequest) (*memoryv1.InjectForTurnResponse, error) {
	req = clone(req)
	req.Scope = c.scopeOr(req.Scope)
	req.MinGeneration = c.minGeneration(req.MinGeneration)
	return unary(ctx, c, true, c.stub.InjectForTurn, req)
}

// ListTools describes the memory tools; Tools gives them in a model API's
// shape.
func (c *Client) ListTools(ctx context.Context) (*memoryv1.ListToolsResponse, error) {
	return unary(ctx, c, true, c.stub.ListTools, &memoryv1.ListToolsRequest{Scope: c.scope.proto()})
}

package memory

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

// TurnBlocks is what to put into the prompt before one model call.
type TurnBlocks struct {
	// SystemBlock is the frozen block: both tiers as of the session's
	// snapshot, byte-identical from turn to turn until a compaction, so a
	// model's prefix cache keeps it. Empty when there is nothing to show.
	SystemBlock string
	// TurnContext is the <memories> block relevant to this message.
	TurnContext string
	// Generation is the write generation SystemBlock was built at.
	Generation uint64
	// SHA256 is the hex SHA-256 of SystemBlock, a key for a prefix cache.
	SHA256 string
	// CacheHit is true when SystemBlock came from the snapshot unchanged.
	CacheHit bool
	// Response is the whole answer (token counts, ids, usage).
	Response *memoryv1.InjectForTurnResponse
}

// Turn asks what to inject before the model answers message in session.
func (c *Client) Turn(ctx context.Context, session, message string) (*TurnBlocks, error) {
	resp, err := c.InjectForTurn(ctx, &memoryv1.InjectForTurnRequest{SessionId: session, UserMessage: message})
	if err != nil {
		return nil, err
	}
	return &TurnBlocks{
		SystemBlock: resp.GetSystemBlock(),
		TurnContext: resp.GetTurnContext(),
		Generation:  resp.GetSnapshotGeneration(),
		SHA256:      resp.GetSnapshotSha256(),
		CacheHit:    resp.GetCacheHit(),
		Response:    resp,
	}, nil
}

// ToolFormat is the shape of a model API's tool declarations.
type ToolFormat int

const (
	// OpenAI: {"type": "function", "function": {...}}.
	OpenAI ToolFormat = iota + 1
	// Anthropic: {"name", "description", "input_schema"}.
	Anthropic
)

// ToolsOption changes what Tools returns.
type ToolsOption func(*toolsConfig)

type toolsConfig struct{ claudeMemoryTool bool }

// WithClaudeMemoryTool declares Claude's own memory tool (memory_20250818,
// {"type": "memory_20250818", "name": "memory"}) in place of the memory
// tool, with Anthropic's format. Claude then calls it as "memory": pass
// those calls to CallTool as "memory_20250818".
func WithClaudeMemoryTool() ToolsOption { return func(t *toolsConfig) { t.claudeMemoryTool = true } }

// ClaudeMemoryTool is the name CallTool takes for Claude's memory tool.
const ClaudeMemoryTool = "memory_20250818"

// Tools is the memory tools' declarations in format, each a JSON object to
// pass to the model's API as it is.
func (c *Client) Tools(ctx context.Context, format ToolFormat, opts ...ToolsOption) ([]json.RawMessage, error) {
	var cfg toolsConfig
	for _, opt := range opts {
		opt(&cfg)
	}
	if format != OpenAI && format != Anthropic {
		return nil, fmt.Errorf("memory: unknown tool format %d (OpenAI or Anthropic)", format)
	}
	listed, err := c.ListTools(ctx)
	if err != nil {
		return nil, err
	}
	declarations := make([]json.RawMessage, 0, len(listed.GetTools())+1)
	for _, tool := range listed.GetTools() {
		switch {
		case format == OpenAI:
			declarations = append(declarations, json.RawMessage(tool.GetOpenaiJson()))
		case cfg.claudeMemoryTool && tool.GetName() == "memory" && listed.GetClaudeMemoryTool() != nil:
			// Both are named memory, and Anthropic's API refuses two tools
			// of one name: Claude's own takes the place of ours.
			declarations = append(declarations, json.RawMessage(listed.GetClaudeMemoryTool().GetAnthropicJson()))
		default:
			declarations = append(declarations, json.RawMessage(tool.GetAnthropicJson()))
		}
	}
	return declarations, nil
}

// ToolResult is what a tool call gives back to the model.
type ToolResult struct {
	// Text is the tool result's content for the model.
	Text string
	// IsError is true when the call did not do what it asked (the model's
	// mistake or a refusal such as a full tier); Text says what to do.
	IsError bool
	// Structured is the outcome as a JSON object, for the runtime.
	Structured json.RawMessage
	// Generation is the highest generation the call's writes took (0: it
	// wrote nothing); the client's reads wait for it, as for AddMemory's.
	Generation uint64
}

// readingTools are the tools that never write, so a call of theirs is
// retried as any read is; a call of any other tool has no idempotency key
// and is not retried once it may have reached the daemon.
var readingTools = map[string]bool{"memory_search": true, "memory_list": true}

// CallTool runs one tool call of the model (name and its JSON arguments as
// the model gave them) in the client's scope.
func (c *Client) CallTool(ctx context.Context, session, name, arguments string) (*ToolResult, error) {
	req := &memoryv1.CallToolRequest{Scope: c.scope.proto(), SessionId: session, Name: name, ArgumentsJson: arguments}
	resp, err := unary(ctx, c, readingTools[name] || viewsOnly(name, arguments), c.stub.CallTool, req)
	if err != nil {
		return nil, err
	}
	// A writing tool's generation counts as AddMemory's (0: it wrote nothing).
	c.wrote(resp.GetGeneration())
	result := &ToolResult{Text: resp.GetText(), IsError: resp.GetIsError(), Generation: resp.GetGeneration()}
	if resp.GetStructuredJson() != "" {
		result.Structured = json.RawMessage(resp.GetStructuredJson())
	}
	return result, nil
}

// viewsOnly is whether a memory_20250818 call is a view, which reads.
func viewsOnly(name, arguments string) bool {
	if name != ClaudeMemoryTool {
		return false
	}
	var call struct {
		Command string `json:"command"`
	}
	return json.Unmarshal([]byte(arguments), &call) == nil && call.Command == "view"
}

// NotifyCompaction tells the daemon the runtime compacted session's
// context, so its frozen block is rebuilt on the next turn.
func (c *Client) NotifyCompaction(ctx context.Context, session string) (*memoryv1.NotifyCompactionResponse, error) {
	req := &memoryv1.NotifyCompactionRequest{SessionId: session, Scope: c.scope.proto()}
	return unary(ctx, c, true, c.stub.NotifyCompaction, req)
}

// EndSession drops session's snapshot. Retried as a read is: ending a
// session twice is harmless (the second answers dropped = false).
func (c *Client) EndSession(ctx context.Context, session string) (*memoryv1.EndSessionResponse, error) {
	req := &memoryv1.EndSessionRequest{SessionId: session, Scope: c.scope.proto()}
	return unary(ctx, c, true, c.stub.EndSession, req)
}

// A worked agent loop over the Go client: a runtime that injects memory
// before every model call, hands the model the memory tools, runs the
// model's tool calls, and ends the session. The model is a scripted stand-in
// (no network, no API key), so the loop runs anywhere a daemon does:
//
//	agentloop [ADDRESS]      (default 127.0.0.1:50051)
//
// It prints one JSON line per step; tests/clients/test_go_client.py runs it
// against a real daemon.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memory"
	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

// message is one entry of the conversation the model sees.
type message struct {
	Role    string // system, user, assistant, tool
	Content string
}

// reply is what the model answers: a tool call, or text for the user.
type reply struct {
	Tool      string
	Arguments string
	Text      string
}

// scriptedModel stands in for a language model. It reads what a model
// would (the frozen block as its system prompt, the turn block beside the
// user's message, tool results) and answers by rule: "Remember ..." saves a
// note with the memory tool, "Which notes ..." searches them, any other
// question is answered from the injected blocks.
type scriptedModel struct{ tools map[string]bool }

func (m scriptedModel) respond(conversation []message) reply {
	system, user := conversation[0].Content, conversation[1].Content
	last := conversation[len(conversation)-1]
	question := user[strings.LastIndex(user, "\n")+1:]
	switch {
	case last.Role == "tool":
		return reply{Text: "The memory tool said: " + strings.ReplaceAll(last.Content, "\n", " ")}
	case strings.HasPrefix(question, "Remember that ") && m.tools["memory"]:
		note := strings.TrimSuffix(strings.TrimPrefix(question, "Remember that "), ".")
		arguments, _ := json.Marshal(map[string]string{"action": "add", "content": note})
		return reply{Tool: "memory", Arguments: string(arguments)}
	case strings.HasPrefix(question, "Which notes") && m.tools["memory_search"]:
		return reply{Tool: "memory_search", Arguments: `{"query": "deploys"}`}
	}
	for _, line := range strings.Split(system+"\n"+user, "\n") {
		if strings.Contains(line, "deploy") && line != question {
			return reply{Text: "From memory: " + strings.TrimSpace(line)}
		}
	}
	return reply{Text: "I have nothing on that."}
}

// say prints one step as a line of JSON.
func say(step string, fields map[string]any) {
	fields["step"] = step
	line, err := json.Marshal(fields)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(string(line))
}

func main() {
	log.SetFlags(0)
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: agentloop [ADDRESS]   (default 127.0.0.1:50051)")
	}
	flag.Parse()
	address := "127.0.0.1:50051"
	if flag.NArg() > 0 {
		address = flag.Arg(0)
	}
	if err := run(address); err != nil {
		log.Fatal(err)
	}
}

func run(address string) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client, err := memory.Dial(ctx, address, memory.Scope{AgentID: "go-loop-agent", UserID: "go-loop-user"},
		memory.WithToken(os.Getenv("MEMORY_SIDECAR_TOKEN")))
	if err != nil {
		return err
	}
	defer client.Close()

	// What the runtime knows before any model call: the user's profile.
	if _, err := client.AddMemory(ctx, &memoryv1.AddMemoryRequest{
		Tier: memoryv1.Tier_TIER_USER, Content: "The user's name is Ada",
	}); err != nil {
		return err
	}

	// The tools as OpenAI declares them; the stand-in only checks names.
	declared, err := client.Tools(ctx, memory.OpenAI)
	if err != nil {
		return err
	}
	model := scriptedModel{tools: map[string]bool{}}
	var names []string
	for _, declaration := range declared {
		var tool struct {
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		}
		if err := json.Unmarshal(declaration, &tool); err != nil {
			return err
		}
		model.tools[tool.Function.Name] = true
		names = append(names, tool.Function.Name)
	}
	say("tools", map[string]any{"names": names})

	const session = "go-loop-session"
	for turn, user := range []string{
		"Remember that deploys go through ops/deploy.sh.",
		"Which notes do you have about deploys?",
		"How do I deploy?",
	} {
		blocks, err := client.Turn(ctx, session, user)
		if err != nil {
			return err
		}
		say("turn", map[string]any{
			"turn":         turn + 1,
			"cache_hit":    blocks.CacheHit,
			"generation":   blocks.Generation,
			"system_block": blocks.SystemBlock,
			"turn_context": blocks.TurnContext,
		})
		// The frozen block is the system prompt (a prefix cache keeps it);
		// the turn block goes beside the user's message.
		conversation := []message{
			{Role: "system", Content: blocks.SystemBlock},
			{Role: "user", Content: strings.TrimSpace(blocks.TurnContext + "\n" + user)},
		}
		for {
			answer := model.respond(conversation)
			if answer.Tool == "" {
				say("answer", map[string]any{"turn": turn + 1, "text": answer.Text})
				break
			}
			result, err := client.CallTool(ctx, session, answer.Tool, answer.Arguments)
			if err != nil {
				return err
			}
			say("tool", map[string]any{
				"turn": turn + 1, "name": answer.Tool, "is_error": result.IsError, "text": result.Text,
			})
			conversation = append(conversation,
				message{Role: "assistant", Content: answer.Tool + " " + answer.Arguments},
				message{Role: "tool", Content: result.Text})
		}
	}

	// The runtime compacted the conversation: the next turn's frozen block
	// is rebuilt. Then the session ends.
	compacted, err := client.NotifyCompaction(ctx, session)
	if err != nil {
		return err
	}
	say("compaction", map[string]any{"invalidated": compacted.GetInvalidated()})
	ended, err := client.EndSession(ctx, session)
	if err != nil {
		return err
	}
	say("end", map[string]any{"dropped": ended.GetDropped()})
	return nil
}

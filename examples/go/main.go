// A memory-sidecar client in Go: grpc-go with stubs that protoc,
// protoc-gen-go and protoc-gen-go-grpc generate from protos/ into the
// package example.com/memoryclient/memoryv1 (README.md beside this file).
//
//	client [ADDRESS]      (default 127.0.0.1:50051)
//
// It adds a memory to each tier, runs two turns of one session, reads the
// structured details of a budget error, and ends the session, printing one
// JSON line per step.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	memoryv1 "example.com/memoryclient/memoryv1"
)

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
		fmt.Fprintln(os.Stderr, "usage: client [ADDRESS]   (default 127.0.0.1:50051)")
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
	// WithInsecure rather than credentials/insecure: Debian 12's grpc-go
	// (1.33) predates that package.
	conn, err := grpc.Dial(address, grpc.WithInsecure())
	if err != nil {
		return err
	}
	defer conn.Close()
	client := memoryv1.NewMemoryServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	scope := &memoryv1.Scope{AgentId: "go-agent", UserId: "go-user"}

	for _, request := range []*memoryv1.AddMemoryRequest{
		{Scope: scope, Tier: memoryv1.Tier_TIER_MEMORY, Content: "The deploy script lives in ops/deploy.sh"},
		{Scope: scope, Tier: memoryv1.Tier_TIER_USER, Content: "The user prefers answers in French",
			Confidence: proto.Float64(0.9)},
	} {
		added, err := client.AddMemory(ctx, request)
		if err != nil {
			return err
		}
		say("add", map[string]any{
			"tier":  added.GetMemory().GetTier().String(),
			"used":  added.GetUsage().GetUsedChars(),
			"limit": added.GetUsage().GetLimitChars(),
		})
	}

	for turn := 1; turn <= 2; turn++ {
		injected, err := client.InjectForTurn(ctx, &memoryv1.InjectForTurnRequest{
			Scope: scope, SessionId: "go-session", UserMessage: "Where is the deploy script?",
		})
		if err != nil {
			return err
		}
		// snapshot_sha256 is the hex SHA-256 of system_block's UTF-8 bytes:
		// a runtime can key its prefix cache on it.
		sum := sha256.Sum256([]byte(injected.GetSystemBlock()))
		say("turn", map[string]any{
			"turn":         turn,
			"cache_hit":    injected.GetCacheHit(),
			"sha256":       injected.GetSnapshotSha256(),
			"sha256_match": hex.EncodeToString(sum[:]) == injected.GetSnapshotSha256(),
			"turn_context": injected.GetTurnContext(),
		})
	}

	// Over the agent notes' budget (2,200 characters by default): refused
	// with FAILED_PRECONDITION and a google.rpc.ErrorInfo in the details.
	_, err = client.AddMemory(ctx, &memoryv1.AddMemoryRequest{
		Scope: scope, Tier: memoryv1.Tier_TIER_MEMORY, Content: strings.Repeat("x", 2170),
	})
	if err == nil {
		say("budget", map[string]any{"refused": false})
	} else {
		st := status.Convert(err)
		refusal := map[string]any{"refused": true, "code": st.Code().String(), "message": st.Message()}
		for _, detail := range st.Details() {
			if info, ok := detail.(*errdetails.ErrorInfo); ok {
				refusal["info"] = map[string]any{
					"reason":   info.GetReason(),
					"domain":   info.GetDomain(),
					"metadata": info.GetMetadata(),
				}
			}
		}
		say("budget", refusal)
	}

	ended, err := client.EndSession(ctx, &memoryv1.EndSessionRequest{SessionId: "go-session", Scope: scope})
	if err != nil {
		return err
	}
	say("end", map[string]any{"dropped": ended.GetDropped()})
	return nil
}

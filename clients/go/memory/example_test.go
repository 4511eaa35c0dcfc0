package memory_test

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/memory-sidecar/memory-sidecar/clients/go/memory"
	"github.com/memory-sidecar/memory-sidecar/clients/go/memoryv1"
)

// The README's "Use" section, compiled by `go test` (not run: no output is
// declared, and it needs a daemon).
func Example() {
	if err := use(); err != nil {
		fmt.Println(err)
	}
}

func use() error {
	ctx := context.Background()
	c, err := memory.Dial(ctx, "127.0.0.1:50051",
		memory.Scope{AgentID: "coder", UserID: "alice"},
		memory.WithToken(os.Getenv("MEMORY_SIDECAR_TOKEN")))
	if err != nil {
		return err
	}
	defer c.Close()

	// A write: the client adds an idempotency key, so a retry stores it once.
	added, err := c.AddMemory(ctx, &memoryv1.AddMemoryRequest{
		Tier: memoryv1.Tier_TIER_USER, Content: "The user prefers answers in French",
	})
	var budget *memory.BudgetError
	switch {
	case errors.As(err, &budget):
		fmt.Printf("the %s tier is full: %d of %d chars used, %d needed\n",
			budget.Tier, budget.UsedChars, budget.LimitChars, budget.RequestedChars)
	case err != nil:
		return err
	default:
		fmt.Println("stored at generation", added.GetGeneration())
	}

	// Reads after it send min_generation = that generation: they see the
	// write on any replica.
	it := c.Memories(ctx, &memoryv1.GetMemoriesRequest{})
	for it.Next() {
		fmt.Println(it.Memory().GetContent())
	}
	if err := it.Err(); err != nil {
		return err
	}
	return nil
}

package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/fortune"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// fortuneGolden is model/fortune/testdata/golden.json: greedy continuations
// recorded from transformers in float32 when the model was trained.
type fortuneGolden struct {
	Greedy []struct {
		Prompt    string    `json:"prompt"`
		PromptIDs []int32   `json:"prompt_ids"`
		IDs       []int32   `json:"ids"`
		Text      string    `json:"text"`
		MinMargin float64   `json:"min_margin"`
		Margins   []float64 `json:"margins"`
	} `json:"greedy"`
}

func readFortuneGolden(t *testing.T) fortuneGolden {
	t.Helper()
	b, err := os.ReadFile("../../model/fortune/testdata/golden.json")
	if err != nil {
		t.Fatal(err)
	}
	var g fortuneGolden
	if err := json.Unmarshal(b, &g); err != nil {
		t.Fatal(err)
	}
	if len(g.Greedy) == 0 {
		t.Fatal("golden.json holds no greedy continuations")
	}
	return g
}

// TestFortuneGolden serves the built-in model on a cluster of three stage
// daemons on the CPU and checks that greedy decoding of every golden prompt
// gives, token for token, the continuation transformers gave in float32
// (past the end of text: ignore_eos), with the same prompt tokens.
func TestFortuneGolden(t *testing.T) {
	g := readFortuneGolden(t)
	dir := filepath.Join(t.TempDir(), "fortune")
	if err := fortune.Write(dir); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, logs := startCluster(t, ctx, dir, 3, false)
	checkLoadProgress(t, dir, logs.String(), 3)
	got := make([]generated, len(g.Greedy))
	errs := make([]error, len(g.Greedy))
	var wg sync.WaitGroup
	for i, gc := range g.Greedy {
		wg.Go(func() {
			got[i], errs[i] = generate(ctx, c.Conn, &tandemv1.GenerateRequest{Prompt: gc.Prompt, MaxTokens: uint32(len(gc.IDs)), Temperature: proto.Float32(0), IgnoreEos: true})
		})
	}
	wg.Wait()
	for i, gc := range g.Greedy {
		if errs[i] != nil {
			t.Fatalf("%q: %v", gc.Prompt, errs[i])
		}
		if !slices.Equal(got[i].ids, gc.IDs) {
			n := 0
			for n < min(len(got[i].ids), len(gc.IDs)) && got[i].ids[n] == gc.IDs[n] {
				n++
			}
			margin := 0.0
			if n < len(gc.Margins) {
				margin = gc.Margins[n]
			}
			t.Errorf("%q: tokens %v, transformers %v: first difference at token %d (transformers' margin there %.4f)", gc.Prompt, got[i].ids, gc.IDs, n, margin)
			continue
		}
		if u := got[i].usage; u.GetPromptTokens() != uint32(len(gc.PromptIDs)) {
			t.Errorf("%q: %d prompt tokens, transformers %d", gc.Prompt, u.GetPromptTokens(), len(gc.PromptIDs))
		}
		// The text is the golden continuation without its special tokens.
		want := strings.NewReplacer("<|begin_of_text|>", "", "<|end_of_text|>", "").Replace(gc.Text)
		if got[i].text != want {
			t.Errorf("%q: text %q, want %q", gc.Prompt, got[i].text, want)
		}
		t.Logf("%q: %d tokens as transformers (least margin %.4f): %q", gc.Prompt, len(gc.IDs), gc.MinMargin, got[i].text)
	}
}

// loadDone matches a stage daemon's progress line for its loaded weights.
var loadDone = regexp.MustCompile(`msg="load layers \[(\d+),(\d+)\)" state=done bytes=(\d+) total_bytes=(\d+) `)

// checkLoadProgress checks that each of the stages logged its weights
// loaded in full, and that together they read every tensor of the
// checkpoint once, and the embedding twice when the last stage reuses it
// as the LM head.
func checkLoadProgress(t *testing.T, dir, logs string, stages int) {
	t.Helper()
	ck, err := model.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	var want int64
	for _, n := range ck.Names() {
		tn, err := ck.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		want += int64(len(tn.Data))
		if n == model.EmbedName && ck.Config().TieEmbedding && stages > 1 {
			want += int64(len(tn.Data))
		}
	}
	var got int64
	ms := loadDone.FindAllStringSubmatch(logs, -1)
	for _, m := range ms {
		if m[3] != m[4] {
			t.Errorf("layers [%s,%s): %s of %s bytes loaded", m[1], m[2], m[3], m[4])
		}
		n, _ := strconv.ParseInt(m[3], 10, 64)
		got += n
	}
	if len(ms) != stages || got != want {
		t.Errorf("%d stages logged their weights loaded, %d bytes in all; want %d stages, %d bytes:\n%s", len(ms), got, stages, want, logs)
	}
}

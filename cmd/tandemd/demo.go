package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/randinit"
	"github.com/tandem-llm/tandem/model/tokenizer"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage"
)

type demoOptions struct {
	model       string
	stages      int
	prompt      string
	maxTokens   int
	temperature float32
	seed        uint64
	// exe and env start the stage processes (default: this executable).
	exe string
	env []string
}

func newDemoCmd() *cobra.Command {
	var o demoOptions
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a local multi-stage pipeline on the CPU and stream a completion",
		Long: `Run a local pipeline of separate stage processes on loopback, on the CPU,
and stream a completion of --prompt to the terminal. Without --model it
generates a tiny random-init checkpoint first, so the text is gibberish:
the point is the machinery.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemo(cmd.Context(), o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.model, "model", "", "Hugging Face model directory (default: a generated tiny model)")
	f.IntVar(&o.stages, "stages", 2, "number of pipeline stages (processes)")
	f.StringVar(&o.prompt, "prompt", "The quick brown fox", "text to complete")
	f.IntVar(&o.maxTokens, "max-tokens", 32, "tokens to generate")
	f.Float32Var(&o.temperature, "temperature", 0, "sampling temperature (0: greedy)")
	f.Uint64Var(&o.seed, "seed", 1, "sampling seed")
	return cmd
}

func runDemo(ctx context.Context, o demoOptions, stdout, stderr io.Writer) error {
	dir := o.model
	if dir == "" {
		tmp, err := os.MkdirTemp("", "tandem-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = filepath.Join(tmp, "model")
		opts := randinit.DefaultOptions()
		if err := randinit.Write(dir, opts); err != nil {
			return fmt.Errorf("generate demo model: %w", err)
		}
		fmt.Fprintf(stdout, "model:   generated tiny %s checkpoint (%d layers, hidden %d) in %s\n", opts.Arch, opts.Layers, opts.Hidden, dir)
	}
	ckpt, err := model.Open(dir)
	if err != nil {
		return err
	}
	cfg := ckpt.Config()
	ckpt.Close()
	tok, err := tokenizer.Load(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return err
	}
	ranges, err := splitLayers(cfg.NumLayers, o.stages)
	if err != nil {
		return err
	}
	exe := o.exe
	if exe == "" {
		if exe, err = os.Executable(); err != nil {
			return err
		}
	}
	start := time.Now()
	cluster, err := startLocalCluster(ctx, exe, o.env, dir, ranges, stderr)
	if err != nil {
		return err
	}
	defer cluster.Close()
	fmt.Fprintf(stdout, "cluster: %d stage processes on loopback, layers %v, ready in %v\n", len(ranges), ranges, time.Since(start).Round(time.Millisecond))

	prompt := tok.Encode(o.prompt, true)
	req := pipeline.Request{
		ID:         1,
		Prompt:     prompt,
		MaxTokens:  o.maxTokens,
		StopTokens: intsToTokens(cfg.EOS),
		Sampling:   stage.Sampling{Temperature: o.temperature, Seed: o.seed},
	}
	fmt.Fprintf(stdout, "prompt:  %d tokens\n\n%s", len(prompt), o.prompt)
	stream := tok.NewStream(true)
	var n int
	start = time.Now()
	err = pipeline.Generate(ctx, cluster.Driver, []pipeline.Request{req}, pipeline.GenerateOptions{MaxContext: cfg.MaxPositions}, func(ev pipeline.Event) error {
		n++
		_, err := io.WriteString(stdout, stream.Add(ev.Token.Token))
		return err
	})
	if err != nil {
		return err
	}
	elapsed := time.Since(start)
	fmt.Fprintf(stdout, "%s\n\n%d tokens in %v (%.1f tokens/s)\n", stream.Flush(), n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds())
	return cluster.Close()
}

func intsToTokens(ids []int) []int32 {
	out := make([]int32, len(ids))
	for i, id := range ids {
		out[i] = int32(id)
	}
	return out
}

package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/model/randinit"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

type demoOptions struct {
	model       string
	stages      int
	prompt      string
	maxTokens   int
	temperature float32
	seed        uint64
	keep        bool
	logLevel    string
	// exe and env start the daemons (default: this executable).
	exe string
	env []string
}

func newDemoCmd() *cobra.Command {
	var o demoOptions
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run a local cluster on the CPU and stream a completion through its gRPC API",
		Long: `Run a local cluster of tandemd serve processes on loopback, on the CPU: a
leader and --stages stage daemons. Stream a completion of --prompt through
the leader's gRPC API, then stop the cluster. Without --model it generates a
tiny random-init checkpoint first, so the text is gibberish: the point is the
machinery. With --keep the cluster stays up (its leader's address is printed
as "leader: HOST:PORT") until Ctrl-C.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			o.logLevel = cmd.Flag("log-level").Value.String()
			if !cmd.Flags().Changed("log-level") && !cmd.Flag("verbose").Changed {
				o.logLevel = "warn"
			}
			if cmd.Flag("verbose").Changed {
				o.logLevel = "debug"
			}
			return runDemo(cmd.Context(), o, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.model, "model", "", "Hugging Face model directory (default: a generated tiny model)")
	f.IntVar(&o.stages, "stages", 2, "number of stage daemons")
	f.StringVar(&o.prompt, "prompt", "The quick brown fox", "text to complete")
	f.IntVar(&o.maxTokens, "max-tokens", 32, "tokens to generate")
	f.Float32Var(&o.temperature, "temperature", 0, "sampling temperature (0: greedy)")
	f.Uint64Var(&o.seed, "seed", 1, "sampling seed")
	f.BoolVar(&o.keep, "keep", false, "leave the cluster up until Ctrl-C")
	return cmd
}

func runDemo(ctx context.Context, o demoOptions, stdout, stderr io.Writer) (err error) {
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
	exe := o.exe
	if exe == "" {
		if exe, err = os.Executable(); err != nil {
			return err
		}
	}
	start := time.Now()
	c, err := startLocalCluster(ctx, clusterSpec{exe: exe, env: o.env, model: dir, stages: o.stages, logLevel: o.logLevel, stderr: stderr})
	if err != nil {
		return err
	}
	defer func() {
		if cerr := c.Close(); cerr != nil {
			err = errors.Join(err, fmt.Errorf("stop the cluster: %w", cerr))
		}
	}()
	st, err := tandemv1.NewAdminClient(c.Conn).Status(ctx, &tandemv1.StatusRequest{})
	if err != nil {
		return fmt.Errorf("status: %w", err)
	}
	var layers [][2]uint32
	for _, s := range st.GetStages() {
		layers = append(layers, [2]uint32{s.GetLayerLo(), s.GetLayerHi()})
	}
	fmt.Fprintf(stdout, "cluster: leader + %d stage daemons on loopback, layers %v, serving in %v\n", o.stages, layers, time.Since(start).Round(time.Millisecond))

	stream, err := tandemv1.NewInferenceClient(c.Conn).Generate(ctx, &tandemv1.GenerateRequest{
		Prompt: o.prompt, MaxTokens: uint32(o.maxTokens), Temperature: o.temperature, Seed: o.seed,
	})
	if err != nil {
		return fmt.Errorf("generate: %w", err)
	}
	fmt.Fprintf(stdout, "\n%s", o.prompt)
	start = time.Now()
	var usage *tandemv1.Usage
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("generate: %w", err)
		}
		io.WriteString(stdout, msg.GetText())
		if msg.GetUsage() != nil {
			usage = msg.GetUsage()
		}
	}
	elapsed := time.Since(start)
	if usage == nil {
		return errors.New("generate: the stream ended without usage")
	}
	fmt.Fprintf(stdout, "\n\n%d prompt tokens, %d generated in %v (%.1f tokens/s)\n", usage.GetPromptTokens(), usage.GetCompletionTokens(), elapsed.Round(time.Millisecond), float64(usage.GetCompletionTokens())/elapsed.Seconds())
	if o.keep {
		fmt.Fprintf(stdout, "\nleader: %s\n", c.Leader.GRPC)
		fmt.Fprintf(stdout, "try:    tandemctl --addr %s status\n        grpcurl -plaintext %s list\nCtrl-C stops the cluster.\n", c.Leader.GRPC, c.Leader.GRPC)
		<-ctx.Done()
	}
	start = time.Now()
	if err := c.Close(); err != nil {
		return fmt.Errorf("stop the cluster: %w", err)
	}
	fmt.Fprintf(stdout, "stopped: every daemon drained and exited cleanly in %v\n", time.Since(start).Round(time.Millisecond))
	return nil
}

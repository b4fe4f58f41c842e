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

	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/model/fortune"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// demoPrompt is the demo's default prompt: the built-in model completes it
// greedily into a whole fortune cookie.
const demoPrompt = "A wise man"

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
the leader's gRPC API, then stop the cluster. Without --model it serves
tandem's own small model (model/fortune: a 5.5M-parameter Llama trained on
Debian's fortune cookies, built into this binary and written to a temporary
directory), which writes fortune-shaped English; --model DIR serves any
Hugging Face checkpoint directory. The daemons log their progress (loading
weights) as lines: -v shows them. With --keep the cluster stays up until
Ctrl-C, its leader serving the OpenAI-compatible HTTP API too: the leader's
gRPC address is printed as "leader: HOST:PORT" and the API's base URL as
"openai: http://HOST:PORT/v1".`,
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
	f.StringVar(&o.model, "model", "", "Hugging Face model directory (default: the built-in fortune model)")
	f.IntVar(&o.stages, "stages", 2, "number of stage daemons")
	f.StringVar(&o.prompt, "prompt", demoPrompt, "text to complete")
	f.IntVar(&o.maxTokens, "max-tokens", 32, "tokens to generate")
	f.Float32Var(&o.temperature, "temperature", 0, "sampling temperature (0: greedy)")
	f.Uint64Var(&o.seed, "seed", 1, "sampling seed")
	f.BoolVar(&o.keep, "keep", false, "leave the cluster up until Ctrl-C")
	return cmd
}

func runDemo(ctx context.Context, o demoOptions, stdout, stderr io.Writer) (err error) {
	if o.stages < 1 {
		return fmt.Errorf("--stages %d: the cluster needs at least 1 stage daemon", o.stages)
	}
	dir := o.model
	if dir == "" {
		tmp, err := os.MkdirTemp("", "tandem-demo-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(tmp)
		dir = filepath.Join(tmp, fortune.Name) // the model's name in the OpenAI API
		if err := fortune.Write(dir); err != nil {
			return err
		}
		ck, err := model.Open(dir)
		if err != nil {
			return fmt.Errorf("the built-in model: %w", err)
		}
		cfg := ck.Config()
		ck.Close()
		fmt.Fprintf(stdout, "model:   built-in %s model (%s, %d layers, hidden %d, %.1f MB) in %s\n", fortune.Name, cfg.Arch, cfg.NumLayers, cfg.HiddenSize, float64(fortune.Size())/1e6, dir)
	}
	exe := o.exe
	if exe == "" {
		if exe, err = os.Executable(); err != nil {
			return err
		}
	}
	start := time.Now()
	spec := clusterSpec{exe: exe, env: o.env, model: dir, stages: o.stages, logLevel: o.logLevel, stderr: stderr}
	if o.keep {
		spec.leaderExtra = []string{"--http", "127.0.0.1:0"}
	}
	c, err := startLocalCluster(ctx, spec)
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
		Prompt: o.prompt, MaxTokens: uint32(o.maxTokens), Temperature: &o.temperature, Seed: o.seed,
	})
	if err != nil {
		return fmt.Errorf("generate: %w", err)
	}
	start = time.Now()
	var (
		usage  *tandemv1.Usage
		finish tandemv1.FinishReason
	)
	for printed := false; ; printed = true {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			if printed { // end the completion's line before the error
				fmt.Fprintln(stdout)
			}
			return fmt.Errorf("generate: %w", err)
		}
		if !printed { // the prompt, once the request was accepted
			fmt.Fprintf(stdout, "\n%s", o.prompt)
		}
		io.WriteString(stdout, msg.GetText())
		if msg.GetUsage() != nil {
			usage, finish = msg.GetUsage(), msg.GetFinishReason()
		}
	}
	elapsed := time.Since(start)
	if usage == nil {
		return errors.New("generate: the stream ended without usage")
	}
	why := "the token limit"
	if finish == tandemv1.FinishReason_FINISH_REASON_STOP {
		why = "the end of the text"
	}
	fmt.Fprintf(stdout, "\n\n%d prompt tokens, %d generated in %v (%.1f tokens/s), stopped at %s\n", usage.GetPromptTokens(), usage.GetCompletionTokens(), elapsed.Round(time.Millisecond), float64(usage.GetCompletionTokens())/elapsed.Seconds(), why)
	if o.keep {
		api := "http://" + c.Leader.HTTP + "/v1"
		fmt.Fprintf(stdout, "\nleader: %s\nopenai: %s\n", c.Leader.GRPC, api)
		fmt.Fprintf(stdout, "try:    tandemctl --addr %s status\n        tandemctl chat --url %s\n        curl %s/models\n        grpcurl -plaintext %s list\nCtrl-C stops the cluster.\n", c.Leader.GRPC, api, api, c.Leader.GRPC)
		<-ctx.Done()
	}
	start = time.Now()
	if err := c.Close(); err != nil {
		return fmt.Errorf("stop the cluster: %w", err)
	}
	fmt.Fprintf(stdout, "stopped: every daemon drained and exited cleanly in %v\n", time.Since(start).Round(time.Millisecond))
	return nil
}

package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/collective"
	"github.com/tandem-llm/tandem/model"
	"github.com/tandem-llm/tandem/pipeline"
	"github.com/tandem-llm/tandem/stage/cpu"
)

type stageOptions struct {
	model     string
	layers    string
	control   string
	listen    string
	next      string
	index     int
	maxTokens int
	maxSeqs   int
}

func newStageCmd() *cobra.Command {
	var o stageOptions
	cmd := &cobra.Command{
		Use:   "stage",
		Short: "Serve one pipeline stage (a layer range) on the CPU",
		Long: `Serve one pipeline stage: load layers LO..HI-1 of the model, accept the
leader's control connection and the previous stage's activations, and send
activations on to the next stage. Prints "ready control=ADDR data=ADDR" on
stdout once listening.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runStage(cmd.Context(), o, cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.model, "model", "", "Hugging Face model directory (required)")
	f.StringVar(&o.layers, "layers", "", "layer range LO:HI (required)")
	f.StringVar(&o.control, "control", "127.0.0.1:0", "address to accept the leader's control connection on")
	f.StringVar(&o.listen, "listen", "127.0.0.1:0", "address to accept the previous stage's activations on (not on the first stage)")
	f.StringVar(&o.next, "next", "", "data address of the next stage (required unless this is the last stage)")
	f.IntVar(&o.index, "index", 0, "this stage's position in the pipeline (for messages)")
	f.IntVar(&o.maxTokens, "max-batch-tokens", 512, "most tokens in one batch")
	f.IntVar(&o.maxSeqs, "max-seqs", 64, "most sequences in one batch")
	cmd.MarkFlagRequired("model")
	cmd.MarkFlagRequired("layers")
	return cmd
}

func runStage(ctx context.Context, o stageOptions, stdout io.Writer) error {
	var lo, hi int
	if _, err := fmt.Sscanf(o.layers, "%d:%d", &lo, &hi); err != nil {
		return fmt.Errorf("--layers %q: want LO:HI", o.layers)
	}
	ckpt, err := model.Open(o.model)
	if err != nil {
		return err
	}
	defer ckpt.Close()
	cfg := ckpt.Config()
	if lo < 0 || hi > cfg.NumLayers || lo >= hi {
		return fmt.Errorf("--layers %d:%d: the model has layers 0:%d", lo, hi, cfg.NumLayers)
	}
	last := hi == cfg.NumLayers
	if !last && o.next == "" {
		return fmt.Errorf("--next is required: layers %d:%d are not the last stage of %d layers", lo, hi, cfg.NumLayers)
	}
	st, err := cpu.New(cpu.Config{Model: cfg, Lo: lo, Hi: hi, Weights: ckpt, MaxTokens: o.maxTokens, MaxSeqs: o.maxSeqs})
	if err != nil {
		return fmt.Errorf("load layers %d:%d: %w", lo, hi, err)
	}
	defer st.Close()

	ctl, err := pipeline.ListenControl(o.control)
	if err != nil {
		return err
	}
	defer ctl.Close()
	var (
		dataLn   *collective.Listener
		dataAddr = "-"
	)
	if lo > 0 {
		if dataLn, err = (collective.ListenConfig{Link: dataLink(lo)}).Listen(o.listen); err != nil {
			return err
		}
		defer dataLn.Close()
		dataAddr = dataLn.Addr().String()
	}
	fmt.Fprintf(stdout, "ready control=%s data=%s\n", ctl.Addr(), dataAddr)
	slog.Info("stage loaded", "layers", o.layers, "control", ctl.Addr(), "data", dataAddr)

	w := &pipeline.Worker{Index: o.index, Stage: st}
	if !last {
		if w.Next, err = (collective.DialConfig{Link: dataLink(hi)}).Dial(ctx, o.next); err != nil {
			return err
		}
		defer w.Next.Close()
	}
	if dataLn != nil {
		if w.Prev, err = dataLn.Accept(ctx); err != nil {
			return err
		}
		defer w.Prev.Close()
	}
	c, err := ctl.Accept(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	w.Ctl = c
	return w.Serve(ctx)
}

// dataLink names the activation link into the stage that starts at layer
// lo, so a stage only accepts activations from the one that ends there.
func dataLink(lo int) string { return fmt.Sprintf("activations->layer%d", lo) }

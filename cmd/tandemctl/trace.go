package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/tandem-llm/tandem/daemon/steptrace"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

// maxTraceBytes bounds the trace the client accepts (about 600 bytes a
// step and stage, so a trace of the most steps fits).
const maxTraceBytes = 1 << 30

func newTraceCmd() *cobra.Command {
	var (
		c       clientFlags
		steps   int
		out     string
		wait    time.Duration
		summary bool
	)
	cmd := &cobra.Command{
		Use:   "trace",
		Short: "Record the leader's next steps as a Chrome trace",
		Long: `Ask the leader to record its next steps, every stage timing its part of
each, and write them as a Chrome trace (Trace Event Format JSON): open it
in https://ui.perfetto.dev or chrome://tracing. One track per stage shows
each step's wait for the leader, hand-off, receive, forward pass and send,
so the pipeline's bubbles are the gaps and waits; the leader's track shows
its scheduling, each step from submission to result, the steps in flight
and each request's time to first token. The summary printed gives each
stage's busy fraction and where the rest of its time went.

Steps are recorded as they happen: run it while requests are served. Needs
the admin token when the cluster has one.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			conn, ctx, done, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			r, err := tandemv1.NewAdminClient(conn).Trace(ctx, &tandemv1.TraceRequest{Steps: uint32(steps), Timeout: durationpb.New(wait)},
				grpc.MaxCallRecvMsgSize(maxTraceBytes))
			if err != nil {
				return fmt.Errorf("trace of %s: %w", c.addr, err)
			}
			js := r.GetTraceJson()
			var tr struct {
				OtherData steptrace.Summary `json:"otherData"`
			}
			if err := json.Unmarshal(js, &tr); err != nil {
				return fmt.Errorf("trace of %s: %w", c.addr, err)
			}
			w := cmd.OutOrStdout()
			if summary {
				return json.NewEncoder(w).Encode(tr.OtherData)
			}
			if out == "-" {
				_, err := w.Write(js)
				return err
			}
			if err := os.WriteFile(out, js, 0o644); err != nil {
				return err
			}
			printTrace(w, &tr.OtherData)
			fmt.Fprintf(w, "\nwrote %s (%d bytes): open it in https://ui.perfetto.dev or chrome://tracing\n", out, len(js))
			return nil
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().IntVar(&steps, "steps", 200, "the number of steps to record")
	cmd.Flags().StringVarP(&out, "out", "o", "tandem-trace.json", "where to write the trace (-: standard output, no summary)")
	cmd.Flags().DurationVar(&wait, "wait", 30*time.Second, "how long the leader waits for the steps (the steps complete by then are written)")
	cmd.Flags().BoolVar(&summary, "summary-json", false, "print only the trace's summary, as JSON, and write no file")
	return cmd
}

// printTrace writes a trace's summary: the steps, then a row per stage.
func printTrace(w io.Writer, s *steptrace.Summary) {
	partial := ""
	if s.Partial {
		partial = " (fewer than asked for"
		if s.PipelineChanged {
			partial += ": the pipeline changed"
		}
		partial += ")"
	}
	fmt.Fprintf(w, "trace: %d steps%s of pipeline epoch %d over %.1f ms: %.2f ms from a step's submission to its result, %.1f steps in flight on average, %d tokens (%.0f tokens/s)\n",
		s.Steps, partial, s.Epoch, s.WindowMs, s.StepMs, s.MeanInFlight, s.Tokens, s.TokensPerS)
	if s.Requests > 0 {
		fmt.Fprintf(w, "requests: %d first tokens, time to first token p50 %.2f ms, max %.2f ms\n", s.Requests, s.TTFTP50Ms, s.TTFTMaxMs)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nSTAGE\tNODE\tBUSY\tDEVICE\tWAIT STEP\tHAND-OFF\tRECV\tSEND\tOTHER\tFORWARD\tCLOCK ±")
	pct := func(f float64) string { return fmt.Sprintf("%.1f%%", 100*f) }
	for _, st := range s.Stages {
		dev := "-"
		if st.DeviceMs > 0 {
			dev = pct(st.DeviceBusy)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.3f ms\t%.0f µs\n", st.Index, st.Node, pct(st.Busy), dev, pct(st.WaitStep), pct(st.Handoff),
			pct(st.Recv), pct(st.Send), pct(st.Other), st.ForwardMs, st.OffsetUncertaintyUs)
	}
	tw.Flush()
}

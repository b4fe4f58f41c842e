package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/daemon/placement"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func newRebalanceCmd() *cobra.Command {
	var (
		c      clientFlags
		asJSON bool
		plan   string
		dryRun bool
		byTime bool
	)
	cmd := &cobra.Command{
		Use:   "rebalance [--plan NODE=LO-HI,... | --by-time] [--dry-run] [--json]",
		Short: "Move the pipeline to a new placement, under load",
		Long: `Ask the leader to recompute the placement of the model over the live,
undrained stage nodes (balanced by their memory), or to apply --plan (layers
[LO, HI) on each NODE, in pipeline order), and move the pipeline to it while
it serves: the new pipeline is built beside the serving one where memory
allows (a stage whose layers do not change keeps its weights), the requests
switch to it at a step boundary and re-prefill there, their streams going on,
then the old stages are released. Prints the layer map before and after with
each stage's KV capacity, and how long the move took. --dry-run only prints
the placement it would move to. Needs the admin token when the cluster has
one.

--by-time divides the layers anew over the serving pipeline's nodes so that
the stages take even times, as their own timing of the steps they have run
predicts (each stage's device time, or forward time where it measures
none): an even split of the layers leaves the last stage slower, for it also
runs the LM head and the sampler. It prints what it measured and the plan,
and applies the plan as --plan would (which pins it against automatic
rebalancing until the membership changes). Run it under load.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ranges, err := parsePlan(plan)
			if err != nil {
				return fmt.Errorf("--plan: %w", err)
			}
			if byTime && ranges != nil {
				return errors.New("--plan and --by-time: give one")
			}
			return adminShow(cmd, &c, asJSON, "rebalance", func(ctx context.Context, a tandemv1.AdminClient) (*tandemv1.MoveResponse, error) {
				if byTime {
					st, err := a.Status(ctx, &tandemv1.StatusRequest{})
					if err != nil {
						return nil, err
					}
					fit, err := placement.ByTime(stageTimes(st))
					if err != nil {
						return nil, err
					}
					printTimeFit(cmd.ErrOrStderr(), fit)
					if fit.Unchanged() {
						// Nothing to move: the answer shows the placement.
						dryRun = true
					}
					for _, r := range fit.After {
						ranges = append(ranges, &tandemv1.LayerRange{Node: r.Node, LayerLo: uint32(r.Lo), LayerHi: uint32(r.Hi)})
					}
				}
				return a.Rebalance(ctx, &tandemv1.RebalanceRequest{Plan: ranges, DryRun: dryRun})
			}, printMove)
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the answer as JSON")
	cmd.Flags().StringVar(&plan, "plan", "", "explicit placement: NODE=LO-HI,... covering every layer in pipeline order")
	cmd.Flags().BoolVar(&dryRun, "dry-run", false, "only print the placement it would move to")
	cmd.Flags().BoolVar(&byTime, "by-time", false, "divide the layers so that the stages take even times, as measured under load")
	return cmd
}

// stageTimes is the serving pipeline's stages with the time each spent in
// its steps: device time where the stage measures it, else forward time.
func stageTimes(st *tandemv1.StatusResponse) []placement.StageTime {
	var ts []placement.StageTime
	for _, s := range st.GetStages() {
		busy := placement.StageBusy(s.GetBusy().AsDuration(), s.GetDeviceBusy().AsDuration())
		ts = append(ts, placement.StageTime{Node: s.GetNode(), Lo: int(s.GetLayerLo()), Hi: int(s.GetLayerHi()), Busy: busy})
	}
	return ts
}

// printTimeFit prints what rebalance --by-time measured and predicts.
func printTimeFit(w io.Writer, fit placement.TimeFit) {
	total := time.Duration(0)
	for _, t := range fit.Times {
		total += t
	}
	fmt.Fprintf(w, "stage times (share of the stages' time): a layer %.1f%%, the LM head and sampling %.1f%%\n",
		100*float64(fit.Layer)/float64(total), 100*float64(fit.Head)/float64(total))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tLAYERS\tTIME\tPLAN\tPREDICTED")
	for i, r := range fit.Before {
		a := fit.After[i]
		fmt.Fprintf(tw, "%s\t[%d, %d)\t%.1f%%\t[%d, %d)\t%.1f%%\n", r.Node, r.Lo, r.Hi, 100*float64(fit.Times[i])/float64(total),
			a.Lo, a.Hi, 100*float64(fit.Predicted[i])/float64(total))
	}
	tw.Flush()
	if fit.Unchanged() {
		fmt.Fprintln(w, "the layers already sit so: nothing to move")
		return
	}
	fmt.Fprintf(w, "slowest stage: %.1f%% -> %.1f%% of the stages' time (%.2fx the throughput where it bounds it)\n",
		100*float64(placement.Slowest(fit.Times))/float64(total), 100*float64(placement.Slowest(fit.Predicted))/float64(total),
		float64(placement.Slowest(fit.Times))/float64(placement.Slowest(fit.Predicted)))
}

func newDrainCmd() *cobra.Command {
	var (
		c      clientFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "drain NODE",
		Short: "Move a stage node's layers to the others and keep it out of placement",
		Long: `Ask the leader to take NODE out of placement: the pipeline moves to the
other stage nodes under load (as rebalance moves it) and NODE's stage is
released; NODE stays in the cluster until "tandemctl undrain NODE". Returns
once the move is done, printing the layer map before and after.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return adminShow(cmd, &c, asJSON, "drain "+args[0], func(ctx context.Context, a tandemv1.AdminClient) (*tandemv1.MoveResponse, error) {
				return a.Drain(ctx, &tandemv1.DrainRequest{Node: args[0]})
			}, printMove)
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the answer as JSON")
	return cmd
}

func newUndrainCmd() *cobra.Command {
	var (
		c      clientFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "undrain NODE",
		Short: "Put a drained stage node back into placement",
		Long: `Ask the leader to put NODE back into placement. With cluster.auto_rebalance
(the default) a rebalance that takes it in follows once the membership has
been stable for a few seconds; when it starts at once, undrain waits for it
and prints the layer map before and after.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return adminShow(cmd, &c, asJSON, "undrain "+args[0], func(ctx context.Context, a tandemv1.AdminClient) (*tandemv1.MoveResponse, error) {
				return a.Undrain(ctx, &tandemv1.UndrainRequest{Node: args[0]})
			}, printMove)
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the answer as JSON")
	return cmd
}

// parsePlan reads NODE=LO-HI,... (empty: no plan).
func parsePlan(s string) ([]*tandemv1.LayerRange, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []*tandemv1.LayerRange
	for _, part := range strings.Split(s, ",") {
		node, r, ok := strings.Cut(strings.TrimSpace(part), "=")
		lo, hi, ok2 := strings.Cut(r, "-")
		l, err1 := strconv.ParseUint(lo, 10, 32)
		h, err2 := strconv.ParseUint(hi, 10, 32)
		if !ok || !ok2 || node == "" || err1 != nil || err2 != nil {
			return nil, fmt.Errorf("%q: want NODE=LO-HI (layers [LO, HI))", part)
		}
		if l >= h {
			return nil, fmt.Errorf("%q: layers [%d, %d) are empty", part, l, h)
		}
		out = append(out, &tandemv1.LayerRange{Node: node, LayerLo: uint32(l), LayerHi: uint32(h)})
	}
	return out, nil
}

// printMove writes the layer maps before and after a move and what
// happened.
func printMove(w io.Writer, r *tandemv1.MoveResponse) error {
	printLayerMap(w, "before", r.GetBefore(), r.GetBeforeKvTokens())
	after := "after"
	if r.GetMoved() {
		after = fmt.Sprintf("after (epoch %d)", r.GetEpoch())
	}
	fmt.Fprintln(w)
	printLayerMap(w, after, r.GetAfter(), r.GetAfterKvTokens())
	for _, l := range r.GetLeftOut() {
		fmt.Fprintf(w, "  left out: %s %s\n", l.GetNode(), l.GetReason())
	}
	fmt.Fprintln(w)
	if r.GetMoved() {
		fmt.Fprintf(w, "moved to epoch %d in %v; %d running requests re-prefilled on it\n", r.GetEpoch(), r.GetMoveTime().AsDuration().Round(1e6), r.GetRequestsReprefilled())
	}
	if r.GetNote() != "" {
		fmt.Fprintln(w, r.GetNote())
	}
	return nil
}

// printLayerMap writes one layer map as a table.
func printLayerMap(w io.Writer, title string, stages []*tandemv1.PlannedStage, kv uint64) {
	if len(stages) == 0 {
		fmt.Fprintf(w, "%s: no pipeline\n", title)
		return
	}
	capacity := fmt.Sprintf("KV capacity %d tokens", kv)
	if stages[0].GetEstimate() {
		capacity = fmt.Sprintf("KV capacity about %d tokens (placement's estimate from memory)", kv)
	}
	fmt.Fprintf(w, "%s: %s\n", title, capacity)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  STAGE\tNODE\tLAYERS\tBACKEND\tKV TOKENS\tWEIGHTS")
	for i, s := range stages {
		weights := "loaded"
		switch {
		case s.GetEstimate():
			weights = "-"
		case s.GetReused():
			weights = "reused"
		}
		fmt.Fprintf(tw, "  %d\t%s\t[%d, %d)\t%s\t%d\t%s\n", i, s.GetNode(), s.GetLayerLo(), s.GetLayerHi(), s.GetBackend(), s.GetKvTokens(), weights)
	}
	tw.Flush()
}

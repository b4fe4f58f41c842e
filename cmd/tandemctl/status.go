package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func newStatusCmd() *cobra.Command {
	var (
		c      clientFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show the cluster: members, leader, stages and requests",
		Long: `Ask a daemon (normally the leader) for the cluster's status: the members
and their health, the leader, the pipeline's stages and the requests
running and waiting, the drained nodes and the stage nodes placement left
out (too small to hold a layer, or so small that their KV cache would cap
the pipeline's), with why. Needs the admin token when the cluster has one.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return adminShow(cmd, &c, asJSON, "status", func(ctx context.Context, a tandemv1.AdminClient) (*tandemv1.StatusResponse, error) {
				return a.Status(ctx, &tandemv1.StatusRequest{})
			}, printStatus)
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the status as JSON")
	return cmd
}

// printStatus writes the status as readable tables.
func printStatus(w io.Writer, st *tandemv1.StatusResponse) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	leader := "none"
	if st.GetLeader() != "" {
		leader = fmt.Sprintf("%s at %s", st.GetLeader(), st.GetLeaderAddr())
	}
	pipe := "not serving: " + st.GetReason()
	if st.GetLeader() != "" && st.GetLeader() != st.GetNode() {
		pipe = st.GetReason() // who leads, and whether this node serves a stage
	}
	if st.GetServing() {
		pipe = fmt.Sprintf("serving, epoch %d, KV capacity %d tokens, %d requests running, %d waiting",
			st.GetEpoch(), st.GetKvTokens(), st.GetRequestsRunning(), st.GetRequestsWaiting())
	}
	fmt.Fprintf(tw, "node:\t%s (version %s)\n", st.GetNode(), st.GetVersion())
	fmt.Fprintf(tw, "leader:\t%s\n", leader)
	fmt.Fprintf(tw, "pipeline:\t%s\n", pipe)
	fmt.Fprintf(tw, "model:\t%s\n", st.GetModelId())
	if len(st.GetDrained()) > 0 {
		fmt.Fprintf(tw, "drained:\t%s (out of placement; tandemctl undrain NODE puts one back)\n", strings.Join(st.GetDrained(), ", "))
	}
	for i, l := range st.GetLeftOut() {
		label := ""
		if i == 0 {
			label = "left out:"
		}
		fmt.Fprintf(tw, "%s\t%s %s\n", label, l.GetNode(), l.GetReason())
	}
	if c := st.GetLastChange(); c != nil {
		fmt.Fprintf(tw, "change:\t%s\n", changeText(c))
	}
	if st.GetRecoveries()+st.GetMoves() > 0 {
		fmt.Fprintf(tw, "changes:\t%d recoveries, %d moves since this node started\n", st.GetRecoveries(), st.GetMoves())
	}
	if sc := st.GetScheduler(); sc != nil {
		printScheduler(tw, sc)
	}
	if st.GetServing() {
		handoff := "off"
		if st.GetHandoff() {
			handoff = "on"
		}
		fmt.Fprintf(tw, "graphs:	CUDA-graph mode %s; on-device hand-off %s, up to %d steps in flight\n", st.GetGraphMode(), handoff, st.GetMaxInFlight())
	}
	tw.Flush()

	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MEMBER\tSTATE\tBACKEND\tSTAGE MEMORY\tGRPC\tGOSSIP\tVERSION\tMODEL\tDEVICE")
	for _, m := range st.GetMembers() {
		model := short(m.GetModelId())
		if m.GetModelId() != st.GetModelId() {
			model += " (differs)"
		}
		state := strings.ToLower(strings.TrimPrefix(m.GetState().String(), "MEMBER_STATE_"))
		if slices.Contains(st.GetDrained(), m.GetName()) {
			state += ", drained"
		}
		if slices.ContainsFunc(st.GetLeftOut(), func(l *tandemv1.LeftOutNode) bool { return l.GetNode() == m.GetName() }) {
			state += ", left out"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.GetName(), state, m.GetBackend(), bytesText(m.GetMemFree()),
			m.GetGrpcAddr(), m.GetGossipAddr(), m.GetVersion(), model, m.GetDevice())
	}
	tw.Flush()

	if len(st.GetStages()) > 0 {
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "STAGE\tNODE\tLAYERS\tBACKEND\tMEMORY\tKV TOKENS\tWEIGHTS\tKV CACHE\tGRAPHS\tGRAPH MEMORY\tCAPTURE\tNEXT\tBUSY\tDEVICE")
		for _, s := range st.GetStages() {
			next := s.GetNextLink()
			if next == "" {
				next = "-"
			}
			fmt.Fprintf(tw, "%d\t%s\t[%d, %d)\t%s\t%s\t%d\t%s\t%s\t%d\t%s\t%v\t%s\t%s\t%s\n", s.GetIndex(), s.GetNode(), s.GetLayerLo(), s.GetLayerHi(), s.GetBackend(),
				bytesText(s.GetMemoryBytes()), s.GetKvTokens(), bytesText(s.GetWeightBytes()), bytesText(s.GetKvBytes()), s.GetGraphs(), bytesText(s.GetGraphBytes()),
				s.GetCaptureTime().AsDuration(), next, busyText(s), s.GetDevice())
		}
		tw.Flush()
	}
	return nil
}

// changeText describes the pipeline's last change: what, why, when, how
// long, and the requests it re-prefilled.
func changeText(c *tandemv1.PipelineChange) string {
	when := c.GetStart().AsTime().Local().Format("2006-01-02 15:04:05.000")
	var how string
	switch {
	case c.GetInProgress():
		how = "in progress"
	case c.GetError() != "":
		how = fmt.Sprintf("failed after %v: %s", c.GetTook().AsDuration().Round(time.Millisecond), c.GetError())
	default:
		how = fmt.Sprintf("took %v, to epoch %d; %d running requests re-prefilled (%d tokens)",
			c.GetTook().AsDuration().Round(time.Millisecond), c.GetEpoch(), c.GetRequestsReprefilled(), c.GetTokensReprefilled())
	}
	return fmt.Sprintf("%s at %s (%s): %s", c.GetKind(), when, c.GetWhy(), how)
}

// printScheduler writes the leader's scheduler figures as rows of the
// header table.
func printScheduler(tw io.Writer, sc *tandemv1.SchedulerStats) {
	usage := 0.0
	if sc.GetKvBlocks() > 0 {
		usage = 100 * float64(sc.GetKvBlocksUsed()) / float64(sc.GetKvBlocks())
	}
	fmt.Fprintf(tw, "requests:\t%d running, %d waiting, %d finished, %d cancelled\n",
		sc.GetRunning(), sc.GetWaiting(), sc.GetFinished(), sc.GetCancelled())
	fmt.Fprintf(tw, "KV cache:\t%d of %d blocks used (%.1f%%), %d positions a block\n",
		sc.GetKvBlocksUsed(), sc.GetKvBlocks(), usage, sc.GetBlockSize())
	fmt.Fprintf(tw, "steps:\t%d done, %d in flight, step time %v last, %v mean; %d preemptions, %d tokens discarded\n",
		sc.GetSteps(), sc.GetInFlight(), sc.GetLastStepTime().AsDuration(), sc.GetMeanStepTime().AsDuration(),
		sc.GetPreemptions(), sc.GetDiscardedTokens())
	if sc.GetReprefilled()+sc.GetFailed() > 0 {
		fmt.Fprintf(tw, "recovery:\t%d requests re-prefilled on a new pipeline (%d tokens), %d failed for want of one\n",
			sc.GetReprefilled(), sc.GetReprefilledTokens(), sc.GetFailed())
	}
}

// busyText is a stage's busy fraction over the last second, its device's
// in parentheses where the stage measures it.
func busyText(s *tandemv1.Stage) string {
	t := fmt.Sprintf("%.0f%%", 100*s.GetBusyFraction())
	if s.GetDeviceBusy().AsDuration() > 0 {
		t += fmt.Sprintf(" (device %.0f%%)", 100*s.GetDeviceBusyFraction())
	}
	return t
}

func short(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// bytesText writes a size in binary units.
func bytesText(n uint64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	v, i := float64(n), 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

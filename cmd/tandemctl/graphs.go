package main

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/tandem-llm/tandem/graphs"
	tandemv1 "github.com/tandem-llm/tandem/proto/tandem/v1"
)

func newGraphsCmd() *cobra.Command {
	var (
		c      clientFlags
		asJSON bool
	)
	cmd := &cobra.Command{
		Use:   "graphs",
		Short: "Show the leader's CUDA-graph dispatch statistics",
		Long: `Ask the leader how it dispatches CUDA graphs: the mode (after the stages'
support reduced the configured one, and why), the capture sizes, and how
many steps ran at each unpadded token count, padded token count and
runtime mode (NONE: eager). Needs the admin token when the cluster has one.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return adminShow(cmd, &c, asJSON, "graphs", func(ctx context.Context, a tandemv1.AdminClient) (*tandemv1.GraphsResponse, error) {
				return a.Graphs(ctx, &tandemv1.GraphsRequest{})
			}, printGraphs)
		},
	}
	c.register(cmd.Flags())
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the statistics as JSON")
	return cmd
}

// printGraphs writes the dispatch: the mode and capture sizes, then the
// step counts as graphs.WriteTable does.
func printGraphs(w io.Writer, g *tandemv1.GraphsResponse) error {
	fmt.Fprintf(w, "mode: %s (configured %s)\n", g.GetMode(), g.GetConfiguredMode())
	for _, d := range g.GetDowngrades() {
		fmt.Fprintf(w, "  downgraded: %s\n", d)
	}
	if m, err := graphs.ParseMode(g.GetMode()); err == nil && m == graphs.None {
		// Nothing is captured: the sizes a mode with graphs would capture
		// are noise here.
		fmt.Fprintf(w, "capture sizes: none (mode %s captures no graphs)\n", g.GetMode())
	} else {
		sizes := make([]string, len(g.GetCaptureSizes()))
		for i, s := range g.GetCaptureSizes() {
			sizes[i] = fmt.Sprint(s)
		}
		fmt.Fprintf(w, "capture sizes: %s\n", strings.Join(sizes, " "))
	}
	rows := make([]graphs.Row, len(g.GetSteps()))
	for i, s := range g.GetSteps() {
		m, err := graphs.ParseMode(s.GetMode())
		if err != nil {
			return fmt.Errorf("step count %d: %w", i, err)
		}
		rows[i] = graphs.Row{Unpadded: int(s.GetUnpadded()), Padded: int(s.GetPadded()), Mode: m, Count: s.GetCount()}
	}
	return graphs.WriteTable(w, rows)
}

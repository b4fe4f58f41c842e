// Command tandemctl is tandem's operator and user tool: it shows a
// cluster's status and CUDA-graph dispatch, completes prompts through the
// leader's gRPC API, measures its throughput and latency, writes
// random-init checkpoints and checks prompts against a tokenizer. The leader's address comes from --addr or
// $TANDEM_ADDR, the admin token from --token or $TANDEM_TOKEN.
package main

import (
	"fmt"
	"os"

	"github.com/spf13/cobra"
)

func main() {
	if err := newRootCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "tandemctl:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "tandemctl",
		Short:         "Operate a tandem cluster and check models and prompts",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newStatusCmd(), newGraphsCmd(), newGenerateCmd(), newBenchCmd(), newModelCmd(), newTokenizeCmd())
	return root
}

// Command tandemctl is tandem's operator and user tool: it writes
// random-init checkpoints and checks prompts against a tokenizer.
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
	root.AddCommand(newModelCmd(), newTokenizeCmd())
	return root
}

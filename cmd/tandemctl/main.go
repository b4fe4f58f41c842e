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
	root.AddCommand(newStatusCmd(), newGraphsCmd(), newRebalanceCmd(), newDrainCmd(), newUndrainCmd(), newGenerateCmd(), newBenchCmd(), newTraceCmd(), newModelCmd(), newTokenizeCmd(), newChatTemplateCmd(), newChatCmd())
	return root
}

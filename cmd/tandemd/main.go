// Command tandemd is the tandem node daemon.
//
// At this stage of the project it runs one pipeline stage per process
// (tandemd stage) and a local demo cluster of such processes (tandemd demo).
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := newRootCmd().ExecuteContext(ctx); err != nil {
		fmt.Fprintln(os.Stderr, "tandemd:", err)
		os.Exit(1)
	}
}

func newRootCmd() *cobra.Command {
	var verbose bool
	root := &cobra.Command{
		Use:           "tandemd",
		Short:         "tandem node daemon: serves a language model by pipeline parallelism",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRun: func(*cobra.Command, []string) {
			level := slog.LevelWarn
			if verbose {
				level = slog.LevelDebug
			}
			slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
		},
	}
	root.PersistentFlags().BoolVarP(&verbose, "verbose", "v", false, "log debug messages to stderr")
	root.AddCommand(newDemoCmd(), newStageCmd())
	return root
}

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
	var (
		verbose  bool
		logLevel string
	)
	root := &cobra.Command{
		Use:           "tandemd",
		Short:         "tandem node daemon: serves a language model by pipeline parallelism",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			var level slog.Level
			if err := level.UnmarshalText([]byte(logLevel)); err != nil {
				return fmt.Errorf("--log-level %q: want debug, info, warn or error", logLevel)
			}
			if verbose {
				level = slog.LevelDebug
			}
			slog.SetDefault(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level})))
			return nil
		},
	}
	root.PersistentFlags().BoolVarP(&verbose, "verbose", "v", false, "log debug messages to stderr (same as --log-level debug)")
	root.PersistentFlags().StringVar(&logLevel, "log-level", "info", "least level logged to stderr: debug, info, warn or error")
	root.AddCommand(newServeCmd(), newDemoCmd())
	return root
}
